/* The host backend's operations: the CPU kernels split over the data plane's worker pool, on
 * host memory (the arenas' memfds, daemon/store/arena.h; staging from the heap). Apart from
 * the GPU's so that each backend is one file behind the table of backend.h. */
#include "daemon/backend/host_backend.h"

#include <stdlib.h>
#include <string.h>

#include "common/failpoint.h"
#include "common/status.h"
#include "kernels/kernels.h"

static fsdp_workers_t *workers_of(const fsdp_backend_t *b) {
  return b->impl;
}

static int host_new(const fsdp_backend_t *b, size_t bytes, void **ret, fsdp_status_t *st) {
  (void)b;
  void *memory;
  if (posix_memalign(&memory, 4096, bytes ? bytes : 1) != 0)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED,
                           "out of host memory for %zu bytes of staging", bytes);
  *ret = memory;
  return 0;
}

static void host_free(const fsdp_backend_t *b, void *memory) {
  (void)b;
  free(memory);
}

/* The host kernels explain no failure but their -EINVAL. */
static int host_result(int r, const char *what, fsdp_status_t *st) {
  return r < 0 ? fsdp_status_set(st, r, "%s: %s", what, fsdp_strerror(r)) : 0;
}

static int cast(const fsdp_backend_t *b, void *dst, fsdp_dtype_t dst_type, const void *src,
                fsdp_dtype_t src_type, size_t n, fsdp_status_t *st) {
  return host_result(fsdp_cast_parallel(workers_of(b), dst, dst_type, src, src_type, n), "cast",
                     st);
}

static int reduce(const fsdp_backend_t *b, float *dst, bool accumulate, const void *const *srcs,
                  unsigned n_srcs, fsdp_dtype_t src_type, fsdp_dtype_t reduce_type,
                  float pre_scale, float post_scale, size_t n, fsdp_status_t *st) {
  return host_result(fsdp_reduce_parallel(workers_of(b), dst, accumulate, srcs, n_srcs, src_type,
                                          reduce_type, pre_scale, post_scale, n),
                     "reduce", st);
}

/* A range of a step's elements on one worker. */
typedef struct optim_range {
  const fsdp_optim_step_t *step;
  float *p, *g;
  float *const *state;
} optim_range_t;

static void step_range(void *arg, size_t begin, size_t end) {
  const optim_range_t *r = arg;
  float *state[3] = {NULL, NULL, NULL};
  for (size_t a = 0; a < 3; a++)
    if (r->state[a])
      state[a] = r->state[a] + begin;
  fsdp_optim_run(r->step, r->p + begin, r->g + begin, state, end - begin);
}

static int optim_step(const fsdp_backend_t *b, const fsdp_optim_step_t *step, float *p,
                      float *g, float *const state[3], size_t n, fsdp_status_t *st) {
  optim_range_t r = {.step = step, .p = p, .g = g, .state = state};
  /* 16 K elements a chunk: about 450 KiB of traffic, worth a wake-up. */
  return host_result(fsdp_workers_for(workers_of(b), n, 16384, step_range, &r),
                     "optimizer step", st);
}

static int sum_squares(const fsdp_backend_t *b, const float *x, size_t n, double *ret,
                       fsdp_status_t *st) {
  (void)b;
  (void)st;
  double sum = 0;
  for (size_t i = 0; i < n; i++)
    sum += (double)x[i] * x[i];
  *ret = sum;
  return 0;
}

static int zero(const fsdp_backend_t *b, void *dst, size_t bytes, fsdp_status_t *st) {
  (void)b;
  (void)st;
  memset(dst, 0, bytes);
  return 0;
}

static int copy(const fsdp_backend_t *b, void *dst, const void *src, size_t bytes,
                fsdp_status_t *st) {
  /* Split over the workers as an fp32 "cast"; the odd bytes of a tail by memcpy. */
  size_t words = bytes / sizeof(float), tail = words * sizeof(float);
  int r = fsdp_cast_parallel(workers_of(b), dst, FSDP_DTYPE_FP32, src, FSDP_DTYPE_FP32, words);
  memcpy((char *)dst + tail, (const char *)src + tail, bytes - tail);
  return host_result(r, "copy", st);
}

static int copy_beside(const fsdp_backend_t *b, void *dst, const void *src, size_t bytes,
                       fsdp_status_t *st) {
  (void)b;
  (void)st;
  memcpy(dst, src, bytes);
  return 0;
}

static const fsdp_backend_ops_t host_ops = {
    .name = "host",
    .host_new = host_new,
    .host_free = host_free,
    .cast = cast,
    .reduce = reduce,
    .optim_step = optim_step,
    .sum_squares = sum_squares,
    .zero = zero,
    .copy = copy,
    .copy_beside = copy_beside,
};

void fsdp_backend_init_host(fsdp_backend_t *b, fsdp_workers_t *workers) {
  *b = (fsdp_backend_t){.ops = &host_ops, .device = -1, .impl = workers,
                        .stages_rings = fsdp_failpoint("stage-rings")};
}
