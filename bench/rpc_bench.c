/* fsdp-rpc-bench: round-trip latency and throughput of the control plane over the unix
 * socket, measured the way a trainer or fsdpctl sees it: through the C client library, one
 * blocking call at a time per client. It either drives a daemon that is already running
 * (--socket) or starts its own fsdpd in a throw-away run dir (--spawn) and always stops it
 * again. Every reply is checked (Check must say SERVING, Status must carry our version), so
 * a daemon that answers with errors aborts the run instead of producing fast numbers.
 * Results and how to reproduce them are kept in docs/PERFORMANCE.md. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <json-c/json.h>

#include <fsdp/fsdp_client.h>
#include <fsdp/fsdp_error.h>
#include <fsdp/fsdp_version.h>

#include "bench/bench_daemon.h"
#include "client/client_rpc.h"
#include "common/clock.h"
#include "fsdp/v1/operator.pb-c.h"
#include "proto/wire.h"

enum { EXIT_OK = 0, EXIT_FAILED = 1, EXIT_USAGE = 2 };



#define MAX_CALLS 10000000UL
#define MAX_CLIENTS 256UL
#define ERROR_MAX 512



/* The operations measured. Each makes one call and checks its reply; on failure it writes a
 * message that names the call, the code and the daemon's words, and returns < 0. */
typedef struct op {
  const char *name;
  int (*call)(fsdp_client_t *client, const char *status_path, size_t *ret_reply_bytes,
              char *err, size_t err_size);
} op_t;

static int call_health_check(fsdp_client_t *client, const char *status_path,
                             size_t *ret_reply_bytes, char *err, size_t err_size) {
  (void)status_path;
  fsdp_health_status_t hs;
  int r = fsdp_client_health_check(client, "", 0, &hs);
  if (r < 0)
    return bench_set_error(err, err_size, "health.Check(\"\"): %s: %s", fsdp_strerror(r),
                           fsdp_client_last_error(client));
  if (hs != FSDP_HEALTH_SERVING)
    return bench_set_error(err, err_size, "health.Check(\"\") returned %s, expected SERVING",
                           fsdp_health_status_name(hs));
  /* HealthCheckResponse{status: SERVING}: one tag byte and one varint byte. */
  *ret_reply_bytes = 2;
  return 0;
}

static int call_operator_status(fsdp_client_t *client, const char *status_path,
                                size_t *ret_reply_bytes, char *err, size_t err_size) {
  Fsdp__V1__StatusRequest request = FSDP__V1__STATUS_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  int r = fsdp_client_call(client, status_path, &request.base, &fsdp__v1__status_reply__descriptor,
                           0, &reply);
  if (r < 0)
    return bench_set_error(err, err_size, "Operator.Status: %s: %s", fsdp_strerror(r),
                           fsdp_client_last_error(client));
  const Fsdp__V1__StatusReply *s = (const Fsdp__V1__StatusReply *)reply;
  if (!s->version || strcmp(s->version, FSDP_VERSION_STRING) != 0 ||
      s->protocol_version != FSDP_PROTOCOL_VERSION) {
    bench_set_error(err, err_size,
                    "Operator.Status returned version '%s' protocol %" PRIu32
                    ", expected '%s' protocol %u",
                    s->version ? s->version : "", s->protocol_version, FSDP_VERSION_STRING,
                    FSDP_PROTOCOL_VERSION);
    protobuf_c_message_free_unpacked(reply, NULL);
    return -1;
  }
  *ret_reply_bytes = protobuf_c_message_get_packed_size(reply);
  protobuf_c_message_free_unpacked(reply, NULL);
  return 0;
}

static const op_t ops[] = {
    {"health.Check", call_health_check},
    {"Operator.Status", call_operator_status},
};

/* One client thread of a measurement: warm-up calls, then timed calls. */
typedef struct worker {
  pthread_t thread;
  struct run *run;
  fsdp_client_t *client;
  unsigned long calls;
  uint64_t *samples_ns; /* calls entries, one per timed call */
  uint64_t start_ns, end_ns;
  size_t reply_bytes;
  char err[ERROR_MAX];
  bool failed;
} worker_t;

