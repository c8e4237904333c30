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
 * fork() afterwards) and talk to the parent over pipes.
 *
 *   fsdp-bench --hosts H ... [--strategy FULL_SHARD|HYBRID_SHARD]
 *
 * With --hosts H (2 or more) the bench starts H daemons on this machine joined as a cluster
 * (free TCP ports on 127.0.0.1, a run dir each, UCX_TLS from the environment) and L trainers
 * per daemon, waits until every daemon's Operator.Status says its peers are ready, and times
 * the operation over all H*L ranks, so that the ring between the daemons and the work around
 * it (pre-reduction, post-reduction, RPCs, the local cast) are all in an iteration. The peer
 * is then the ring alone: fsdp-ucx-bench (next to this binary) run first with H members over
 * the same bytes and the same UCX_TLS; x_ring = the daemon's median over the ring's. Every
 * rank checks its result (sampled) outside the clock, so a wrong answer cannot pass for a
 * fast one. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
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

#include "bench/bench_daemon.h"
#include "common/clock.h"
#include "common/io.h"

enum { EXIT_OK = 0, EXIT_FAILED = 1, EXIT_USAGE = 2 };

#define MAX_RANKS 16
#define MAX_HOSTS 8
#define ERROR_MAX 512
#define MEMCPY_RUNS 11
#define SOCKET_PATH_MAX 128
/* Bounds on what the bench waits for from its children. A rank's setup pre-faults the unit's
 * buffers (seconds for large units on a loaded machine); an iteration is bounded by the
 * daemons' store.collective_timeout (60 s here) plus slack; the ring peer runs 12
 * collectives on an oversubscribed machine. */
#define SETUP_TIMEOUT_S 300.0
#define ITERATION_TIMEOUT_S 90.0
#define PEERS_READY_S 60.0
#define RING_PEER_TIMEOUT_S 300.0
#define RANK_EXIT_S 10.0

typedef enum op_kind { OP_UNSHARD, OP_REDUCE_SCATTER } op_kind_t;

typedef struct options {
  op_kind_t op;
  unsigned ranks; /* local ranks per daemon (L) */
  unsigned hosts; /* daemons (H) */
  fsdp_strategy_t strategy;
  size_t size; /* bytes of fp32 parameters */
  fsdp_scalar_t dtype;
  unsigned runs, warmup;
  bool json;
  bool ring_peer; /* hosts > 1: measure the ring alone with fsdp-ucx-bench */
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

/* Master element j's value across hosts: small integers, exact in bf16. */
static float master_value(uint64_t j) {
  return (float)((j * 7 + 3) % 256);
}

static float bf16_value(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static int64_t fail(fsdp_client_t *client, unsigned rank, const char *what, int r) {
  fprintf(stderr, "fsdp-bench: rank %u: %s: %s: %s\n", rank, what, fsdp_strerror(r),
          client ? fsdp_client_last_error(client) : "");
  return r < 0 ? r : -1;
}

/* Attaches, registers the unit and fills this rank's master shard and full gradient. */
/* Before a timed ReduceScatter of step: the backward's Unshard lends this rank its gradient
 * buffer (the copy it also lends goes back at once), which is then written: across hosts with
 * gradients of 1 everywhere, whose mean over all ranks is 1; else with finite values. */
static int64_t lend_gradient(const options_t *o, fsdp_client_t *client, fsdp_trainer_t *t,
                             fsdp_unit_handle_t *unit, unsigned rank, uint64_t step) {
  int r;
  if ((r = fsdp_trainer_unshard(t, unit, step, FSDP_PASS_BACKWARD)) < 0)
    return fail(client, rank, "unshard for the backward", r);
  if ((r = fsdp_trainer_reshard(t, unit, step)) < 0)
    return fail(client, rank, "reshard", r);
  const fsdp_unit_view_t *v = fsdp_unit_view(unit);
  if (o->hosts == 1) {
    memset(v->full_grad, 0x3c, v->padded_numel * scalar_size(o->dtype));
  } else if (o->dtype == FSDP_SCALAR_FP32) {
    float *g = v->full_grad;
    for (uint64_t i = 0; i < v->padded_numel; i++)
      g[i] = 1.0f;
  } else {
    uint16_t *g = v->full_grad;
    for (uint64_t i = 0; i < v->padded_numel; i++)
      g[i] = 0x3f80; /* 1.0 in bf16 */
  }
  return 0;
}

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
                           .strategy = o->strategy, .param_type = o->dtype,
                           .reduce_type = o->dtype};
  if ((r = fsdp_trainer_register_unit(*ret_trainer, &desc, ret_unit)) < 0)
    return fail(*ret_client, rank, "register_unit", r);
  const fsdp_unit_view_t *v = fsdp_unit_view(*ret_unit);
  float *shard = v->master + (uint64_t)(v->shard - v->host_first_shard) * v->shard_numel;
  /* Across hosts every rank checks what comes back: masters whose values are exact in bf16. */
  for (uint64_t i = 0; i < v->shard_numel; i++)
    shard[i] = o->hosts == 1 ? (float)((i + v->shard) % 1000) * 0.001f
                             : master_value(v->shard * v->shard_numel + i);
  return o->op == OP_REDUCE_SCATTER ? lend_gradient(o, *ret_client, *ret_trainer, *ret_unit,
                                                    rank, 1)
                                    : 0;
}

