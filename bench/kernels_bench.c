/* fsdp-kernels-bench: the collectives kernels against the memory system, measured side by
 * side in one run. For each size (MiB of fp32 data) it times a 2-thread memcpy of those bytes
 * (the reference the targets are stated against), then the casts an unshard runs and
 * the L-way reduces a reduce-scatter runs, with 1 and 2 threads, and prints the median of
 * the runs in ms, the memory traffic in GB/s (bytes read + bytes written, STREAM counting),
 * and two ratios: time / memcpy time of the same fp32 bytes, and time / traffic bound (the
 * op's bytes read + written at the 2-thread memcpy's traffic rate). It also times the worker
 * pool's per-call overhead. Buffers are mapped with MAP_POPULATE and written before any
 * timing, so no run faults a page; they use 4 KiB pages like the daemon's shared arena.
 * Results and how to reproduce them are kept in docs/PERFORMANCE.md. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <json-c/json.h>

#include "common/clock.h"
#include "kernels/kernels.h"
#include "kernels/workers.h"

enum { EXIT_OK = 0, EXIT_FAILED = 1, EXIT_USAGE = 2 };

#define MAX_SIZES 16
#define MAX_RUNS 1001
#define MAX_SRCS 4
#define MAX_RESULTS 256
#define POOL_CALLS 20000
#define POOL_COLD_CALLS 200

typedef enum { OP_MEMCPY, OP_CAST, OP_REDUCE } op_kind_t;

typedef struct {
  const char *name;
  op_kind_t kind;
  fsdp_dtype_t src, dst; /* for reduce: src dtype and reduce dtype (dst is fp32) */
  unsigned n_srcs;
} op_t;

/* The ops of the issue: unshard casts and reduce-scatter's local sums. */
static const op_t OPS[] = {
    {"cast fp32->fp32", OP_CAST, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1},
    {"cast fp32->bf16", OP_CAST, FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, 1},
    {"cast bf16->fp32", OP_CAST, FSDP_DTYPE_BF16, FSDP_DTYPE_FP32, 1},
    {"reduce L=2 fp32", OP_REDUCE, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 2},
    {"reduce L=4 fp32", OP_REDUCE, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 4},
    {"reduce L=2 bf16", OP_REDUCE, FSDP_DTYPE_BF16, FSDP_DTYPE_BF16, 2},
    {"reduce L=4 bf16", OP_REDUCE, FSDP_DTYPE_BF16, FSDP_DTYPE_BF16, 4},
};
#define N_OPS (sizeof OPS / sizeof OPS[0])

typedef struct {
  const char *op;
  unsigned threads;
  size_t mib;
  double median_ms, min_ms;
  double traffic_bytes;
  double gbps;
  double vs_memcpy; /* 0 when not applicable */
  double vs_bound;
  double memcpy_ms, bound_ms;
} result_t;

typedef struct {
  bool json;
  unsigned runs;
  size_t sizes[MAX_SIZES];
  unsigned n_sizes;
  double reduce_scale; /* pre/post factors of the reduce: 1 (none) by default */
} options_t;

/* The buffers of one size, shared by every op. */
typedef struct {
  size_t n; /* elements */
  float *f32[MAX_SRCS];
  uint16_t *h16[MAX_SRCS];
  float *dst32;
  uint16_t *dst16;
} buffers_t;

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void *map_populated(size_t bytes) {
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                 -1, 0);
  if (p == MAP_FAILED)
    return NULL;
  /* MAP_POPULATE maps the zero page lazily for reads on some kernels; writing every page
   * makes each one private and resident before the clock starts. */
  memset(p, 0x3c, bytes);
  return p;
}

static void free_buffers(buffers_t *b) {
  for (int k = 0; k < MAX_SRCS; k++) {
    if (b->f32[k])
      munmap(b->f32[k], b->n * 4);
    if (b->h16[k])
      munmap(b->h16[k], b->n * 2);
  }
  if (b->dst32)
    munmap(b->dst32, b->n * 4);
  if (b->dst16)
    munmap(b->dst16, b->n * 2);
  memset(b, 0, sizeof *b);
}