typedef struct run {
  const op_t *op;
  const char *status_path;
  unsigned long warmup;
  atomic_bool stop; /* a worker failed or we were bench_interrupted */
  /* The starting gate: every client is warm before any starts the clock, so that the
   * aggregate rate is not diluted by one client's warm-up. */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  unsigned ready;
  bool go;
} run_t;

static void worker_fail(worker_t *w) {
  w->failed = true;
  atomic_store(&w->run->stop, true);
}

static bool should_stop(const run_t *run) {
  return bench_interrupted || atomic_load(&run->stop);
}

static void *worker_main(void *arg) {
  worker_t *w = arg;
  run_t *run = w->run;
  for (unsigned long i = 0; i < run->warmup && !should_stop(run); i++) {
    if (run->op->call(w->client, run->status_path, &w->reply_bytes, w->err, sizeof w->err) < 0) {
      worker_fail(w);
      break;
    }
  }
  pthread_mutex_lock(&run->lock);
  run->ready++;
  pthread_cond_broadcast(&run->cond);
  while (!run->go)
    pthread_cond_wait(&run->cond, &run->lock);
  pthread_mutex_unlock(&run->lock);
  w->start_ns = fsdp_clock_now_ns();
  for (unsigned long i = 0; i < w->calls && !should_stop(run); i++) {
    uint64_t t0 = fsdp_clock_now_ns();
    int r = run->op->call(w->client, run->status_path, &w->reply_bytes, w->err, sizeof w->err);
    w->samples_ns[i] = fsdp_clock_now_ns() - t0;
    if (r < 0) {
      worker_fail(w);
      break;
    }
  }
  w->end_ns = fsdp_clock_now_ns();
  return NULL;
}

typedef struct result {
  const char *op;
  unsigned clients;
  unsigned long calls;
  double p50_us, p99_us, max_us, mean_us, calls_per_s;
  size_t reply_bytes;
} result_t;

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

/* Nearest-rank percentile (1..100) of n > 0 sorted samples, in microseconds: the smallest
 * sample that at least p% of the samples do not exceed. */
static double percentile_us(const uint64_t *sorted, unsigned long n, unsigned p) {
  unsigned long rank = (p * n + 99) / 100; /* ceil(p * n / 100), >= 1 */
  return (double)sorted[rank - 1] / 1e3;
}

/* Runs `op` on the first `nclients` clients, calls split evenly between them. Returns 0 and
 * fills *ret, or -1 with the first failure's message in err. */
