/* fsdp_backend_t: where a daemon keeps its jobs' memory and what computes on it, one per
 * daemon (`daemon.backend`): host memory and the CPU kernels (daemon/backend/host_backend.h),
 * or one GPU's memory and its kernels (daemon/backend/cuda_backend.h).
 *
 * A backend is a table of operations (fsdp_backend_ops_t) and the little state its callers
 * read; each implementation is a file of its own with a constructor that fills both, so that
 * no caller tests which backend it has: where a caller needs to know something of it, that is
 * a field here (stages_rings, device). A second backend is a second file.
 *
 * The data plane and the arenas know only this interface: memory a trainer maps (made once
 * per arena; the host's is the arena's own memfd, see daemon/store/arena.h), host memory
 * for staging, and the operations on the memory (cast, reduce, copy, an optimizer's step,
 * a sum of squares), each complete when its call returns (the GPU's are queued on the
 * daemon's stream and waited for), so a caller on the thread pool holds no handle to wait
 * on and a trainer's next request sees the result: a trainer's stream needs no event of the
 * daemon's, the reply is the order. The other way, a GPU's trainer records an event of its
 * session's (fsdp_backend_event_new) on its stream before each request, and the daemon's
 * streams wait on it (fsdp_backend_wait_event) before the work that follows: neither side's
 * host thread waits for the other's device.
 *
 * Every call but the constructor and cleanup may run on any thread, but the operations one
 * at a time: the data plane runs one work item at a time. fsdp_backend_copy_beside may run
 * beside them, and so may the calls that make, zero or free memory nothing else uses yet. */
#ifndef FSDP_BACKEND_H
#define FSDP_BACKEND_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"
#include "kernels/dtype.h"
#include "kernels/optim.h"

typedef struct fsdp_backend fsdp_backend_t;

/* An event another process records and the backend's streams wait on (a GPU's IPC event). */
typedef struct fsdp_backend_event fsdp_backend_event_t;

/* Memory of a backend's own that trainers map (a GPU's): one allocation exported as a file
 * descriptor, mapped read-write by the daemon, zeroed once. */
typedef struct fsdp_backend_memory {
  void *base;   /* the daemon's mapping (a device address on a GPU) */
  size_t bytes; /* a multiple of page */
  size_t page;  /* the allocation granularity: a trainer maps whole memories */
  int fd;       /* the exported descriptor, the memory's: send it, the receiver imports it */
  void *impl;   /* the backend's own record of the memory */
} fsdp_backend_memory_t;

/* One backend's operations; every one takes the backend it belongs to. The contracts are
 * those of the fsdp_backend_* calls below, which call through the table. */
typedef struct fsdp_backend_ops {
  const char *name; /* "host", "cuda" */
  void (*cleanup)(fsdp_backend_t *b); /* NULL: nothing to undo */
  /* NULL where the backend's memory is the host's (device -1): an arena makes its memfd. */
  int (*memory_new)(const fsdp_backend_t *b, size_t bytes, fsdp_backend_memory_t *ret,
                    fsdp_status_t *st);
  void (*memory_free)(const fsdp_backend_t *b, fsdp_backend_memory_t *memory);
  int (*host_new)(const fsdp_backend_t *b, size_t bytes, void **ret, fsdp_status_t *st);
  void (*host_free)(const fsdp_backend_t *b, void *memory);
  int (*cast)(const fsdp_backend_t *b, void *dst, fsdp_dtype_t dst_type, const void *src,
              fsdp_dtype_t src_type, size_t n, fsdp_status_t *st);
  int (*reduce)(const fsdp_backend_t *b, float *dst, bool accumulate, const void *const *srcs,
                unsigned n_srcs, fsdp_dtype_t src_type, fsdp_dtype_t reduce_type,
                float pre_scale, float post_scale, size_t n, fsdp_status_t *st);
  int (*optim_step)(const fsdp_backend_t *b, const fsdp_optim_step_t *step, float *p, float *g,
                    float *const state[3], size_t n, fsdp_status_t *st);
  int (*sum_squares)(const fsdp_backend_t *b, const float *x, size_t n, double *ret,
                     fsdp_status_t *st);
  int (*zero)(const fsdp_backend_t *b, void *dst, size_t bytes, fsdp_status_t *st);
  int (*copy)(const fsdp_backend_t *b, void *dst, const void *src, size_t bytes,
              fsdp_status_t *st);
  int (*copy_beside)(const fsdp_backend_t *b, void *dst, const void *src, size_t bytes,
                     fsdp_status_t *st);
  /* NULL where the backend's memory is the host's: a trainer's writes are done when it
   * calls. */
  int (*event_new)(const fsdp_backend_t *b, fsdp_backend_event_t **ret,
                   unsigned char handle[64], fsdp_status_t *st);
  void (*event_free)(const fsdp_backend_t *b, fsdp_backend_event_t *event);
  int (*wait_event)(const fsdp_backend_t *b, fsdp_backend_event_t *event, fsdp_status_t *st);
} fsdp_backend_ops_t;