/* Samples of every shard of the unsharded copy (17 each, the first and last included) against
 * the masters every rank of every host wrote. */
static int64_t check_unshard(const options_t *o, const fsdp_unit_view_t *v, unsigned rank) {
  uint64_t shards = v->padded_numel / v->shard_numel;
  for (uint64_t s = 0; s < shards; s++)
    for (uint64_t k = 0; k <= 16; k++) {
      uint64_t j = s * v->shard_numel + (k == 16 ? v->shard_numel - 1 : k * v->shard_numel / 16);
      float got = o->dtype == FSDP_SCALAR_FP32 ? ((const float *)v->unsharded)[j]
                                               : bf16_value(((const uint16_t *)v->unsharded)[j]);
      if (got != master_value(j)) {
        fprintf(stderr, "fsdp-bench: rank %u: unsharded element %" PRIu64 " (shard %" PRIu64
                ") is %g, expected %g as its rank wrote\n", rank, j, s, (double)got,
                (double)master_value(j));
        return -EBADMSG;
      }
    }
  return 0;
}

/* Samples of this rank's gradient shard: the mean of gradients of 1 over every rank. */
static int64_t check_reduce_scatter(const fsdp_unit_view_t *v, unsigned rank) {
  const float *g = v->grad + (uint64_t)(v->shard - v->host_first_shard) * v->shard_numel;
  for (uint64_t k = 0; k <= 16; k++) {
    uint64_t i = k == 16 ? v->shard_numel - 1 : k * v->shard_numel / 16;
    if (!(fabsf(g[i] - 1.0f) <= 1e-2f)) {
      fprintf(stderr, "fsdp-bench: rank %u: gradient shard %u element %" PRIu64 " is %g, "
              "expected 1 (the mean of 1 over every rank)\n", rank, v->shard, i, (double)g[i]);
      return -EBADMSG;
    }
  }
  return 0;
}

static int64_t rank_iterate(const options_t *o, fsdp_client_t *client, fsdp_trainer_t *t,
                            fsdp_unit_handle_t *unit, unsigned rank, uint64_t step) {
  int r;
  int64_t bad;
  if (o->op == OP_UNSHARD) {
    if ((r = fsdp_trainer_unshard(t, unit, step, FSDP_PASS_FORWARD)) < 0)
      return fail(client, rank, "unshard", r);
    int64_t end = (int64_t)fsdp_clock_now_ns();
    if (o->hosts > 1 && (bad = check_unshard(o, fsdp_unit_view(unit), rank)) < 0)
      return bad;
    /* Let go, so that the next iteration gathers again. */
    if ((r = fsdp_trainer_reshard(t, unit, step)) < 0)
      return fail(client, rank, "reshard", r);
    return end;
  }
  if ((r = fsdp_trainer_reduce_scatter(t, unit, step, false)) < 0)
    return fail(client, rank, "reduce_scatter", r);
  int64_t end = (int64_t)fsdp_clock_now_ns();
  if (o->hosts > 1 && (bad = check_reduce_scatter(fsdp_unit_view(unit), rank)) < 0)
    return bad;
  /* The next iteration's gradient buffer, outside the timed call. */
  if ((bad = lend_gradient(o, client, t, unit, rank, step + 1)) < 0)
    return bad;
  return end;
}