static int measure(const op_t *op, const char *status_path, fsdp_client_t **clients,
                   unsigned nclients, unsigned long calls, unsigned long warmup, result_t *ret,
                   char *err, size_t err_size) {
  int rc = -1;
  uint64_t *samples = calloc(calls, sizeof *samples);
  worker_t *workers = calloc(nclients, sizeof *workers);
  run_t run = {.op = op, .status_path = status_path, .warmup = warmup};
  atomic_init(&run.stop, false);
  unsigned started = 0;
  if (!samples || !workers) {
    bench_set_error(err, err_size, "out of memory for %lu samples", calls);
    goto free_buffers;
  }
  pthread_mutex_init(&run.lock, NULL);
  pthread_cond_init(&run.cond, NULL);
  unsigned long offset = 0;
  for (unsigned i = 0; i < nclients; i++) {
    worker_t *w = &workers[i];
    w->run = &run;
    w->client = clients[i];
    w->calls = calls / nclients + (i < calls % nclients ? 1 : 0);
    w->samples_ns = samples + offset;
    offset += w->calls;
  }
  for (; started < nclients; started++) {
    int r = pthread_create(&workers[started].thread, NULL, worker_main, &workers[started]);
    if (r != 0) {
      bench_set_error(err, err_size, "cannot start client thread %u: %s", started, strerror(r));
      atomic_store(&run.stop, true);
      break;
    }
  }
  /* Open the gate once every started client is warm (or at once after a failed start: the
   * stop flag sends the started ones straight through). */
  pthread_mutex_lock(&run.lock);
  while (run.ready < started && started == nclients)
    pthread_cond_wait(&run.cond, &run.lock);
  run.go = true;
  pthread_cond_broadcast(&run.cond);
  pthread_mutex_unlock(&run.lock);
  for (unsigned i = 0; i < started; i++)
    pthread_join(workers[i].thread, NULL);
  pthread_cond_destroy(&run.cond);
  pthread_mutex_destroy(&run.lock);
  if (started < nclients)
    goto free_buffers;
  for (unsigned i = 0; i < nclients; i++) {
    if (workers[i].failed) {
      bench_set_error(err, err_size, "%s (client %u of %u)", workers[i].err, i + 1, nclients);
      goto free_buffers;
    }
  }
  if (bench_interrupted) {
    bench_set_error(err, err_size, "bench_interrupted");
    goto free_buffers;
  }

  uint64_t first = workers[0].start_ns, last = workers[0].end_ns;
  double sum = 0;
  for (unsigned i = 0; i < nclients; i++) {
    if (workers[i].start_ns < first)
      first = workers[i].start_ns;
    if (workers[i].end_ns > last)
      last = workers[i].end_ns;
  }
  for (unsigned long i = 0; i < calls; i++)
    sum += (double)samples[i];
  qsort(samples, calls, sizeof *samples, cmp_u64);
  *ret = (result_t){
      .op = op->name,
      .clients = nclients,
      .calls = calls,
      .p50_us = percentile_us(samples, calls, 50),
      .p99_us = percentile_us(samples, calls, 99),
      .max_us = (double)samples[calls - 1] / 1e3,
      .mean_us = sum / (double)calls / 1e3,
      .calls_per_s = (double)calls / ((double)(last - first) / 1e9),
      .reply_bytes = workers[0].reply_bytes,
  };
  rc = 0;
free_buffers:
  free(workers);
  free(samples);
  return rc;
}

static double loadavg_1m(void) {
  double l = -1;
  FILE *f = fopen("/proc/loadavg", "r");
  if (f) {
    if (fscanf(f, "%lf", &l) != 1)
      l = -1;
    fclose(f);
  }
  return l;
}

typedef struct options {
  const char *socket; /* NULL: spawn */
  unsigned long calls, warmup;
  unsigned clients;
  bool json;
} options_t;

static void print_table(const options_t *o, const char *target, bool spawned,
                        const result_t *results, size_t n) {
  printf("fsdp-rpc-bench: %s (%s), %lu calls per op after %lu warm-up calls per client, "
         "%ld CPUs, load %.2f\n\n",
         target, spawned ? "spawned fsdpd" : "running daemon", o->calls, o->warmup,
         sysconf(_SC_NPROCESSORS_ONLN), loadavg_1m());
  printf("%-16s %7s %8s %8s %8s %9s %8s %10s %7s\n", "op", "clients", "calls", "p50 us",
         "p99 us", "max us", "mean us", "calls/s", "reply B");
  for (size_t i = 0; i < n; i++) {
    const result_t *r = &results[i];
    printf("%-16s %7u %8lu %8.1f %8.1f %9.1f %8.1f %10.0f %7zu\n", r->op, r->clients, r->calls,
           r->p50_us, r->p99_us, r->max_us, r->mean_us, r->calls_per_s, r->reply_bytes);
  }
}

static json_object *json_double(double v, int decimals) {
  char buf[64];
  snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return json_object_new_double_s(v, buf);
}

