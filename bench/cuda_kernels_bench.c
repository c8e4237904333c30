/* fsdp-cuda-kernels-bench: the CUDA backend's kernels (cuda/kernels.h) against the GPU's
 * memory system. For each op it times, with CUDA events on one stream, the op and a
 * device-to-device cudaMemcpyAsync that moves the same traffic (a copy of B bytes reads B and
 * writes B, so it moves 2B), and prints the median of the runs in ms, the traffic (bytes read
 * + bytes written) in GB/s and the ratio of the op's GB/s to the copy's. Every measurement
 * starts with untimed warm-up runs. The data is one fp32 buffer of --mib MiB (default 256)
 * and its bf16 sources; every value is finite and normal, so no subnormal slows a kernel.
 * The daemon's AdamW step on as many fp32 parameters reads parameters, gradients and both
 * moments and writes parameters and both moments (28 bytes an element): its ratio is to
 * the memory-traffic bound a copy sets.
 * Needs a GPU: exits 77 (skipped) where the CUDA runtime sees none. */
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "cuda/kernels.h"
#include "kernels/kernels.h"
#include "kernels/optim.h"

enum { EXIT_OK = 0, EXIT_FAILED = 1, EXIT_USAGE = 2, EXIT_SKIPPED = 77 };

#define MAX_RUNS 1001
#define WARMUP_RUNS 3
#define MAX_SRCS 4

typedef enum { OP_MEMCPY, OP_CAST, OP_REDUCE, OP_ADAMW } op_kind_t;

typedef struct {
  const char *name;
  op_kind_t kind;
  fsdp_dtype_t src, dst; /* for a reduce: the sources' dtype and the reduce dtype (dst fp32) */
  unsigned n_srcs;
} op_t;

/* An unshard's casts and a reduce-scatter's local sums of bf16 gradients. */
static const op_t OPS[] = {
    {"cast fp32->bf16", OP_CAST, FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, 1},
    {"cast bf16->fp32", OP_CAST, FSDP_DTYPE_BF16, FSDP_DTYPE_FP32, 1},
    {"cast fp32->fp16", OP_CAST, FSDP_DTYPE_FP32, FSDP_DTYPE_FP16, 1},
    {"reduce L=2 bf16->fp32 in fp32", OP_REDUCE, FSDP_DTYPE_BF16, FSDP_DTYPE_FP32, 2},
    {"reduce L=4 bf16->fp32 in fp32", OP_REDUCE, FSDP_DTYPE_BF16, FSDP_DTYPE_FP32, 4},
    {"reduce L=2 bf16->fp32 in bf16", OP_REDUCE, FSDP_DTYPE_BF16, FSDP_DTYPE_BF16, 2},
    {"reduce L=4 bf16->fp32 in bf16", OP_REDUCE, FSDP_DTYPE_BF16, FSDP_DTYPE_BF16, 4},
    {"AdamW step (fp32 state)", OP_ADAMW, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1},
};
#define N_OPS (sizeof OPS / sizeof OPS[0])

/* Device buffers, shared by every op: n elements each. */
typedef struct {
  size_t n;
  float *f32;
  uint16_t *h16[MAX_SRCS];
  float *dst32;
  uint16_t *dst16;
  float *exp_avg, *exp_avg_sq; /* AdamW's moments; its parameters f32, its gradients dst32 */
  void *copy_src, *copy_dst; /* the reference copy's, as large as the largest op's traffic / 2 */
  size_t copy_bytes;
  cudaStream_t stream;
  cudaEvent_t start, stop;
} buffers_t;

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* Bytes read + bytes written by one run of op over n elements. */
static size_t traffic_of(const op_t *op, size_t n) {
  if (op->kind == OP_CAST)
    return n * (fsdp_dtype_size(op->src) + fsdp_dtype_size(op->dst));
  if (op->kind == OP_ADAMW)
    return n * 28;
  return n * (op->n_srcs * fsdp_dtype_size(op->src) + sizeof(float));
}

static bool cuda_ok(cudaError_t e, const char *what) {
  if (e == cudaSuccess)
    return true;
  fprintf(stderr, "fsdp-cuda-kernels-bench: %s: %s\n", what, cudaGetErrorString(e));
  return false;
}

static void free_buffers(buffers_t *b) {
  cudaFree(b->f32);
  for (int k = 0; k < MAX_SRCS; k++)
    cudaFree(b->h16[k]);
  cudaFree(b->dst32);
  cudaFree(b->dst16);
  cudaFree(b->exp_avg);
  cudaFree(b->exp_avg_sq);
  cudaFree(b->copy_src);
  cudaFree(b->copy_dst);
  if (b->start)
    cudaEventDestroy(b->start);
  if (b->stop)
    cudaEventDestroy(b->stop);
  if (b->stream)
    cudaStreamDestroy(b->stream);
  memset(b, 0, sizeof *b);
}