static void rank_main(const options_t *o, unsigned rank, int cmd_fd, int result_fd) {
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the bench */
  char cmd, socket_path[SOCKET_PATH_MAX];
  fsdp_client_t *client = NULL;
  fsdp_trainer_t *trainer = NULL;
  fsdp_unit_handle_t *unit = NULL;
  if (read_all(cmd_fd, &cmd, 1) < 0 || cmd != CMD_START ||
      read_all(cmd_fd, socket_path, sizeof socket_path) < 0)
    _exit(EXIT_FAILED);
  int64_t result = rank_setup(o, rank, socket_path, &client, &trainer, &unit);
  if (fsdp_write_all(result_fd, &result, sizeof result) < 0 || result < 0)
    goto out;
  for (uint64_t step = 1; read_all(cmd_fd, &cmd, 1) == 0 && cmd == CMD_ITERATE; step++) {
    result = rank_iterate(o, client, trainer, unit, rank, step);
    if (fsdp_write_all(result_fd, &result, sizeof result) < 0 || result < 0)
      break;
  }
out:
  fsdp_trainer_detach(trainer);
  fsdp_client_close(client);
  _exit(result < 0 ? EXIT_FAILED : EXIT_OK);
}

/* Forks the H*L trainers; global rank g is local rank g % L of host g / L. */
static int fork_ranks(const options_t *o, rank_proc_t *ranks, char *err, size_t err_size) {
  for (unsigned r = 0; r < o->hosts * o->ranks; r++) {
    int down[2], up[2];
    if (pipe2(down, O_CLOEXEC) < 0 || pipe2(up, O_CLOEXEC) < 0)
      return bench_set_error(err, err_size, "pipe: %s", strerror(errno));
    pid_t pid = fork();
    if (pid < 0)
      return bench_set_error(err, err_size, "fork: %s", strerror(errno));
    if (pid == 0) {
      close(down[1]);
      close(up[0]);
      rank_main(o, r % o->ranks, down[0], up[1]);
    }
    close(down[0]);
    close(up[1]);
    ranks[r] = (rank_proc_t){.pid = pid, .cmd_fd = down[1], .result_fd = up[0]};
  }
  return 0;
}

/* Reads len bytes unless the deadline (fsdp_clock_now_s() time) passes first: 0, -1 (the writer is
 * gone) or -2 (timed out). */
static int read_by(int fd, void *buf, size_t len, double deadline) {
  char *p = buf;
  while (len > 0) {
    double left = deadline - fsdp_clock_now_s();
    if (left <= 0)
      return -2;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int n = poll(&pfd, 1, (int)(left * 1e3) + 1);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return -1;
    if (n == 0)
      continue;
    ssize_t got = read(fd, p, len);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0)
      return -1;
    p += got;
    len -= (size_t)got;
  }
  return 0;
}

static void name_rank(const options_t *o, unsigned g, char *buf, size_t size) {
  if (o->hosts == 1)
    snprintf(buf, size, "rank %u", g);
  else
    snprintf(buf, size, "host %u rank %u", g / o->ranks, g % o->ranks);
}

/* Sends cmd to every rank (with paths[g / L] after it when paths is set) and collects their
 * answers within timeout_s; *ret_latest is the largest. */
static int round_trip(const options_t *o, rank_proc_t *ranks, char cmd,
                      const char (*paths)[SOCKET_PATH_MAX], double timeout_s,
                      int64_t *ret_latest, char *err, size_t err_size) {
  unsigned n = o->hosts * o->ranks;
  char who[48];
  for (unsigned r = 0; r < n; r++)
    if (fsdp_write_all(ranks[r].cmd_fd, &cmd, 1) < 0 ||
        (paths && fsdp_write_all(ranks[r].cmd_fd, paths[r / o->ranks], SOCKET_PATH_MAX) < 0)) {
      name_rank(o, r, who, sizeof who);
      return bench_set_error(err, err_size, "%s is gone", who);
    }
  int64_t latest = 0;
  double deadline = fsdp_clock_now_s() + timeout_s;
  for (unsigned r = 0; r < n; r++) {
    int64_t v;
    int got = read_by(ranks[r].result_fd, &v, sizeof v, deadline);
    name_rank(o, r, who, sizeof who);
    if (got == -2)
      return bench_set_error(err, err_size, "%s did not answer within %.0f s", who, timeout_s);
    if (got < 0)
      return bench_set_error(err, err_size, "%s died (see its message above)", who);
    if (v < 0)
      return bench_set_error(err, err_size, "%s failed: %s", who, fsdp_strerror((int)v));
    if (v > latest)
      latest = v;
  }
  *ret_latest = latest;
  return 0;
}

/* Tells every rank to quit, then waits RANK_EXIT_S for them all; a rank still there (stuck
 * in a call) is SIGKILLed. */