static void print_json(const options_t *o, const char *target, bool spawned,
                       const result_t *results, size_t n) {
  json_object *root = json_object_new_object();
  json_object_object_add(root, "target", json_object_new_string(target));
  json_object_object_add(root, "spawned", json_object_new_boolean(spawned));
  json_object_object_add(root, "version", json_object_new_string(FSDP_VERSION_STRING));
  json_object_object_add(root, "warmup", json_object_new_int64((int64_t)o->warmup));
  json_object_object_add(root, "cpus", json_object_new_int64(sysconf(_SC_NPROCESSORS_ONLN)));
  json_object_object_add(root, "loadavg_1m", json_double(loadavg_1m(), 2));
  json_object *arr = json_object_new_array();
  for (size_t i = 0; i < n; i++) {
    const result_t *r = &results[i];
    json_object *e = json_object_new_object();
    json_object_object_add(e, "op", json_object_new_string(r->op));
    json_object_object_add(e, "clients", json_object_new_int64(r->clients));
    json_object_object_add(e, "calls", json_object_new_int64((int64_t)r->calls));
    json_object_object_add(e, "p50_us", json_double(r->p50_us, 1));
    json_object_object_add(e, "p99_us", json_double(r->p99_us, 1));
    json_object_object_add(e, "max_us", json_double(r->max_us, 1));
    json_object_object_add(e, "mean_us", json_double(r->mean_us, 1));
    json_object_object_add(e, "calls_per_s", json_double(r->calls_per_s, 0));
    json_object_object_add(e, "reply_bytes", json_object_new_int64((int64_t)r->reply_bytes));
    json_object_array_add(arr, e);
  }
  json_object_object_add(root, "results", arr);
  puts(json_object_to_json_string_ext(root, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED |
                                                JSON_C_TO_STRING_NOSLASHESCAPE));
  json_object_put(root);
}

static void usage(FILE *f) {
  fputs("usage: fsdp-rpc-bench [--socket PATH | --spawn] [--calls N] [--warmup N] "
        "[--clients C] [--json]\n"
        "\n"
        "Measures health.Check(\"\") and Operator.Status round trips over the unix socket,\n"
        "one call in flight per client, and prints p50/p99/max/mean latency and calls/s.\n"
        "\n"
        "  --socket PATH   a running daemon's socket (or a unix: target)\n"
        "  --spawn         start fsdpd from the bench's directory in a temporary run dir,\n"
        "                  and stop it afterwards (the default without --socket)\n"
        "  --calls N       timed calls per op, split across the clients (default 20000)\n"
        "  --warmup N      untimed calls per op and client first (default 1000)\n"
        "  --clients C     also measure C concurrent clients, one thread each (default 1)\n"
        "  --json          print one JSON object instead of the table\n"
        "\n"
        "Exit status: 0 measured, 1 a call or the daemon failed, 2 usage.\n",
        f);
}

__attribute__((format(printf, 1, 2))) static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("fsdp-rpc-bench: ", stderr);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputs("\nTry 'fsdp-rpc-bench --help'.\n", stderr);
  return EXIT_USAGE;
}

static bool parse_count(const char *s, unsigned long min, unsigned long max,
                        unsigned long *ret) {
  char *end;
  errno = 0;
  unsigned long v = strtoul(s, &end, 10);
  if (errno || end == s || *end || *s == '-' || v < min || v > max)
    return false;
  *ret = v;
  return true;
}

