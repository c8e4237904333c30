/* The CUDA backend's operations: one GPU's memory, exported to trainers, and the CUDA
 * module's kernels queued on the daemon's stream and waited for, so that each call is
 * complete when it returns. Apart from the host's so that each backend is one file behind
 * the table of backend.h. */
#include "daemon/backend/cuda_backend.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/status.h"
#include "cuda/loader.h"

/* The module, the GPU, the daemon's stream on it, and the stream of the copies beside it. */
typedef struct cuda_backend {
  const fsdp_cuda_module_t *cuda;
  fsdp_cuda_device_t device;
  fsdp_cuda_stream_t *stream;
  fsdp_cuda_stream_t *beside_stream;
} cuda_backend_t;

static const cuda_backend_t *state_of(const fsdp_backend_t *b) {
  return b->impl;
}

/* Waits for what was just queued on the stream, unless queueing it failed. */
static int queued(const cuda_backend_t *c, fsdp_cuda_stream_t *stream, int r, fsdp_status_t *st) {
  return r < 0 ? r : c->cuda->synchronize(stream, st);
}

static void cleanup(fsdp_backend_t *b) {
  cuda_backend_t *c = b->impl;
  c->cuda->stream_free(c->beside_stream);
  c->cuda->stream_free(c->stream);
  free(c);
  b->impl = NULL;
}

static int memory_new(const fsdp_backend_t *b, size_t bytes, fsdp_backend_memory_t *ret,
                      fsdp_status_t *st) {
  const cuda_backend_t *c = state_of(b);
  fsdp_cuda_memory_t *memory = malloc(sizeof *memory);
  if (!memory)
    return fsdp_status_set(st, -ENOMEM, "%s: out of host memory for a memory's record",
                           b->device_name);
  int r = c->cuda->memory_new(c->device.ordinal, bytes, memory, st);
  if (r < 0) {
    free(memory);
    return r;
  }
  *ret = (fsdp_backend_memory_t){.base = memory->base, .bytes = memory->bytes,
                                 .page = memory->page, .fd = memory->fd, .impl = memory};
  return 0;
}

static void memory_free(const fsdp_backend_t *b, fsdp_backend_memory_t *memory) {
  state_of(b)->cuda->memory_free(memory->impl);
  free(memory->impl);
  *memory = (fsdp_backend_memory_t){.fd = -1};
}

static int host_new(const fsdp_backend_t *b, size_t bytes, void **ret, fsdp_status_t *st) {
  return state_of(b)->cuda->host_new(bytes, ret, st);
}

static void host_free(const fsdp_backend_t *b, void *memory) {
  state_of(b)->cuda->host_free(memory);
}

static int cast(const fsdp_backend_t *b, void *dst, fsdp_dtype_t dst_type, const void *src,
                fsdp_dtype_t src_type, size_t n, fsdp_status_t *st) {
  const cuda_backend_t *c = state_of(b);
  return queued(c, c->stream, c->cuda->cast(c->stream, dst, dst_type, src, src_type, n, st), st);
}

static int reduce(const fsdp_backend_t *b, float *dst, bool accumulate, const void *const *srcs,
                  unsigned n_srcs, fsdp_dtype_t src_type, fsdp_dtype_t reduce_type,
                  float pre_scale, float post_scale, size_t n, fsdp_status_t *st) {
  const cuda_backend_t *c = state_of(b);
  int r = c->cuda->reduce(c->stream, dst, accumulate, srcs, n_srcs, src_type, reduce_type,
                          pre_scale, post_scale, n, st);
  return queued(c, c->stream, r, st);
}

static int optim_step(const fsdp_backend_t *b, const fsdp_optim_step_t *step, float *p,
                      float *g, float *const state[3], size_t n, fsdp_status_t *st) {
  const cuda_backend_t *c = state_of(b);
  return queued(c, c->stream, c->cuda->optim_step(c->stream, step, p, g, state, n, st), st);
}