static void stop_ranks(const options_t *o, rank_proc_t *ranks) {
  unsigned n = o->hosts * o->ranks;
  for (unsigned r = 0; r < n; r++) {
    if (ranks[r].pid <= 0)
      continue;
    char quit = CMD_QUIT;
    if (fsdp_write_all(ranks[r].cmd_fd, &quit, 1) < 0)
      kill(ranks[r].pid, SIGKILL);
    close(ranks[r].cmd_fd);
    close(ranks[r].result_fd);
  }
  double deadline = fsdp_clock_now_s() + RANK_EXIT_S;
  for (unsigned r = 0; r < n; r++) {
    if (ranks[r].pid <= 0)
      continue;
    while (waitpid(ranks[r].pid, NULL, WNOHANG) == 0) {
      if (fsdp_clock_now_s() > deadline) {
        kill(ranks[r].pid, SIGKILL);
        waitpid(ranks[r].pid, NULL, 0);
        break;
      }
      bench_sleep_ms(5);
    }
    ranks[r].pid = 0;
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
    uint64_t t0 = fsdp_clock_now_ns();
    pthread_t other;
    pthread_create(&other, NULL, copy_half, &jobs[1]);
    copy_half(&jobs[0]);
    pthread_join(other, NULL);
    times[run] = (double)(fsdp_clock_now_ns() - t0) / 1e6;
  }
  *ret_ms = median(times + 1, MEMCPY_RUNS);
  munmap(src, size);
  munmap(dst, size);
  return 0;
}

/* The ring alone: fsdp-ucx-bench. */

#define PEER_OUTPUT_MAX 65536

/* Runs fsdp-ucx-bench for `ops` (all-gather, reduce-scatter or both) at `mib` MiB with
 * o->hosts members and the environment's UCX_TLS (which must be set), bounded
 * by RING_PEER_TIMEOUT_S, and reads the medians off its table (ms; 0 where not run). On
 * failure `why` says why, with the tail of its output. */
static int run_ring_peer(const options_t *o, const char *ops, size_t mib, double *ret_ag_ms,
                         double *ret_rs_ms, char *why, size_t why_size) {
  char prog[PATH_MAX];
  if (bench_find_program("fsdp-ucx-bench", prog, sizeof prog, why, why_size) < 0)
    return -1;
  const char *tls = getenv("UCX_TLS");
  if (!tls || !tls[0])
    return bench_set_error(why, why_size, "UCX_TLS is unset");
  char members[16], sizes[32], iters[16], warmup[16];
  snprintf(members, sizeof members, "%u", o->hosts);
  snprintf(sizes, sizeof sizes, "%zu", mib);
  snprintf(iters, sizeof iters, "%u", o->runs);
  snprintf(warmup, sizeof warmup, "%u", o->warmup);
  char *argv[] = {prog, "--members", members, "--sizes", sizes, "--op", (char *)ops,
                  "--tls", (char *)tls, "--iters", iters,
                  "--warmup", warmup, "--no-p2p", "--no-mpi", NULL};
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) < 0)
    return bench_set_error(why, why_size, "pipe: %s", strerror(errno));
  fflush(NULL);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return bench_set_error(why, why_size, "fork: %s", strerror(errno));
  }
  if (pid == 0) {
    /* Its own group, as fsdp-ucx-bench gives its members theirs; SIGTERM makes it kill them. */
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent)
      _exit(127);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    execv(prog, argv);
    _exit(127);
  }
  close(fds[1]);
  char *text = malloc(PEER_OUTPUT_MAX);
  size_t len = 0;
  bool timed_out = false;
  double deadline = fsdp_clock_now_s() + RING_PEER_TIMEOUT_S;
  for (;;) {
    char chunk[4096];
    int got = -1;
    double left = deadline - fsdp_clock_now_s();
    if (left <= 0 || bench_interrupted) {
      timed_out = true;
      break;
    }
    struct pollfd pfd = {.fd = fds[0], .events = POLLIN};
    int n = poll(&pfd, 1, left > 0.2 ? 200 : (int)(left * 1e3) + 1);
    if (n < 0 && errno != EINTR)
      break;
    if (n <= 0)
      continue;
    ssize_t r = read(fds[0], chunk, sizeof chunk);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0)
      break; /* EOF: it exited (or closed its output) */
    got = (int)r;
    if (text) {
      /* Keep the end: the table and any final error are there. */
      if (len + (size_t)got >= PEER_OUTPUT_MAX) {
        size_t drop = len + (size_t)got - PEER_OUTPUT_MAX + 1;
        drop = drop > len ? len : drop;
        memmove(text, text + drop, len - drop);
        len -= drop;
      }
      size_t take = (size_t)got < PEER_OUTPUT_MAX - 1 - len ? (size_t)got : PEER_OUTPUT_MAX - 1 - len;
      memcpy(text + len, chunk, take);
      len += take;
    }
  }
  close(fds[0]);
  int status = 0;
  if (timed_out) {
    kill(pid, SIGTERM);
    double grace = fsdp_clock_now_s() + 2.0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (fsdp_clock_now_s() > grace) {
        kill(-pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
      bench_sleep_ms(10);
    }
  } else {
    double bound = fsdp_clock_now_s() + 5.0; /* output closed: it is exiting */
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (fsdp_clock_now_s() > bound) {
        kill(-pid, SIGKILL);
        waitpid(pid, &status, 0);
        break;
      }
      bench_sleep_ms(5);
    }
  }
  if (!text)
    return bench_set_error(why, why_size, "out of memory for fsdp-ucx-bench's output");
  text[len] = '\0';
  *ret_ag_ms = *ret_rs_ms = 0;
  for (char *line = text; line && *line;) {
    char name[32], med[32];
    size_t at;
    if (sscanf(line, "%31s %zu %31s", name, &at, med) == 3 && at == mib) {
      double ms = strtod(med, NULL);
      if (strcmp(name, "all-gather") == 0)
        *ret_ag_ms = ms;
      else if (strcmp(name, "reduce-scatter") == 0)
        *ret_rs_ms = ms;
    }
    line = strchr(line, '\n');
    if (line)
      line++;
  }
  bool want_ag = strcmp(ops, "reduce-scatter") != 0, want_rs = strcmp(ops, "all-gather") != 0;
  int rc = 0;
  if (timed_out || !WIFEXITED(status) || WEXITSTATUS(status) != 0 ||
      (want_ag && *ret_ag_ms <= 0) || (want_rs && *ret_rs_ms <= 0)) {
    const char *tail = len > 300 ? text + len - 300 : text;
    rc = bench_set_error(why, why_size, "fsdp-ucx-bench %s: ...%s",
                         timed_out ? "ran past its time" : "gave no figures", tail);
  }
  free(text);
  return rc;
}