static int alloc_buffers(buffers_t *b, size_t n) {
  memset(b, 0, sizeof *b);
  b->n = n;
  for (int k = 0; k < MAX_SRCS; k++) {
    if (!(b->f32[k] = map_populated(n * 4)) || !(b->h16[k] = map_populated(n * 2)))
      goto fail;
    /* Ordinary gradient-like values: finite, mixed signs and magnitudes. */
    for (size_t i = 0; i < n; i++)
      b->f32[k][i] = (float)((int)((i * 2654435761u + (unsigned)k * 40503u) % 2001u) - 1000) *
                     1e-3f;
    if (fsdp_cast(b->h16[k], FSDP_DTYPE_BF16, b->f32[k], FSDP_DTYPE_FP32, n) != 0)
      goto fail;
  }
  if (!(b->dst32 = map_populated(n * 4)) || !(b->dst16 = map_populated(n * 2)))
    goto fail;
  return 0;
fail:
  free_buffers(b);
  return -ENOMEM;
}

typedef struct {
  void *dst;
  const void *src;
  size_t elem;
} copy_job_t;

static void copy_chunk(void *arg, size_t begin, size_t end) {
  const copy_job_t *job = arg;
  memcpy((char *)job->dst + begin * job->elem, (const char *)job->src + begin * job->elem,
         (end - begin) * job->elem);
}

/* Runs one op once; returns 0 or a negative code. */
static int run_op(fsdp_workers_t *pool, const op_t *op, buffers_t *b, double scale) {
  size_t n = b->n;
  switch (op->kind) {
  case OP_MEMCPY: {
    copy_job_t job = {b->dst32, b->f32[0], 4};
    /* The same split as the kernels: 64 KiB grains, chunks on 64-byte boundaries. */
    return fsdp_workers_for(pool, n, 16384, copy_chunk, &job);
  }
  case OP_CAST: {
    const void *src = op->src == FSDP_DTYPE_FP32 ? (const void *)b->f32[0] : b->h16[0];
    void *dst = op->dst == FSDP_DTYPE_FP32 ? (void *)b->dst32 : b->dst16;
    return fsdp_cast_parallel(pool, dst, op->dst, src, op->src, n);
  }
  case OP_REDUCE: {
    const void *srcs[MAX_SRCS];
    for (unsigned k = 0; k < op->n_srcs; k++)
      srcs[k] = op->src == FSDP_DTYPE_FP32 ? (const void *)b->f32[k] : b->h16[k];
    return fsdp_reduce_parallel(pool, b->dst32, false, srcs, op->n_srcs, op->src, op->dst,
                                (float)scale, (float)scale, n);
  }
  }
  return -EINVAL;
}

/* Bytes read plus bytes written by one run of op on n elements. */
static double traffic_of(const op_t *op, size_t n) {
  switch (op->kind) {
  case OP_MEMCPY:
    return 8.0 * (double)n;
  case OP_CAST:
    return (double)n * (double)(fsdp_dtype_size(op->src) + fsdp_dtype_size(op->dst));
  case OP_REDUCE:
    return (double)n * ((double)op->n_srcs * (double)fsdp_dtype_size(op->src) + 4.0);
  }
  return 0;
}

/* Median and minimum of `runs` timed runs after one untimed warm-up. */
static int time_op(fsdp_workers_t *pool, const op_t *op, buffers_t *b, const options_t *o,
                   double *ret_median, double *ret_min) {
  double t[MAX_RUNS];
  int r = run_op(pool, op, b, o->reduce_scale);
  if (r < 0)
    return r;
  for (unsigned i = 0; i < o->runs; i++) {
    uint64_t t0 = fsdp_clock_now_ns();
    r = run_op(pool, op, b, o->reduce_scale);
    t[i] = (double)(fsdp_clock_now_ns() - t0) / 1e6;
    if (r < 0)
      return r;
  }
  qsort(t, o->runs, sizeof t[0], cmp_double);
  *ret_median = t[o->runs / 2];
  *ret_min = t[0];
  return 0;
}