struct fsdp_backend {
  const fsdp_backend_ops_t *ops;
  /* The device ordinal of its memory, -1 for host memory. */
  int device;
  /* The device as messages name it ("" for the host's). */
  char device_name[320];
  /* The rings among hosts move host memory: a GPU's jobs stage what they move in host
   * buffers (daemon/store/staging.h). The host backend's jobs stage only where a test asks
   * (the failpoint "stage-rings"), to run that path on a machine without a GPU. */
  bool stages_rings;
  void *impl; /* the implementation's own state */
};

/* NULL-safe, and safe on a backend no constructor filled (zeroed). */
static inline void fsdp_backend_cleanup(fsdp_backend_t *b) {
  if (b && b->ops && b->ops->cleanup)
    b->ops->cleanup(b);
}

/* "host", or "cuda". */
static inline const char *fsdp_backend_name(const fsdp_backend_t *b) {
  return b->ops->name;
}
/* The device ordinal of its memory, -1 for host memory. */
static inline int fsdp_backend_device(const fsdp_backend_t *b) {
  return b->device;
}
/* Whether its memory is the host's: the daemon reads and writes it directly, and an arena
 * makes it (a memfd) rather than fsdp_backend_memory_new. */
static inline bool fsdp_backend_memory_is_host(const fsdp_backend_t *b) {
  return b->device < 0;
}

/* Memory for an arena where the backend's is not the host's: at least `bytes`, zeroed, with
 * a descriptor for trainers; ret is the caller's storage, undone by fsdp_backend_memory_free
 * (a trainer that imported it keeps the memory until it lets go). */
static inline int fsdp_backend_memory_new(const fsdp_backend_t *b, size_t bytes,
                                          fsdp_backend_memory_t *ret, fsdp_status_t *st) {
  if (!b->ops->memory_new)
    return fsdp_status_set(st, FSDP_E_INTERNAL, "the %s backend's memory is its arenas'",
                           b->ops->name);
  return b->ops->memory_new(b, bytes, ret, st);
}
static inline void fsdp_backend_memory_free(const fsdp_backend_t *b,
                                            fsdp_backend_memory_t *memory) {
  if (b->ops->memory_free)
    b->ops->memory_free(b, memory);
}

/* Host memory of at least `bytes` in *ret, for staging (pinned on a GPU); freed by
 * fsdp_backend_host_free, NULL-safe. RESOURCE_EXHAUSTED when there is none. */
static inline int fsdp_backend_host_new(const fsdp_backend_t *b, size_t bytes, void **ret,
                                        fsdp_status_t *st) {
  return b->ops->host_new(b, bytes, ret, st);
}
static inline void fsdp_backend_host_free(const fsdp_backend_t *b, void *memory) {
  b->ops->host_free(b, memory);
}