/* Running it. */

typedef struct result {
  double median_ms, min_ms;
  double memcpy_ms;
  double bound_ms; /* the operation's bytes at the memcpy's bandwidth */
  /* hosts > 1 */
  double ring_bytes;   /* what each host sends over the rings in one operation */
  double ring_ms;      /* the same bytes through the ring alone (0: not measured) */
  char ring_what[64];  /* which rings, e.g. "all-gather" */
  char ring_why[ERROR_MAX]; /* why ring_ms is missing */
} result_t;

/* The rings an operation runs across hosts (topology.h's plan; shard groups of one host for
 * HYBRID_SHARD, as configured by default) and the bytes each host sends over them. */
static void plan_rings(const options_t *o, result_t *res, const char **ret_ops) {
  size_t bytes = o->size / 4 * scalar_size(o->dtype);
  double part = (double)(o->hosts - 1) / o->hosts;
  *ret_ops = NULL;
  res->ring_bytes = 0;
  if (o->strategy == FSDP_HYBRID_SHARD) {
    if (o->op == OP_REDUCE_SCATTER) { /* the whole unit all-reduced among the replicas */
      res->ring_bytes = 2 * part * (double)bytes;
      *ret_ops = "both";
      snprintf(res->ring_what, sizeof res->ring_what, "all-reduce");
    } else {
      snprintf(res->ring_what, sizeof res->ring_what, "none (gather within the host)");
    }
    return;
  }
  res->ring_bytes = part * (double)bytes;
  *ret_ops = o->op == OP_UNSHARD ? "all-gather" : "reduce-scatter";
  snprintf(res->ring_what, sizeof res->ring_what, "%s", *ret_ops);
}