static void nop_chunk(void *arg, size_t begin, size_t end) {
  (void)arg;
  (void)begin;
  (void)end;
}

/* Each chunk waits until every chunk has started, so that a call cannot return before the
 * pool's threads have woken, joined and left: the whole hand-off, with no work in it. */
static void meet_chunk(void *arg, size_t begin, size_t end) {
  (void)begin;
  (void)end;
  atomic_uint *arrived = arg;
  atomic_fetch_add(arrived, 1);
  while (atomic_load(arrived) < 2)
    ;
}

/* Median wall time of one fsdp_workers_for call in microseconds. meet: two one-item chunks
 * that must run on two threads at once; otherwise nop chunks over n_items. cold: each call
 * comes after a pause long enough for the pool's threads to have gone to sleep. */
static double time_pool_calls(fsdp_workers_t *pool, size_t n_items, bool meet, bool cold) {
  static double t[POOL_CALLS];
  unsigned calls = cold ? POOL_COLD_CALLS : POOL_CALLS;
  for (unsigned i = 0; i < calls; i++) {
    atomic_uint arrived;
    atomic_init(&arrived, 0);
    if (cold)
      nanosleep(&(struct timespec){0, 2000000}, NULL);
    uint64_t t0 = fsdp_clock_now_ns();
    if (meet)
      fsdp_workers_for(pool, 2, 1, meet_chunk, &arrived);
    else
      fsdp_workers_for(pool, n_items, 1, nop_chunk, NULL);
    t[i] = (double)(fsdp_clock_now_ns() - t0) / 1e3;
  }
  qsort(t, calls, sizeof t[0], cmp_double);
  return t[calls / 2];
}

static json_object *json_double(double v, int decimals) {
  char buf[64];
  snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return json_object_new_double_s(v, buf);
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: fsdp-kernels-bench [--json] [--runs N] [--sizes MIB[,MIB...]] [--scale X]\n"
          "\n"
          "Times the collectives kernels (casts of an unshard, L-way reduces of a\n"
          "reduce-scatter) with 1 and 2 threads against a 2-thread memcpy of the same bytes.\n"
          "  --json          print one JSON object instead of a table\n"
          "  --runs N        timed runs per measurement, median reported (default 5)\n"
          "  --sizes LIST    sizes in MiB of fp32 data (default 1,16,64,256)\n"
          "  --scale X       pre and post factor of the reduces (default 1: no scaling)\n");
}

static int parse_sizes(const char *arg, options_t *o) {
  o->n_sizes = 0;
  const char *p = arg;
  while (*p) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(p, &end, 10);
    if (errno || end == p || v == 0 || v > 65536 || o->n_sizes == MAX_SIZES ||
        (*end != ',' && *end != '\0'))
      return -EINVAL;
    o->sizes[o->n_sizes++] = (size_t)v;
    p = *end == ',' ? end + 1 : end;
  }
  return o->n_sizes ? 0 : -EINVAL;
}