static bool alloc_buffers(buffers_t *b, size_t n) {
  memset(b, 0, sizeof *b);
  b->n = n;
  for (size_t i = 0; i < N_OPS; i++) {
    size_t half = traffic_of(&OPS[i], n) / 2;
    if (half > b->copy_bytes)
      b->copy_bytes = half;
  }
  bool ok = cuda_ok(cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking), "stream") &&
            cuda_ok(cudaEventCreate(&b->start), "event") &&
            cuda_ok(cudaEventCreate(&b->stop), "event") &&
            cuda_ok(cudaMalloc((void **)&b->f32, n * 4), "cudaMalloc") &&
            cuda_ok(cudaMalloc((void **)&b->dst32, n * 4), "cudaMalloc") &&
            cuda_ok(cudaMalloc((void **)&b->dst16, n * 2), "cudaMalloc") &&
            cuda_ok(cudaMalloc((void **)&b->exp_avg, n * 4), "cudaMalloc") &&
            cuda_ok(cudaMalloc((void **)&b->exp_avg_sq, n * 4), "cudaMalloc") &&
            cuda_ok(cudaMalloc(&b->copy_src, b->copy_bytes), "cudaMalloc") &&
            cuda_ok(cudaMalloc(&b->copy_dst, b->copy_bytes), "cudaMalloc");
  for (int k = 0; ok && k < MAX_SRCS; k++)
    ok = cuda_ok(cudaMalloc((void **)&b->h16[k], n * 2), "cudaMalloc");
  /* Byte 0x3f makes fp32 0x3f3f3f3f (0.747) and bf16 0x3f3f (0.746): normal values whose
   * sums stay finite. */
  ok = ok && cuda_ok(cudaMemset(b->f32, 0x3f, n * 4), "cudaMemset") &&
       cuda_ok(cudaMemset(b->dst32, 0x3f, n * 4), "cudaMemset") &&
       cuda_ok(cudaMemset(b->exp_avg, 0x3f, n * 4), "cudaMemset") &&
       cuda_ok(cudaMemset(b->exp_avg_sq, 0x3f, n * 4), "cudaMemset") &&
       cuda_ok(cudaMemset(b->copy_src, 0x3f, b->copy_bytes), "cudaMemset");
  for (int k = 0; ok && k < MAX_SRCS; k++)
    ok = cuda_ok(cudaMemset(b->h16[k], 0x3f, n * 2), "cudaMemset");
  ok = ok && cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  if (!ok)
    free_buffers(b);
  return ok;
}

/* Queues one run of op on b's stream; copy_bytes is the reference copy's size. */
static bool launch(const op_t *op, buffers_t *b, size_t copy_bytes) {
  fsdp_status_t st = FSDP_STATUS_INIT;
  int r = 0;
  switch (op->kind) {
  case OP_MEMCPY:
    return cuda_ok(cudaMemcpyAsync(b->copy_dst, b->copy_src, copy_bytes,
                                   cudaMemcpyDeviceToDevice, b->stream),
                   "cudaMemcpyAsync");
  case OP_CAST: {
    const void *src = op->src == FSDP_DTYPE_FP32 ? (const void *)b->f32 : b->h16[0];
    void *dst = op->dst == FSDP_DTYPE_FP32 ? (void *)b->dst32 : b->dst16;
    r = fsdp_cuda_cast(dst, op->dst, src, op->src, b->n, b->stream, &st);
    break;
  }
  case OP_REDUCE: {
    const void *srcs[MAX_SRCS];
    for (unsigned k = 0; k < op->n_srcs; k++)
      srcs[k] = b->h16[k];
    r = fsdp_cuda_reduce(b->dst32, false, srcs, op->n_srcs, op->src, op->dst, 1.0f, 1.0f, b->n,
                         b->stream, &st);
    break;
  }
  case OP_ADAMW: {
    static const fsdp_optim_hyper_t adamw = {.lr = 1e-3, .weight_decay = 0.01, .beta1 = 0.9,
                                             .beta2 = 0.999, .eps = 1e-8};
    fsdp_optim_step_t step = fsdp_optim_prepare(FSDP_OPTIM_RULE_ADAMW, &adamw, 10, false, 1.0f);
    float *state[3] = {b->exp_avg, b->exp_avg_sq, NULL};
    r = fsdp_cuda_optim_step(&step, b->f32, b->dst32, state, b->n, b->stream, &st);
    break;
  }
  }
  if (r < 0)
    fprintf(stderr, "fsdp-cuda-kernels-bench: %s: %s\n", op->name, st.message);
  return r >= 0;
}