static int run(const options_t *o, result_t *res, char *err, size_t err_size) {
  rank_proc_t ranks[MAX_HOSTS * MAX_RANKS] = {0};
  bench_daemon_t d[MAX_HOSTS];
  fsdp_client_t *probe[MAX_HOSTS] = {0};
  char paths[MAX_HOSTS][SOCKET_PATH_MAX];
  unsigned short ports[MAX_HOSTS];
  int rc = -1;
  for (unsigned h = 0; h < MAX_HOSTS; h++)
    d[h] = (bench_daemon_t){.pid = -1};
  size_t numel = o->size / 4, dsize = scalar_size(o->dtype);
  if (o->hosts == 1) {
    /* The peer first, on a quiet machine (after the run, the kernel is still reclaiming the
     * daemon's memory), and unmapped before the trainers are forked. */
    if (time_memcpy(o->size, &res->memcpy_ms) < 0)
      return bench_set_error(err, err_size, "cannot map two buffers of %zu bytes", o->size);
  } else {
    /* The ring alone first, for the same reason, and before any gRPC client exists. */
    const char *ops;
    plan_rings(o, res, &ops);
    size_t bytes = numel * dsize;
    if (!ops)
      snprintf(res->ring_why, sizeof res->ring_why, "no ring between hosts");
    else if (!o->ring_peer)
      snprintf(res->ring_why, sizeof res->ring_why, "skipped (--no-ring)");
    else if (o->hosts > 3)
      snprintf(res->ring_why, sizeof res->ring_why, "fsdp-ucx-bench runs 2 or 3 members");
    else if (!getenv("UCX_TLS") || !getenv("UCX_TLS")[0])
      /* fsdp-ucx-bench picks UCX's error mode from UCX_TLS (none unless it names tcp) while
       * the daemon asks for peer error handling wherever UCX offers it: with UCX_TLS unset
       * the two would run different transports, and the ratio would mean nothing. */
      snprintf(res->ring_why, sizeof res->ring_why,
               "UCX_TLS is unset: set it (tcp, or posix,sysv,cma,self) so that the daemons and "
               "fsdp-ucx-bench run the same transports");
    else if (bytes % (1u << 20))
      snprintf(res->ring_why, sizeof res->ring_why, "the unit is not whole MiB in %s",
               o->dtype == FSDP_SCALAR_FP32 ? "fp32" : "bf16");
    else {
      double ag = 0, rs = 0;
      if (run_ring_peer(o, ops, bytes >> 20, &ag, &rs, res->ring_why, sizeof res->ring_why) == 0)
        res->ring_ms = ag + rs; /* the all-reduce is a reduce-scatter then an all-gather */
    }
  }
  if (fork_ranks(o, ranks, err, err_size) < 0)
    goto out;

  /* The job's memory: the unit's buffers (unsharded, fp32 master and gradient shards, one
   * full gradient per rank; across hosts the host sum, fp32 and one in the narrower reduce
   * type) and room for rounding. */
  size_t need = numel * (dsize * (1 + o->ranks) + 8) + (64u << 20);
  if (o->hosts > 1)
    need += numel * (4 + (dsize < 4 ? dsize : 0));
  char job_limit[64];
  snprintf(job_limit, sizeof job_limit, "memory.job_limit=%zuMiB", (need >> 20) + 1);
  char host_list[MAX_HOSTS * 24] = "", host_rank[16], lws[16];
  if (o->hosts > 1) {
    if (bench_free_tcp_ports(o->hosts, ports, err, err_size) < 0)
      goto out;
    size_t len = 0;
    for (unsigned h = 0; h < o->hosts; h++)
      len += (size_t)snprintf(host_list + len, sizeof host_list - len, "%s127.0.0.1:%u",
                              h ? "," : "", ports[h]);
    snprintf(lws, sizeof lws, "%u", o->ranks);
  }
  for (unsigned h = 0; h < o->hosts; h++) {
    const char *one[] = {"--set", job_limit, "--set", "store.collective_timeout=60s", NULL};
    snprintf(host_rank, sizeof host_rank, "%u", h);
    const char *cluster[] = {"--set", job_limit, "--set", "store.collective_timeout=60s",
                             "--hosts", host_list, "--host-rank", host_rank,
                             "--local-world-size", lws,
                             /* daemons on one machine, over loopback */
                             "--set", "peer.insecure=true", NULL};
    if (bench_daemon_spawn(&d[h], "fsdp-bench", o->hosts == 1 ? one : cluster, err,
                           err_size) < 0)
      goto out;
  }
  for (unsigned h = 0; h < o->hosts; h++) {
    char target[200];
    snprintf(target, sizeof target, "unix:%s", d[h].socket_path);
    if (fsdp_client_connect(target, NULL, &probe[h]) < 0 ||
        bench_daemon_wait_serving(&d[h], probe[h], d[h].ready_deadline, err, err_size) < 0)
      goto out;
    snprintf(paths[h], sizeof paths[h], "%s", d[h].socket_path);
  }
  if (o->hosts > 1) {
    double deadline = fsdp_clock_now_s() + PEERS_READY_S;
    for (unsigned h = 0; h < o->hosts; h++)
      if (bench_daemon_wait_peers(&d[h], probe[h], deadline, err, err_size) < 0)
        goto out;
  }

  int64_t ignored;
  if (round_trip(o, ranks, CMD_START, paths, SETUP_TIMEOUT_S, &ignored, err, err_size) < 0)
    goto out;
  double *times = calloc(o->runs, sizeof *times);
  if (!times)
    goto out;
  for (unsigned i = 0; i < o->warmup + o->runs && !bench_interrupted; i++) {
    int64_t go = (int64_t)fsdp_clock_now_ns(), end;
    if (round_trip(o, ranks, CMD_ITERATE, NULL, ITERATION_TIMEOUT_S, &end, err, err_size) < 0) {
      free(times);
      goto out;
    }
    if (i >= o->warmup)
      times[i - o->warmup] = (double)(end - go) / 1e6;
  }
  if (bench_interrupted) {
    free(times);
    bench_set_error(err, err_size, "interrupted");
    goto out;
  }
  res->median_ms = median(times, o->runs);
  res->min_ms = times[0]; /* sorted by median() */
  free(times);
  rc = 0;

out:
  stop_ranks(o, ranks);
  for (unsigned h = 0; h < o->hosts; h++)
    fsdp_client_close(probe[h]);
  /* SIGTERM every daemon before waiting for any, so that none waits for a peer being
   * stopped after it; bench_daemon_stop then reaps each (SIGKILL past BENCH_STOP_WAIT_MS). */
  for (unsigned h = 0; h < o->hosts; h++)
    bench_daemon_terminate(&d[h]);
  for (unsigned h = 0; h < o->hosts; h++) {
    if (d[h].pid <= 0 && !d[h].run_dir[0])
      continue;
    char stop_err[ERROR_MAX];
    if (bench_daemon_stop(&d[h], stop_err, sizeof stop_err) < 0 && rc == 0) {
      snprintf(err, err_size, "%s", stop_err);
      rc = -1;
    }
  }
  if (rc < 0)
    return rc;
  if (o->hosts == 1) {
    double bandwidth = 2.0 * (double)o->size / res->memcpy_ms; /* bytes read + written per ms */
    double traffic = o->op == OP_UNSHARD
                         ? (double)numel * (4 + dsize)             /* masters in, copy out */
                         : (double)numel * (dsize * o->ranks + 4); /* L gradients in, shards out */
    res->bound_ms = traffic / bandwidth;
  }
  return 0;
}