int main(int argc, char **argv) {
  options_t o = {.runs = 5, .sizes = {1, 16, 64, 256}, .n_sizes = 4, .reduce_scale = 1.0};
  static const struct option longopts[] = {
      {"json", no_argument, NULL, 'j'},     {"runs", required_argument, NULL, 'r'},
      {"sizes", required_argument, NULL, 's'}, {"scale", required_argument, NULL, 'x'},
      {"help", no_argument, NULL, 'h'},     {NULL, 0, NULL, 0},
  };
  int c;
  while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    char *end;
    switch (c) {
    case 'j':
      o.json = true;
      break;
    case 'r':
      o.runs = (unsigned)strtoul(optarg, &end, 10);
      if (*end || o.runs < 1 || o.runs > MAX_RUNS) {
        fprintf(stderr, "fsdp-kernels-bench: --runs '%s' must be 1..%d\n", optarg, MAX_RUNS);
        return EXIT_USAGE;
      }
      break;
    case 's':
      if (parse_sizes(optarg, &o) < 0) {
        fprintf(stderr, "fsdp-kernels-bench: --sizes '%s' must be a list of MiB, each 1..65536\n",
                optarg);
        return EXIT_USAGE;
      }
      break;
    case 'x':
      o.reduce_scale = strtod(optarg, &end);
      if (*end || !(o.reduce_scale > 0)) {
        fprintf(stderr, "fsdp-kernels-bench: --scale '%s' must be a positive number\n", optarg);
        return EXIT_USAGE;
      }
      break;
    case 'h':
      usage(stdout);
      return EXIT_OK;
    default:
      usage(stderr);
      return EXIT_USAGE;
    }
  }
  if (optind != argc) {
    usage(stderr);
    return EXIT_USAGE;
  }

  fsdp_workers_t *pools[2] = {NULL, NULL};
  static const unsigned thread_counts[2] = {1, 2};
  int r;
  for (int i = 0; i < 2; i++) {
    if ((r = fsdp_workers_new(thread_counts[i], &pools[i])) < 0) {
      fprintf(stderr, "fsdp-kernels-bench: starting a pool of %u threads: %s\n",
              thread_counts[i], strerror(-r));
      return EXIT_FAILED;
    }
  }

  /* The pool's cost per call: an empty range, a range that runs inline on the caller, and
   * one split across both threads (a wake-up and a hand-back) with nothing to do. */
  double pool_empty_us = time_pool_calls(pools[1], 0, false, false);
  double pool_inline_us = time_pool_calls(pools[1], 1, false, false);
  double pool_split_us = time_pool_calls(pools[1], 0, true, false);
  double pool_cold_us = time_pool_calls(pools[1], 0, true, true);

  static result_t results[MAX_RESULTS];
  unsigned n_results = 0;
  static const op_t memcpy_op = {"memcpy", OP_MEMCPY, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1};
  int status = EXIT_OK;

  if (!o.json)
    printf("%-16s %3s %6s %10s %10s %8s %10s %8s\n", "op", "thr", "MiB", "median_ms", "min_ms",
           "GB/s", "x_memcpy", "x_bound");
  for (unsigned si = 0; si < o.n_sizes && status == EXIT_OK; si++) {
    size_t mib = o.sizes[si];
    size_t n = mib * (1024 * 1024 / 4);
    buffers_t b;
    if (alloc_buffers(&b, n) < 0) {
      fprintf(stderr, "fsdp-kernels-bench: cannot map the buffers of %zu MiB\n", mib);
      status = EXIT_FAILED;
      break;
    }
    /* The reference first: memcpy of the size's fp32 bytes with 2 threads (and 1). */
    double memcpy2_ms = 0, memcpy2_gbps = 0;
    for (int ti = 1; ti >= 0; ti--) {
      double med, mn;
      if ((r = time_op(pools[ti], &memcpy_op, &b, &o, &med, &mn)) < 0) {
        fprintf(stderr, "fsdp-kernels-bench: memcpy failed: %s\n", strerror(-r));
        status = EXIT_FAILED;
        break;
      }
      result_t *res = &results[n_results++];
      if (ti == 1) {
        memcpy2_ms = med;
        memcpy2_gbps = traffic_of(&memcpy_op, n) / (med * 1e6);
      }
      *res = (result_t){.op = "memcpy", .threads = thread_counts[ti], .mib = mib,
                        .median_ms = med, .min_ms = mn, .traffic_bytes = traffic_of(&memcpy_op, n),
                        .memcpy_ms = memcpy2_ms, .bound_ms = memcpy2_ms};
      res->gbps = res->traffic_bytes / (med * 1e6);
      res->vs_memcpy = med / memcpy2_ms;
      res->vs_bound = med / memcpy2_ms;
    }
    for (size_t oi = 0; oi < N_OPS && status == EXIT_OK; oi++) {
      for (int ti = 0; ti < 2; ti++) {
        const op_t *op = &OPS[oi];
        double med, mn;
        if ((r = time_op(pools[ti], op, &b, &o, &med, &mn)) < 0) {
          fprintf(stderr, "fsdp-kernels-bench: %s failed: %s\n", op->name, strerror(-r));
          status = EXIT_FAILED;
          break;
        }
        result_t *res = &results[n_results++];
        double traffic = traffic_of(op, n);
        double bound_ms = traffic / (memcpy2_gbps * 1e6);
        *res = (result_t){.op = op->name, .threads = thread_counts[ti], .mib = mib,
                          .median_ms = med, .min_ms = mn, .traffic_bytes = traffic,
                          .gbps = traffic / (med * 1e6), .memcpy_ms = memcpy2_ms,
                          .bound_ms = bound_ms, .vs_bound = med / bound_ms,
                          .vs_memcpy = op->kind == OP_CAST ? med / memcpy2_ms : 0};
      }
    }
    if (!o.json) {
      for (unsigned i = 0; i < n_results; i++) {
        const result_t *res = &results[i];
        if (res->mib != mib)
          continue;
        char vs_memcpy[32] = "-";
        if (res->vs_memcpy > 0)
          snprintf(vs_memcpy, sizeof vs_memcpy, "%.2f", res->vs_memcpy);
        printf("%-16s %3u %6zu %10.3f %10.3f %8.1f %10s %8.2f\n", res->op, res->threads,
               res->mib, res->median_ms, res->min_ms, res->gbps, vs_memcpy, res->vs_bound);
      }
      fflush(stdout);
    }
    free_buffers(&b);
  }

  if (o.json) {
    json_object *root = json_object_new_object();
    json_object_object_add(root, "runs", json_object_new_int64(o.runs));
    json_object_object_add(root, "cpus", json_object_new_int64(sysconf(_SC_NPROCESSORS_ONLN)));
    json_object_object_add(root, "reduce_scale", json_double(o.reduce_scale, 6));
    json_object_object_add(root, "pool_empty_call_us", json_double(pool_empty_us, 3));
    json_object_object_add(root, "pool_inline_call_us", json_double(pool_inline_us, 3));
    json_object_object_add(root, "pool_split_call_us", json_double(pool_split_us, 3));
    json_object_object_add(root, "pool_cold_split_call_us", json_double(pool_cold_us, 3));
    json_object *arr = json_object_new_array();
    for (unsigned i = 0; i < n_results; i++) {
      const result_t *res = &results[i];
      json_object *e = json_object_new_object();
      json_object_object_add(e, "op", json_object_new_string(res->op));
      json_object_object_add(e, "threads", json_object_new_int64(res->threads));
      json_object_object_add(e, "size_mib", json_object_new_int64((int64_t)res->mib));
      json_object_object_add(e, "median_ms", json_double(res->median_ms, 4));
      json_object_object_add(e, "min_ms", json_double(res->min_ms, 4));
      json_object_object_add(e, "traffic_bytes",
                             json_object_new_int64((int64_t)res->traffic_bytes));
      json_object_object_add(e, "gbps", json_double(res->gbps, 2));
      json_object_object_add(e, "memcpy_ms", json_double(res->memcpy_ms, 4));
      json_object_object_add(e, "bound_ms", json_double(res->bound_ms, 4));
      if (res->vs_memcpy > 0)
        json_object_object_add(e, "vs_memcpy", json_double(res->vs_memcpy, 3));
      json_object_object_add(e, "vs_bound", json_double(res->vs_bound, 3));
      json_object_array_add(arr, e);
    }
    json_object_object_add(root, "results", arr);
    puts(json_object_to_json_string_ext(root, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED |
                                                  JSON_C_TO_STRING_NOSLASHESCAPE));
    json_object_put(root);
  } else {
    printf("\npool call overhead, 2 threads, median: empty range %.3f us, run inline %.3f us,\n"
           "split across both threads %.3f us back to back, %.3f us after the threads slept\n",
           pool_empty_us, pool_inline_us, pool_split_us, pool_cold_us);
  }
  for (int i = 0; i < 2; i++)
    fsdp_workers_free(pools[i]);
  return status;
}
