/* fsdp-bench: the parameter store's data path end to end. L trainer processes, each a local
 * rank with its own session and mapping, drive Unshard or ReduceScatter of one unit through
 * an fsdpd the bench starts. An iteration's time runs from the bench's "go" to the return of
 * the slowest rank (CLOCK_MONOTONIC is one clock for every process), so it holds the RPCs,
 * the daemon's scheduling and the kernels. Measured in the same run: a 2-thread memcpy of
 * the same bytes, and the memory-traffic bound of the operation at that memcpy's bandwidth.
 *
 *   fsdp-bench --op unshard|reduce_scatter --ranks L --size 64MiB --dtype fp32|bf16 [--json]
 *
 * --size is the unit's parameters in fp32 (its master shards), so a 64MiB unit has 16 Mi
 * elements; --dtype is the unsharded copy's type, which is also the gradients' and their
 * reduction's. The trainers are forked before the bench makes any gRPC client (gRPC forbids
 * fork() afterwards) and talk to the parent over pipes. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <json-c/json.h>

#include <fsdp/fsdp_client.h>
#include <fsdp/fsdp_error.h>
#include <fsdp/fsdp_trainer.h>

#include "bench_daemon.h"

enum { EXIT_OK = 0, EXIT_FAILED = 1, EXIT_USAGE = 2 };

#define MAX_RANKS 16
#define ERROR_MAX 512
#define MEMCPY_RUNS 11

typedef enum op_kind { OP_UNSHARD, OP_REDUCE_SCATTER } op_kind_t;

typedef struct options {
  op_kind_t op;
  unsigned ranks;
  size_t size; /* bytes of fp32 parameters */
  fsdp_scalar_t dtype;
  unsigned runs, warmup;
  bool json;
} options_t;

/* Pipes between the bench and one trainer process. Commands go down as one byte each; the
 * trainer answers with one int64: a monotonic timestamp in ns, 0 for "ready", or a negative
 * error code (its message on its stderr). */
typedef struct rank_proc {
  pid_t pid;
  int cmd_fd;    /* the bench writes */
  int result_fd; /* the bench reads */
} rank_proc_t;

enum { CMD_START = 'S', CMD_ITERATE = 'I', CMD_QUIT = 'Q' };

static size_t scalar_size(fsdp_scalar_t t) {
  return t == FSDP_SCALAR_FP32 ? 4 : 2;
}