/* Across hosts: busbw = the bytes each host sends over the rings / the median time (GB =
 * 1e9 bytes), the NCCL convention that compares with one link; x_ring = the daemon's median
 * over the ring's alone for the same bytes. */
static void print_hosts(const options_t *o, const result_t *res, const char *op,
                        const char *dtype) {
  const char *strategy = o->strategy == FSDP_FULL_SHARD ? "FULL_SHARD" : "HYBRID_SHARD";
  const char *tls = getenv("UCX_TLS");
  tls = tls && tls[0] ? tls : "(unset)";
  double busbw = res->ring_bytes / (res->median_ms / 1e3) / 1e9;
  double ring_busbw = res->ring_ms > 0 ? res->ring_bytes / (res->ring_ms / 1e3) / 1e9 : 0;
  if (o->json) {
    json_object *j = json_object_new_object();
    json_object_object_add(j, "op", json_object_new_string(op));
    json_object_object_add(j, "hosts", json_object_new_int64(o->hosts));
    json_object_object_add(j, "ranks", json_object_new_int64(o->ranks));
    json_object_object_add(j, "strategy", json_object_new_string(strategy));
    json_object_object_add(j, "size_bytes", json_object_new_uint64(o->size));
    json_object_object_add(j, "dtype", json_object_new_string(dtype));
    json_object_object_add(j, "ucx_tls", json_object_new_string(tls));
    json_object_object_add(j, "runs", json_object_new_int64(o->runs));
    json_object_object_add(j, "median_ms", json_object_new_double(res->median_ms));
    json_object_object_add(j, "min_ms", json_object_new_double(res->min_ms));
    json_object_object_add(j, "rings", json_object_new_string(res->ring_what));
    json_object_object_add(j, "ring_bytes_per_host", json_object_new_double(res->ring_bytes));
    json_object_object_add(j, "busbw_gbs", json_object_new_double(busbw));
    if (res->ring_ms > 0) {
      json_object_object_add(j, "ring_ms", json_object_new_double(res->ring_ms));
      json_object_object_add(j, "ring_busbw_gbs", json_object_new_double(ring_busbw));
      json_object_object_add(j, "x_ring", json_object_new_double(res->median_ms / res->ring_ms));
    } else {
      json_object_object_add(j, "ring_skipped", json_object_new_string(res->ring_why));
    }
    puts(json_object_to_json_string_ext(j, JSON_C_TO_STRING_PRETTY));
    json_object_put(j);
    return;
  }
  printf("%-15s %-12s %5s %5s %8s %5s %-20s %10s %10s %9s %7s %9s %8s %7s\n", "op", "strategy",
         "hosts", "ranks", "size", "dtype", "UCX_TLS", "median ms", "min ms", "MiB/host",
         "busbw", "ring ms", "ring bw", "x_ring");
  char size[32], ring_ms[16] = "-", ring_bw[16] = "-", x[16] = "-";
  snprintf(size, sizeof size, "%zuMiB", o->size >> 20);
  if (res->ring_ms > 0) {
    snprintf(ring_ms, sizeof ring_ms, "%.3f", res->ring_ms);
    snprintf(ring_bw, sizeof ring_bw, "%.2f", ring_busbw);
    snprintf(x, sizeof x, "%.2f", res->median_ms / res->ring_ms);
  }
  printf("%-15s %-12s %5u %5u %8s %5s %-20s %10.3f %10.3f %9.1f %7.2f %9s %8s %7s\n", op,
         strategy, o->hosts, o->ranks, size, dtype, tls, res->median_ms, res->min_ms,
         res->ring_bytes / (1 << 20), busbw, ring_ms, ring_bw, x);
  printf("rings: %s; busbw = bytes each host sends over them / median, GB/s = 1e9 B/s\n",
         res->ring_what);
  if (res->ring_ms <= 0)
    printf("ring alone: %s\n", res->ring_why);
}