int main(int argc, char **argv) {
  options_t o = {.calls = 20000, .warmup = 1000, .clients = 1};
  bool spawn = false;
  static const struct option longopts[] = {
      {"socket", required_argument, NULL, 's'}, {"spawn", no_argument, NULL, 'S'},
      {"calls", required_argument, NULL, 'n'},  {"warmup", required_argument, NULL, 'w'},
      {"clients", required_argument, NULL, 'c'}, {"json", no_argument, NULL, 'j'},
      {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0}};
  int c;
  unsigned long v;
  while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    switch (c) {
    case 's':
      if (!*optarg)
        return usage_error("%s", "--socket needs a non-empty path");
      o.socket = optarg;
      break;
    case 'S':
      spawn = true;
      break;
    case 'n':
      if (!parse_count(optarg, 1, MAX_CALLS, &o.calls))
        return usage_error("--calls '%s': expected an integer from 1 to %lu", optarg, MAX_CALLS);
      break;
    case 'w':
      if (!parse_count(optarg, 0, MAX_CALLS, &o.warmup))
        return usage_error("--warmup '%s': expected an integer from 0 to %lu", optarg,
                           MAX_CALLS);
      break;
    case 'c':
      if (!parse_count(optarg, 1, MAX_CLIENTS, &v))
        return usage_error("--clients '%s': expected an integer from 1 to %lu", optarg,
                           MAX_CLIENTS);
      o.clients = (unsigned)v;
      break;
    case 'j':
      o.json = true;
      break;
    case 'h':
      usage(stdout);
      return EXIT_OK;
    default:
      return usage_error("%s", "unknown option");
    }
  }
  if (optind < argc)
    return usage_error("unexpected argument '%s'", argv[optind]);
  if (spawn && o.socket)
    return usage_error("%s", "--socket and --spawn exclude each other");
  if (o.calls < o.clients)
    return usage_error("--calls %lu is fewer than --clients %u", o.calls, o.clients);

  bench_catch_signals();

  int rc = EXIT_FAILED;
  char err[ERROR_MAX] = "";
  char target[PATH_MAX + 16];
  bench_daemon_t d = {.pid = -1};
  fsdp_client_t **clients = NULL;
  result_t results[2 * (sizeof ops / sizeof ops[0])];
  size_t nresults = 0;

  if (!o.socket) {
    if (bench_daemon_spawn(&d, "fsdp-rpc-bench", NULL, err, sizeof err) < 0)
      goto stop_daemon;
    snprintf(target, sizeof target, "unix:%s", d.socket_path);
  } else if (strncmp(o.socket, "unix:", 5) == 0) {
    snprintf(target, sizeof target, "%s", o.socket);
  } else {
    snprintf(target, sizeof target, "unix:%s", o.socket);
  }

  char status_path[FSDP_WIRE_PATH_MAX];
  const ProtobufCServiceDescriptor *sd = &fsdp__v1__operator__descriptor;
  const ProtobufCMethodDescriptor *md = protobuf_c_service_descriptor_get_method_by_name(sd, "Status");
  if (!md || fsdp_wire_method_path(sd, (unsigned)(md - sd->methods), status_path,
                                   sizeof status_path) < 0) {
    bench_set_error(err, sizeof err, "%s", "fsdp.v1.Operator has no method Status");
    goto stop_daemon;
  }

  clients = calloc(o.clients, sizeof *clients);
  if (!clients) {
    bench_set_error(err, sizeof err, "%s", "out of memory");
    goto stop_daemon;
  }
  for (unsigned i = 0; i < o.clients; i++) {
    int r = fsdp_client_connect(target, NULL, &clients[i]);
    if (r < 0) {
      bench_set_error(err, sizeof err, "cannot make client %u for %s: %s", i, target,
                      fsdp_strerror(r));
      goto close_clients;
    }
  }
  if (!o.socket && bench_daemon_wait_serving(&d, clients[0], d.ready_deadline, err, sizeof err) < 0)
    goto close_clients;

  /* Sequential first, with the one client, then the concurrent clients for each op. */
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
    if (measure(&ops[i], status_path, clients, 1, o.calls, o.warmup, &results[nresults++], err,
                sizeof err) < 0)
      goto close_clients;
  }
  if (o.clients > 1) {
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
      if (measure(&ops[i], status_path, clients, o.clients, o.calls, o.warmup,
                  &results[nresults++], err, sizeof err) < 0)
        goto close_clients;
    }
  }
  rc = EXIT_OK;

close_clients:
  if (clients) {
    for (unsigned i = 0; i < o.clients; i++)
      fsdp_client_close(clients[i]);
    free(clients);
  }
stop_daemon:
  if (!o.socket) {
    char stop_err[ERROR_MAX];
    if (bench_daemon_stop(&d, stop_err, sizeof stop_err) < 0) {
      /* The first failure is the one to report; a stop failure after it is reported too. */
      if (rc == EXIT_OK)
        snprintf(err, sizeof err, "%s", stop_err);
      else
        fprintf(stderr, "fsdp-rpc-bench: %s\n", stop_err);
      rc = EXIT_FAILED;
    }
  }
  if (rc != EXIT_OK) {
    fprintf(stderr, "fsdp-rpc-bench: %s\n", err);
    return rc;
  }
  if (o.json)
    print_json(&o, target, !o.socket, results, nresults);
  else
    print_table(&o, target, !o.socket, results, nresults);
  return EXIT_OK;
}