/* kernels/kernels.h's contracts, on the backend's memory. */
static inline int fsdp_backend_cast(const fsdp_backend_t *b, void *dst, fsdp_dtype_t dst_type,
                                    const void *src, fsdp_dtype_t src_type, size_t n,
                                    fsdp_status_t *st) {
  return b->ops->cast(b, dst, dst_type, src, src_type, n, st);
}
static inline int fsdp_backend_reduce(const fsdp_backend_t *b, float *dst, bool accumulate,
                                      const void *const *srcs, unsigned n_srcs,
                                      fsdp_dtype_t src_type, fsdp_dtype_t reduce_type,
                                      float pre_scale, float post_scale, size_t n,
                                      fsdp_status_t *st) {
  return b->ops->reduce(b, dst, accumulate, srcs, n_srcs, src_type, reduce_type, pre_scale,
                        post_scale, n, st);
}
/* One optimizer step (kernels/optim.h's fsdp_optim_run, the same bits) over n elements of
 * the backend's memory: split over the workers on the host, one kernel on a GPU. */
static inline int fsdp_backend_optim_step(const fsdp_backend_t *b, const fsdp_optim_step_t *step,
                                          float *p, float *g, float *const state[3], size_t n,
                                          fsdp_status_t *st) {
  return b->ops->optim_step(b, step, p, g, state, n, st);
}
/* The sum of the squares of n fp32 elements in double, in *ret: in element order on the
 * host, in a GPU's fixed order of its own there (the same on every run, not the host's
 * bits). */
static inline int fsdp_backend_sum_squares(const fsdp_backend_t *b, const float *x, size_t n,
                                           double *ret, fsdp_status_t *st) {
  return b->ops->sum_squares(b, x, n, ret, st);
}
/* Zeroes new memory of the backend's (a GPU's is waited for on none of the backend's
 * streams: any thread, the loop included, as the memory's own making). */
static inline int fsdp_backend_zero(const fsdp_backend_t *b, void *dst, size_t bytes,
                                    fsdp_status_t *st) {
  return b->ops->zero(b, dst, bytes, st);
}

/* bytes from src to dst, each the backend's memory or the host's (a checkpoint's staging). */
static inline int fsdp_backend_copy(const fsdp_backend_t *b, void *dst, const void *src,
                                    size_t bytes, fsdp_status_t *st) {
  return b->ops->copy(b, dst, src, bytes, st);
}
/* The same copy, run beside the other calls (a checkpoint's snapshot while the data plane
 * works on): on the calling thread alone on the host (the workers are the data plane's), on
 * a stream of its own on a GPU. */
static inline int fsdp_backend_copy_beside(const fsdp_backend_t *b, void *dst, const void *src,
                                           size_t bytes, fsdp_status_t *st) {
  return b->ops->copy_beside(b, dst, src, bytes, st);
}

/* Whether a trainer orders the daemon after its device's work by events (a GPU's jobs). */
static inline bool fsdp_backend_has_events(const fsdp_backend_t *b) {
  return b->ops->event_new != NULL;
}
/* A new event in *ret, with the handle another process opens it by (64 bytes, a
 * cudaIpcEventHandle_t); undone by fsdp_backend_event_free, NULL-safe. Loop thread. */
static inline int fsdp_backend_event_new(const fsdp_backend_t *b, fsdp_backend_event_t **ret,
                                         unsigned char handle[64], fsdp_status_t *st) {
  if (!b->ops->event_new)
    return fsdp_status_set(st, FSDP_E_INTERNAL, "the %s backend has no events", b->ops->name);
  return b->ops->event_new(b, ret, handle, st);
}
static inline void fsdp_backend_event_free(const fsdp_backend_t *b, fsdp_backend_event_t *event) {
  if (event)
    b->ops->event_free(b, event);
}
/* Every operation called after this, fsdp_backend_copy_beside's included, runs after the
 * event's latest record (fsdp_backend_zero's excepted: it is for memory nothing uses yet);
 * the calling thread does not wait. Loop thread: the data plane's work that follows in the
 * trainer's order starts later. */
static inline int fsdp_backend_wait_event(const fsdp_backend_t *b, fsdp_backend_event_t *event,
                                          fsdp_status_t *st) {
  return b->ops->wait_event(b, event, st);
}
#endif