static void usage(FILE *f) {
  fputs("usage: fsdp-bench --op unshard|reduce_scatter [--ranks L] [--size SIZE]\n"
        "                  [--dtype fp32|bf16] [--runs N] [--warmup N] [--json]\n"
        "                  [--hosts H [--strategy FULL_SHARD|HYBRID_SHARD] [--no-ring]]\n"
        "  --ranks L     trainer processes (per daemon), 1 to 16 (default 2)\n"
        "  --hosts H     daemons on this machine joined as a cluster, 1 to 8 (default 1);\n"
        "                UCX_TLS from the environment reaches them and the ring peer\n"
        "  --strategy S  the unit's strategy across hosts (default FULL_SHARD)\n"
        "  --no-ring     across hosts, skip the ring alone (fsdp-ucx-bench) as the peer\n"
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
  options_t o = {.op = OP_UNSHARD, .ranks = 2, .hosts = 1, .strategy = FSDP_FULL_SHARD,
                 .size = 64u << 20, .dtype = FSDP_SCALAR_FP32, .runs = 10, .warmup = 2,
                 .ring_peer = true};
  bool have_strategy = false;
  bool have_op = false;
  static const struct option longopts[] = {
      {"op", required_argument, NULL, 'o'},     {"ranks", required_argument, NULL, 'r'},
      {"size", required_argument, NULL, 's'},   {"dtype", required_argument, NULL, 'd'},
      {"runs", required_argument, NULL, 'n'},   {"warmup", required_argument, NULL, 'w'},
      {"json", no_argument, NULL, 'j'},         {"help", no_argument, NULL, 'h'},
      {"hosts", required_argument, NULL, 'H'},  {"strategy", required_argument, NULL, 'S'},
      {"no-ring", no_argument, NULL, 'R'},      {NULL, 0, NULL, 0}};
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
    case 'H':
      o.hosts = (unsigned)strtoul(optarg, &end, 10);
      if (*end || o.hosts < 1 || o.hosts > MAX_HOSTS)
        goto bad;
      break;
    case 'S':
      have_strategy = true;
      if (strcmp(optarg, "FULL_SHARD") == 0)
        o.strategy = FSDP_FULL_SHARD;
      else if (strcmp(optarg, "HYBRID_SHARD") == 0)
        o.strategy = FSDP_HYBRID_SHARD;
      else
        goto bad;
      break;
    case 'R':
      o.ring_peer = false;
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
  if (o.hosts == 1 && have_strategy && o.strategy != FSDP_FULL_SHARD) {
    fprintf(stderr, "fsdp-bench: --strategy HYBRID_SHARD needs --hosts 2 or more (on one host "
                    "it is FULL_SHARD)\n");
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
  if (o.hosts > 1) {
    print_hosts(&o, &res, op, dtype);
    return EXIT_OK;
  }
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