/* The median of runs timed runs of op after the warm-up, in ms. */
static bool time_op(const op_t *op, buffers_t *b, size_t copy_bytes, unsigned runs,
                    double *ret_median_ms) {
  static float ms[MAX_RUNS];
  for (unsigned i = 0; i < WARMUP_RUNS; i++)
    if (!launch(op, b, copy_bytes))
      return false;
  for (unsigned i = 0; i < runs; i++) {
    if (!cuda_ok(cudaEventRecord(b->start, b->stream), "cudaEventRecord") ||
        !launch(op, b, copy_bytes) ||
        !cuda_ok(cudaEventRecord(b->stop, b->stream), "cudaEventRecord") ||
        !cuda_ok(cudaEventSynchronize(b->stop), "cudaEventSynchronize") ||
        !cuda_ok(cudaEventElapsedTime(&ms[i], b->start, b->stop), "cudaEventElapsedTime"))
      return false;
  }
  qsort(ms, runs, sizeof ms[0], cmp_float);
  *ret_median_ms = runs % 2 ? ms[runs / 2] : (ms[runs / 2 - 1] + ms[runs / 2]) / 2.0;
  return true;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: fsdp-cuda-kernels-bench [--mib N] [--runs N]\n"
          "\n"
          "Times the CUDA kernels (casts of an unshard, L-way reduces of bf16 gradients) on\n"
          "the first GPU against a device-to-device copy moving the same bytes.\n"
          "  --mib N     size of the fp32 buffer in MiB (default 256)\n"
          "  --runs N    timed runs per measurement, median reported (default 20)\n");
}

int main(int argc, char **argv) {
  size_t mib = 256;
  unsigned runs = 20;
  static const struct option longopts[] = {
      {"mib", required_argument, NULL, 'm'},
      {"runs", required_argument, NULL, 'r'},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  int c;
  while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    char *end;
    switch (c) {
    case 'm':
      errno = 0;
      mib = strtoul(optarg, &end, 10);
      if (errno || *end || mib < 1 || mib > 65536) {
        fprintf(stderr, "fsdp-cuda-kernels-bench: --mib '%s' must be 1..65536\n", optarg);
        return EXIT_USAGE;
      }
      break;
    case 'r':
      runs = (unsigned)strtoul(optarg, &end, 10);
      if (*end || runs < 1 || runs > MAX_RUNS) {
        fprintf(stderr, "fsdp-cuda-kernels-bench: --runs '%s' must be 1..%d\n", optarg,
                MAX_RUNS);
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

  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    printf("skipped: no GPU (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "none seen");
    return EXIT_SKIPPED;
  }
  struct cudaDeviceProp prop;
  if (!cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties"))
    return EXIT_FAILED;

  buffers_t b;
  size_t n = mib * (1024 * 1024 / 4);
  if (!alloc_buffers(&b, n)) {
    fprintf(stderr, "fsdp-cuda-kernels-bench: cannot allocate the buffers of %zu MiB\n", mib);
    return EXIT_FAILED;
  }
  printf("# %s, %zu MiB of fp32 (%zu elements), median of %u runs\n", prop.name, mib, n, runs);
  printf("%-30s %12s %10s %8s %11s %8s\n", "op", "bytes", "median_ms", "GB/s", "memcpy_GB/s",
         "x_memcpy");
  static const op_t memcpy_op = {"memcpy", OP_MEMCPY, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1};
  int status = EXIT_OK;
  for (size_t i = 0; i < N_OPS; i++) {
    const op_t *op = &OPS[i];
    size_t traffic = traffic_of(op, n);
    double copy_ms, op_ms;
    if (!time_op(&memcpy_op, &b, traffic / 2, runs, &copy_ms) ||
        !time_op(op, &b, 0, runs, &op_ms)) {
      status = EXIT_FAILED;
      break;
    }
    double copy_gbps = (double)traffic / (copy_ms * 1e6);
    double op_gbps = (double)traffic / (op_ms * 1e6);
    printf("%-30s %12zu %10.3f %8.1f %11.1f %8.2f\n", op->name, traffic, op_ms, op_gbps,
           copy_gbps, op_gbps / copy_gbps);
    fflush(stdout);
  }
  free_buffers(&b);
  return status;
}
