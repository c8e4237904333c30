/* The backend interface's two implementations side by side: the host's calls the CPU
 * kernels over the worker pool, the GPU's queues the CUDA module's kernels on the daemon's
 * stream and waits for them. */
#include "daemon/backend/backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/failpoint.h"
#include "common/status.h"
#include "cuda/loader.h"
#include "kernels/kernels.h"

void fsdp_backend_init_host(fsdp_backend_t *b, fsdp_workers_t *workers) {
  *b = (fsdp_backend_t){.kind = FSDP_BACKEND_HOST, .workers = workers,
                        .stages_rings = fsdp_failpoint("stage-rings")};
}

int fsdp_backend_init_cuda(fsdp_backend_t *b, const fsdp_cuda_module_t *cuda,
                           const fsdp_cuda_device_t *device, fsdp_status_t *st) {
  *b = (fsdp_backend_t){.kind = FSDP_BACKEND_CUDA, .cuda = cuda, .device = *device,
                        .stages_rings = true};
  fsdp_cuda_device_format(device, b->device_name, sizeof b->device_name);
  int r = cuda->stream_new(device->ordinal, &b->stream, st);
  if (r == 0)
    r = cuda->stream_new(device->ordinal, &b->beside_stream, st);
  if (r < 0) {
    cuda->stream_free(b->stream);
    b->stream = NULL;
    return fsdp_status_set(st, r, "%s: %s", b->device_name, st->message);
  }
  return 0;
}

void fsdp_backend_cleanup(fsdp_backend_t *b) {
  if (b && b->kind == FSDP_BACKEND_CUDA) {
    b->cuda->stream_free(b->beside_stream);
    b->cuda->stream_free(b->stream);
  }
}

const char *fsdp_backend_name(const fsdp_backend_t *b) {
  return b->kind == FSDP_BACKEND_CUDA ? "cuda" : "host";
}

int fsdp_backend_device(const fsdp_backend_t *b) {
  return b->kind == FSDP_BACKEND_CUDA ? b->device.ordinal : -1;
}

int fsdp_backend_memory_new(const fsdp_backend_t *b, size_t bytes, fsdp_cuda_memory_t *ret,
                            fsdp_status_t *st) {
  if (b->kind != FSDP_BACKEND_CUDA)
    return fsdp_status_set(st, FSDP_E_INTERNAL, "the host backend's memory is its arenas'");
  return b->cuda->memory_new(b->device.ordinal, bytes, ret, st);
}

void fsdp_backend_memory_free(const fsdp_backend_t *b, fsdp_cuda_memory_t *memory) {
  if (b->kind == FSDP_BACKEND_CUDA)
    b->cuda->memory_free(memory);
}

int fsdp_backend_host_new(const fsdp_backend_t *b, size_t bytes, void **ret, fsdp_status_t *st) {
  if (b->kind == FSDP_BACKEND_CUDA)
    return b->cuda->host_new(bytes, ret, st);
  void *memory;
  if (posix_memalign(&memory, 4096, bytes ? bytes : 1) != 0)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED,
                           "out of host memory for %zu bytes of staging", bytes);
  *ret = memory;
  return 0;
}

void fsdp_backend_host_free(const fsdp_backend_t *b, void *memory) {
  if (b->kind == FSDP_BACKEND_CUDA)
    b->cuda->host_free(memory);
  else
    free(memory);
}

/* The host kernels explain no failure but their -EINVAL. */
static int host_result(int r, const char *what, fsdp_status_t *st) {
  return r < 0 ? fsdp_status_set(st, r, "%s: %s", what, fsdp_strerror(r)) : 0;
}