/* Writes the whole buffer; pipes between our own processes only fail if a side died. */
static int write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int read_all(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = read(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return -1;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* The trainer process. */

static int64_t fail(fsdp_client_t *client, unsigned rank, const char *what, int r) {
  fprintf(stderr, "fsdp-bench: rank %u: %s: %s: %s\n", rank, what, fsdp_strerror(r),
          client ? fsdp_client_last_error(client) : "");
  return r < 0 ? r : -1;
}

/* Attaches, registers the unit and fills this rank's master shard and full gradient. */
static int64_t rank_setup(const options_t *o, unsigned rank, const char *socket_path,
                          fsdp_client_t **ret_client, fsdp_trainer_t **ret_trainer,
                          fsdp_unit_handle_t **ret_unit) {
  char target[200];
  snprintf(target, sizeof target, "unix:%s", socket_path);
  fsdp_client_options_t copts = FSDP_CLIENT_OPTIONS_INIT;
  copts.timeout_ms = 120000; /* pre-faulting a large unit takes a while */
  int r = fsdp_client_connect(target, &copts, ret_client);
  if (r < 0)
    return fail(NULL, rank, "connect", r);
  fsdp_trainer_options_t topts = {.job = "bench", .local_rank = rank, .local_world_size = o->ranks};
  if ((r = fsdp_trainer_attach(*ret_client, &topts, ret_trainer)) < 0)
    return fail(*ret_client, rank, "attach", r);
  uint64_t shape[1] = {o->size / 4};
  fsdp_param_desc_t param = {.name = "weight", .shape = shape, .ndim = 1, .requires_grad = true};
  fsdp_unit_desc_t desc = {.name = "unit", .params = &param, .n_params = 1,
                           .strategy = FSDP_FULL_SHARD, .param_type = o->dtype,
                           .reduce_type = o->dtype};
  if ((r = fsdp_trainer_register_unit(*ret_trainer, &desc, ret_unit)) < 0)
    return fail(*ret_client, rank, "register_unit", r);
  const fsdp_unit_view_t *v = fsdp_unit_view(*ret_unit);
  float *shard = v->master + v->shard * v->shard_numel;
  for (uint64_t i = 0; i < v->shard_numel; i++)
    shard[i] = (float)((i + v->shard) % 1000) * 0.001f;
  memset(v->full_grad, 0x3c, v->padded_numel * scalar_size(o->dtype)); /* finite values */
  return 0;
}

static int64_t rank_iterate(const options_t *o, fsdp_client_t *client, fsdp_trainer_t *t,
                            fsdp_unit_handle_t *unit, unsigned rank, uint64_t step) {
  int r;
  if (o->op == OP_UNSHARD) {
    if ((r = fsdp_trainer_unshard(t, unit, step)) < 0)
      return fail(client, rank, "unshard", r);
    int64_t end = (int64_t)now_ns();
    /* Let go, so that the next iteration gathers again. */
    if ((r = fsdp_trainer_reshard(t, unit, step)) < 0)
      return fail(client, rank, "reshard", r);
    return end;
  }
  if ((r = fsdp_trainer_reduce_scatter(t, unit, step, false)) < 0)
    return fail(client, rank, "reduce_scatter", r);
  return (int64_t)now_ns();
}

static void rank_main(const options_t *o, unsigned rank, int cmd_fd, int result_fd) {
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the bench */
  char cmd, socket_path[128];
  fsdp_client_t *client = NULL;
  fsdp_trainer_t *trainer = NULL;
  fsdp_unit_handle_t *unit = NULL;
  if (read_all(cmd_fd, &cmd, 1) < 0 || cmd != CMD_START ||
      read_all(cmd_fd, socket_path, sizeof socket_path) < 0)
    _exit(EXIT_FAILED);
  int64_t result = rank_setup(o, rank, socket_path, &client, &trainer, &unit);
  if (write_all(result_fd, &result, sizeof result) < 0 || result < 0)
    goto out;
  for (uint64_t step = 1; read_all(cmd_fd, &cmd, 1) == 0 && cmd == CMD_ITERATE; step++) {
    result = rank_iterate(o, client, trainer, unit, rank, step);
    if (write_all(result_fd, &result, sizeof result) < 0 || result < 0)
      break;
  }
out:
  fsdp_trainer_detach(trainer);
  fsdp_client_close(client);
  _exit(result < 0 ? EXIT_FAILED : EXIT_OK);
}

static int fork_ranks(const options_t *o, rank_proc_t *ranks, char *err, size_t err_size) {
  for (unsigned r = 0; r < o->ranks; r++) {
    int down[2], up[2];
    if (pipe2(down, O_CLOEXEC) < 0 || pipe2(up, O_CLOEXEC) < 0)
      return set_error(err, err_size, "pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
      return set_error(err, err_size, "fork: %s", strerror(errno));
    if (pid == 0) {
      close(down[1]);
      close(up[0]);
      rank_main(o, r, down[0], up[1]);
    }
    close(down[0]);
    close(up[1]);
    ranks[r] = (rank_proc_t){.pid = pid, .cmd_fd = down[1], .result_fd = up[0]};
  }
  return 0;
}

/* Sends cmd to every rank and collects their answers; *ret_latest is the largest. */
static int round_trip(const options_t *o, rank_proc_t *ranks, char cmd, const void *extra,
                      size_t extra_len, int64_t *ret_latest, char *err, size_t err_size) {
  for (unsigned r = 0; r < o->ranks; r++)
    if (write_all(ranks[r].cmd_fd, &cmd, 1) < 0 ||
        (extra && write_all(ranks[r].cmd_fd, extra, extra_len) < 0))
      return set_error(err, err_size, "rank %u is gone", r);
  int64_t latest = 0;
  for (unsigned r = 0; r < o->ranks; r++) {
    int64_t v;
    if (read_all(ranks[r].result_fd, &v, sizeof v) < 0)
      return set_error(err, err_size, "rank %u died (see its message above)", r);
    if (v < 0)
      return set_error(err, err_size, "rank %u failed: %s", r, fsdp_strerror((int)v));
    if (v > latest)
      latest = v;
  }
  *ret_latest = latest;
  return 0;
}

static void stop_ranks(const options_t *o, rank_proc_t *ranks) {
  for (unsigned r = 0; r < o->ranks; r++) {
    if (ranks[r].pid <= 0)
      continue;
    char quit = CMD_QUIT;
    if (write_all(ranks[r].cmd_fd, &quit, 1) < 0)
      kill(ranks[r].pid, SIGKILL);
    close(ranks[r].cmd_fd);
    close(ranks[r].result_fd);
    waitpid(ranks[r].pid, NULL, 0);
  }
}

/* The peer: a 2-thread memcpy of `size` bytes on pre-faulted buffers. */

typedef struct copy_job {
  char *dst;
  const char *src;
  size_t len;
} copy_job_t;

static void *copy_half(void *arg) {
  copy_job_t *j = arg;
  memcpy(j->dst, j->src, j->len);
  return NULL;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, size_t n) {
  qsort(v, n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static int time_memcpy(size_t size, double *ret_ms) {
  char *src = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
  char *dst = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                   -1, 0);
  if (src == MAP_FAILED || dst == MAP_FAILED)
    return -ENOMEM;
  memset(src, 1, size);
  memset(dst, 2, size);
  double times[MEMCPY_RUNS + 1];
  for (int run = 0; run <= MEMCPY_RUNS; run++) { /* run 0 warms up */
    size_t half = size / 2 / 64 * 64;
    copy_job_t jobs[2] = {{dst, src, half}, {dst + half, src + half, size - half}};
    uint64_t t0 = now_ns();
    pthread_t other;
    pthread_create(&other, NULL, copy_half, &jobs[1]);
    copy_half(&jobs[0]);
    pthread_join(other, NULL);
    times[run] = (double)(now_ns() - t0) / 1e6;
  }
  *ret_ms = median(times + 1, MEMCPY_RUNS);
  munmap(src, size);
  munmap(dst, size);
  return 0;
}

/* Running it. */

typedef struct result {
  double median_ms, min_ms;
  double memcpy_ms;
  double bound_ms; /* the operation's bytes at the memcpy's bandwidth */
} result_t;

static int run(const options_t *o, result_t *res, char *err, size_t err_size) {
  rank_proc_t ranks[MAX_RANKS] = {0};
  daemon_proc_t d = {.pid = -1};
  fsdp_client_t *probe = NULL;
  int rc = -1;
  /* The peer first, on a quiet machine (after the run, the kernel is still reclaiming the
   * daemon's memory), and unmapped before the trainers are forked. */
  if (time_memcpy(o->size, &res->memcpy_ms) < 0)
    return set_error(err, err_size, "cannot map two buffers of %zu bytes", o->size);
  if (fork_ranks(o, ranks, err, err_size) < 0)
    goto out;

  /* The job's memory: the unit's buffers (unsharded, fp32 master and gradient shards, one
   * full gradient per rank) and room for rounding. */
  size_t numel = o->size / 4, dsize = scalar_size(o->dtype);
  size_t need = numel * (dsize * (1 + o->ranks) + 8) + (64u << 20);
  char job_limit[64];
  snprintf(job_limit, sizeof job_limit, "memory.job_limit=%zuMiB", (need >> 20) + 1);
  const char *extra[] = {"--set", job_limit, "--set", "store.collective_timeout=60s", NULL};
  if (bench_daemon_spawn(&d, "fsdp-bench", extra, err, err_size) < 0)
    goto out;
  char target[200];
  snprintf(target, sizeof target, "unix:%s", d.socket_path);
  if (fsdp_client_connect(target, NULL, &probe) < 0 ||
      bench_daemon_wait_serving(&d, probe, d.ready_deadline, err, err_size) < 0)
    goto out;

  int64_t ignored;
  char path[128] = "";
  snprintf(path, sizeof path, "%s", d.socket_path);
  if (round_trip(o, ranks, CMD_START, path, sizeof path, &ignored, err, err_size) < 0)
    goto out;
  double *times = calloc(o->runs, sizeof *times);
  if (!times)
    goto out;
  for (unsigned i = 0; i < o->warmup + o->runs && !bench_interrupted; i++) {
    int64_t go = (int64_t)now_ns(), end;
    if (round_trip(o, ranks, CMD_ITERATE, NULL, 0, &end, err, err_size) < 0) {
      free(times);
      goto out;
    }
    if (i >= o->warmup)
      times[i - o->warmup] = (double)(end - go) / 1e6;
  }
  if (bench_interrupted) {
    free(times);
    set_error(err, err_size, "interrupted");
    goto out;
  }
  res->median_ms = median(times, o->runs);
  res->min_ms = times[0]; /* sorted by median() */
  free(times);
  rc = 0;

out:
  stop_ranks(o, ranks);
  fsdp_client_close(probe);
  if (d.pid > 0) {
    char stop_err[ERROR_MAX];
    if (bench_daemon_stop(&d, stop_err, sizeof stop_err) < 0 && rc == 0) {
      snprintf(err, err_size, "%s", stop_err);
      rc = -1;
    }
  }
  if (rc < 0)
    return rc;
  double bandwidth = 2.0 * (double)o->size / res->memcpy_ms; /* bytes read + written per ms */
  double traffic = o->op == OP_UNSHARD
                       ? (double)numel * (4 + dsize)                     /* masters in, copy out */
                       : (double)numel * (dsize * o->ranks + 4);         /* L gradients in, shards out */
  res->bound_ms = traffic / bandwidth;
  return 0;
}

static void usage(FILE *f) {
  fputs("usage: fsdp-bench --op unshard|reduce_scatter [--ranks L] [--size SIZE]\n"
        "                  [--dtype fp32|bf16] [--runs N] [--warmup N] [--json]\n"
        "  --ranks L     trainer processes, 1 to 16 (default 2)\n"
        "  --size SIZE   the unit's fp32 parameters: 1MiB, 64MiB, 1GiB... (default 64MiB)\n"
        "  --dtype T     the unsharded copy's and the gradients' type (default fp32)\n"
        "  --runs N      timed iterations (default 10), after --warmup N (default 2)\n",
        f);
}

static int parse_size(const char *s, size_t *ret) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s)
    return -1;
  if (strcmp(end, "KiB") == 0)
    v <<= 10;
  else if (strcmp(end, "MiB") == 0)
    v <<= 20;
  else if (strcmp(end, "GiB") == 0)
    v <<= 30;
  else if (*end && strcmp(end, "B") != 0)
    return -1;
  if (v < 4096 || v > (64ull << 30))
    return -1;
  *ret = (size_t)v;
  return 0;
}

int main(int argc, char **argv) {
  options_t o = {.op = OP_UNSHARD, .ranks = 2, .size = 64u << 20, .dtype = FSDP_SCALAR_FP32,
                 .runs = 10, .warmup = 2};
  bool have_op = false;
  static const struct option longopts[] = {
      {"op", required_argument, NULL, 'o'},     {"ranks", required_argument, NULL, 'r'},
      {"size", required_argument, NULL, 's'},   {"dtype", required_argument, NULL, 'd'},
      {"runs", required_argument, NULL, 'n'},   {"warmup", required_argument, NULL, 'w'},
      {"json", no_argument, NULL, 'j'},         {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "o:r:s:d:n:w:jh", longopts, NULL)) != -1) {
    char *end;
    switch (c) {
    case 'o':
      have_op = true;
      if (strcmp(optarg, "unshard") == 0)
        o.op = OP_UNSHARD;
      else if (strcmp(optarg, "reduce_scatter") == 0)
        o.op = OP_REDUCE_SCATTER;
      else
        goto bad;
      break;
    case 'r':
      o.ranks = (unsigned)strtoul(optarg, &end, 10);
      if (*end || o.ranks < 1 || o.ranks > MAX_RANKS)
        goto bad;
      break;
    case 's':
      if (parse_size(optarg, &o.size) < 0)
        goto bad;
      break;
    case 'd':
      if (strcmp(optarg, "fp32") == 0)
        o.dtype = FSDP_SCALAR_FP32;
      else if (strcmp(optarg, "bf16") == 0)
        o.dtype = FSDP_SCALAR_BF16;
      else
        goto bad;
      break;
    case 'n':
    case 'w': {
      unsigned long v = strtoul(optarg, &end, 10);
      if (*end || v > 10000 || (c == 'n' && v == 0))
        goto bad;
      *(c == 'n' ? &o.runs : &o.warmup) = (unsigned)v;
      break;
    }
    case 'j':
      o.json = true;
      break;
    case 'h':
      usage(stdout);
      return EXIT_OK;
    default:
      usage(stderr);
      return EXIT_USAGE;
    }
  }
  if (!have_op || optind < argc) {
    fprintf(stderr, "fsdp-bench: %s\n", have_op ? "unexpected argument" : "--op is required");
    usage(stderr);
    return EXIT_USAGE;
  }
  bench_catch_signals();

  result_t res = {0};
  char err[ERROR_MAX] = "";
  if (run(&o, &res, err, sizeof err) < 0) {
    fprintf(stderr, "fsdp-bench: %s\n", err);
    return EXIT_FAILED;
  }
  const char *op = o.op == OP_UNSHARD ? "unshard" : "reduce_scatter";
  const char *dtype = o.dtype == FSDP_SCALAR_FP32 ? "fp32" : "bf16";
  if (o.json) {
    json_object *j = json_object_new_object();
    json_object_object_add(j, "op", json_object_new_string(op));
    json_object_object_add(j, "ranks", json_object_new_int64(o.ranks));
    json_object_object_add(j, "size_bytes", json_object_new_uint64(o.size));
    json_object_object_add(j, "dtype", json_object_new_string(dtype));
    json_object_object_add(j, "runs", json_object_new_int64(o.runs));
    json_object_object_add(j, "median_ms", json_object_new_double(res.median_ms));
    json_object_object_add(j, "min_ms", json_object_new_double(res.min_ms));
    json_object_object_add(j, "memcpy_ms", json_object_new_double(res.memcpy_ms));
    json_object_object_add(j, "bound_ms", json_object_new_double(res.bound_ms));
    json_object_object_add(j, "x_memcpy", json_object_new_double(res.median_ms / res.memcpy_ms));
    json_object_object_add(j, "x_bound", json_object_new_double(res.median_ms / res.bound_ms));
    puts(json_object_to_json_string_ext(j, JSON_C_TO_STRING_PRETTY));
    json_object_put(j);
  } else {
    printf("%-15s %5s %10s %6s %10s %10s %10s %10s %9s %8s\n", "op", "ranks", "size", "dtype",
           "median ms", "min ms", "memcpy ms", "bound ms", "x_memcpy", "x_bound");
    char size[32];
    snprintf(size, sizeof size, "%zuMiB", o.size >> 20);
    printf("%-15s %5u %10s %6s %10.3f %10.3f %10.3f %10.3f %9.2f %8.2f\n", op, o.ranks, size,
           dtype, res.median_ms, res.min_ms, res.memcpy_ms, res.bound_ms,
           res.median_ms / res.memcpy_ms, res.median_ms / res.bound_ms);
  }
  return EXIT_OK;

bad:
  fprintf(stderr, "fsdp-bench: bad value '%s'\n", optarg);
  usage(stderr);
  return EXIT_USAGE;
}