static int sum_squares(const fsdp_backend_t *b, const float *x, size_t n, double *ret,
                       fsdp_status_t *st) {
  const cuda_backend_t *c = state_of(b);
  return c->cuda->sum_squares(c->stream, x, n, ret, st);
}

static int zero(const fsdp_backend_t *b, void *dst, size_t bytes, fsdp_status_t *st) {
  const cuda_backend_t *c = state_of(b);
  return c->cuda->zero(c->device.ordinal, dst, bytes, st);
}

static int copy(const fsdp_backend_t *b, void *dst, const void *src, size_t bytes,
                fsdp_status_t *st) {
  const cuda_backend_t *c = state_of(b);
  return queued(c, c->stream, c->cuda->copy(c->stream, dst, src, bytes, st), st);
}

static int copy_beside(const fsdp_backend_t *b, void *dst, const void *src, size_t bytes,
                       fsdp_status_t *st) {
  const cuda_backend_t *c = state_of(b);
  return queued(c, c->beside_stream, c->cuda->copy(c->beside_stream, dst, src, bytes, st), st);
}

/* The backend's event is the module's: the cast keeps the module's type out of backend.h. */
static int event_new(const fsdp_backend_t *b, fsdp_backend_event_t **ret,
                     unsigned char handle[64], fsdp_status_t *st) {
  const cuda_backend_t *c = state_of(b);
  fsdp_cuda_event_t *ev;
  int r = c->cuda->event_new(c->device.ordinal, &ev, handle, st);
  if (r == 0)
    *ret = (fsdp_backend_event_t *)ev;
  return r;
}

static void event_free(const fsdp_backend_t *b, fsdp_backend_event_t *event) {
  state_of(b)->cuda->event_free((fsdp_cuda_event_t *)event);
}

/* Both streams: a snapshot's copies beside the work read what the trainer wrote too. */
static int wait_event(const fsdp_backend_t *b, fsdp_backend_event_t *event, fsdp_status_t *st) {
  const cuda_backend_t *c = state_of(b);
  fsdp_cuda_event_t *ev = (fsdp_cuda_event_t *)event;
  int r = c->cuda->stream_wait(c->stream, ev, st);
  return r < 0 ? r : c->cuda->stream_wait(c->beside_stream, ev, st);
}

static const fsdp_backend_ops_t cuda_ops = {
    .name = "cuda",
    .cleanup = cleanup,
    .memory_new = memory_new,
    .memory_free = memory_free,
    .host_new = host_new,
    .host_free = host_free,
    .cast = cast,
    .reduce = reduce,
    .optim_step = optim_step,
    .sum_squares = sum_squares,
    .zero = zero,
    .copy = copy,
    .copy_beside = copy_beside,
    .event_new = event_new,
    .event_free = event_free,
    .wait_event = wait_event,
};

int fsdp_backend_init_cuda(fsdp_backend_t *b, const fsdp_cuda_module_t *cuda,
                           const fsdp_cuda_device_t *device, fsdp_status_t *st) {
  char name[sizeof b->device_name];
  fsdp_cuda_device_format(device, name, sizeof name);
  cuda_backend_t *c = calloc(1, sizeof *c);
  if (!c)
    return fsdp_status_set(st, -ENOMEM, "%s: out of host memory for the backend", name);
  *c = (cuda_backend_t){.cuda = cuda, .device = *device};
  int r = cuda->stream_new(device->ordinal, &c->stream, st);
  if (r == 0)
    r = cuda->stream_new(device->ordinal, &c->beside_stream, st);
  if (r < 0) {
    cuda->stream_free(c->stream);
    free(c);
    return fsdp_status_set(st, r, "%s: %s", name, st->message);
  }
  *b = (fsdp_backend_t){.ops = &cuda_ops, .device = device->ordinal, .stages_rings = true,
                        .impl = c};
  snprintf(b->device_name, sizeof b->device_name, "%s", name);
  return 0;
}