int fsdp_backend_cast(const fsdp_backend_t *b, void *dst, fsdp_dtype_t dst_type,
                      const void *src, fsdp_dtype_t src_type, size_t n, fsdp_status_t *st) {
  if (b->kind == FSDP_BACKEND_HOST)
    return host_result(fsdp_cast_parallel(b->workers, dst, dst_type, src, src_type, n), "cast",
                       st);
  int r = b->cuda->cast(b->stream, dst, dst_type, src, src_type, n, st);
  return r < 0 ? r : b->cuda->synchronize(b->stream, st);
}

int fsdp_backend_reduce(const fsdp_backend_t *b, float *dst, bool accumulate,
                        const void *const *srcs, unsigned n_srcs, fsdp_dtype_t src_type,
                        fsdp_dtype_t reduce_type, float pre_scale, float post_scale, size_t n,
                        fsdp_status_t *st) {
  if (b->kind == FSDP_BACKEND_HOST)
    return host_result(fsdp_reduce_parallel(b->workers, dst, accumulate, srcs, n_srcs,
                                            src_type, reduce_type, pre_scale, post_scale, n),
                       "reduce", st);
  int r = b->cuda->reduce(b->stream, dst, accumulate, srcs, n_srcs, src_type, reduce_type,
                          pre_scale, post_scale, n, st);
  return r < 0 ? r : b->cuda->synchronize(b->stream, st);
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

int fsdp_backend_optim_step(const fsdp_backend_t *b, const fsdp_optim_step_t *step, float *p,
                            float *g, float *const state[3], size_t n, fsdp_status_t *st) {
  if (b->kind == FSDP_BACKEND_HOST) {
    optim_range_t r = {.step = step, .p = p, .g = g, .state = state};
    /* 16 K elements a chunk: about 450 KiB of traffic, worth a wake-up. */
    return host_result(fsdp_workers_for(b->workers, n, 16384, step_range, &r),
                       "optimizer step", st);
  }
  int r = b->cuda->optim_step(b->stream, step, p, g, state, n, st);
  return r < 0 ? r : b->cuda->synchronize(b->stream, st);
}

int fsdp_backend_sum_squares(const fsdp_backend_t *b, const float *x, size_t n, double *ret,
                             fsdp_status_t *st) {
  if (b->kind == FSDP_BACKEND_CUDA)
    return b->cuda->sum_squares(b->stream, x, n, ret, st);
  double sum = 0;
  for (size_t i = 0; i < n; i++)
    sum += (double)x[i] * x[i];
  *ret = sum;
  return 0;
}

int fsdp_backend_zero(const fsdp_backend_t *b, void *dst, size_t bytes, fsdp_status_t *st) {
  if (b->kind == FSDP_BACKEND_CUDA)
    return b->cuda->zero(b->device.ordinal, dst, bytes, st);
  memset(dst, 0, bytes);
  return 0;
}

int fsdp_backend_copy(const fsdp_backend_t *b, void *dst, const void *src, size_t bytes,
                      fsdp_status_t *st) {
  if (b->kind == FSDP_BACKEND_HOST) {
    /* Split over the workers as an fp32 "cast"; the odd bytes of a tail by memcpy. */
    size_t words = bytes / sizeof(float), tail = words * sizeof(float);
    int r = fsdp_cast_parallel(b->workers, dst, FSDP_DTYPE_FP32, src, FSDP_DTYPE_FP32, words);
    memcpy((char *)dst + tail, (const char *)src + tail, bytes - tail);
    return host_result(r, "copy", st);
  }
  int r = b->cuda->copy(b->stream, dst, src, bytes, st);
  return r < 0 ? r : b->cuda->synchronize(b->stream, st);
}

int fsdp_backend_copy_beside(const fsdp_backend_t *b, void *dst, const void *src, size_t bytes,
                             fsdp_status_t *st) {
  if (b->kind == FSDP_BACKEND_HOST) {
    memcpy(dst, src, bytes);
    return 0;
  }
  int r = b->cuda->copy(b->beside_stream, dst, src, bytes, st);
  return r < 0 ? r : b->cuda->synchronize(b->beside_stream, st);
}
