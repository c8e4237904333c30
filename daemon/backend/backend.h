/* fsdp_backend_t: where a daemon keeps its jobs' memory and what computes on it, one per
 * daemon (`daemon.backend`): host memory and the CPU kernels, or one GPU's memory and its
 * kernels (the CUDA module, cuda/module.h).
 *
 * The data plane and the arenas know only this interface: memory a trainer maps (made once
 * per arena; the host's is the arena's own memfd, see daemon/store/arena.h), host memory
 * for staging, and the operations on the memory (cast, reduce, copy, an optimizer's step,
 * a sum of squares), each complete when its call returns (the GPU's are queued on the
 * daemon's stream and waited for), so a caller on the thread pool holds no handle to wait
 * on and a trainer's next request sees the result. Trainers' streams order themselves after
 * the daemon's work by that reply (the fallback the CUDA backend's design allows where no
 * event is shared).
 *
 * Every call but init/cleanup may run on any thread, but the operations one at a time: the
 * data plane runs one work item at a time. fsdp_backend_copy_beside may run beside them, and
 * so may the calls that make, zero or free memory nothing else uses yet. */
#ifndef FSDP_BACKEND_H
#define FSDP_BACKEND_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"
#include "cuda/module.h"
#include "kernels/dtype.h"
#include "kernels/optim.h"
#include "kernels/workers.h"

typedef enum fsdp_backend_kind {
  FSDP_BACKEND_HOST = 0,
  FSDP_BACKEND_CUDA,
} fsdp_backend_kind_t;

typedef struct fsdp_backend {
  fsdp_backend_kind_t kind;
  fsdp_workers_t *workers; /* the host's kernels split over them; borrowed */
  /* The rings among hosts move host memory: a GPU's jobs stage what they move in host
   * buffers (daemon/store/staging.h). The host backend's jobs stage only where a test asks
   * (the failpoint "stage-rings"), to run that path on a machine without a GPU. */
  bool stages_rings;
  /* CUDA: the module, the GPU (its ordinal and what it is called in messages), the
   * daemon's stream on it, and the stream of the copies beside it. */
  const fsdp_cuda_module_t *cuda;
  fsdp_cuda_device_t device;
  char device_name[320];
  fsdp_cuda_stream_t *stream;
  fsdp_cuda_stream_t *beside_stream;
} fsdp_backend_t;

/* The host backend: the CPU kernels over workers (borrowed). */
void fsdp_backend_init_host(fsdp_backend_t *b, fsdp_workers_t *workers);
/* The CUDA backend on `device` (one the loader found usable); fails naming the GPU. */
int fsdp_backend_init_cuda(fsdp_backend_t *b, const fsdp_cuda_module_t *cuda,
                           const fsdp_cuda_device_t *device, fsdp_status_t *st);
void fsdp_backend_cleanup(fsdp_backend_t *b); /* NULL-safe */

/* "host", or "cuda". */
const char *fsdp_backend_name(const fsdp_backend_t *b);
/* The CUDA device ordinal of its memory, -1 for host memory. */
int fsdp_backend_device(const fsdp_backend_t *b);

/* Device memory for an arena (CUDA only): at least `bytes`, zeroed, with a descriptor for
 * trainers; ret is the caller's storage. */
int fsdp_backend_memory_new(const fsdp_backend_t *b, size_t bytes, fsdp_cuda_memory_t *ret,
                            fsdp_status_t *st);
void fsdp_backend_memory_free(const fsdp_backend_t *b, fsdp_cuda_memory_t *memory);

/* Host memory of at least `bytes` in *ret, for staging (pinned on a GPU); freed by
 * fsdp_backend_host_free, NULL-safe. RESOURCE_EXHAUSTED when there is none. */
int fsdp_backend_host_new(const fsdp_backend_t *b, size_t bytes, void **ret, fsdp_status_t *st);
void fsdp_backend_host_free(const fsdp_backend_t *b, void *memory);

/* kernels/kernels.h's contracts, on the backend's memory. */
int fsdp_backend_cast(const fsdp_backend_t *b, void *dst, fsdp_dtype_t dst_type,
                      const void *src, fsdp_dtype_t src_type, size_t n, fsdp_status_t *st);
int fsdp_backend_reduce(const fsdp_backend_t *b, float *dst, bool accumulate,
                        const void *const *srcs, unsigned n_srcs, fsdp_dtype_t src_type,
                        fsdp_dtype_t reduce_type, float pre_scale, float post_scale, size_t n,
                        fsdp_status_t *st);
/* One optimizer step (kernels/optim.h's fsdp_optim_run, the same bits) over n elements of
 * the backend's memory: split over the workers on the host, one kernel on a GPU. */
int fsdp_backend_optim_step(const fsdp_backend_t *b, const fsdp_optim_step_t *step, float *p,
                            float *g, float *const state[3], size_t n, fsdp_status_t *st);
/* The sum of the squares of n fp32 elements in double, in *ret: in element order on the
 * host, in a GPU's fixed order of its own there (the same on every run, not the host's
 * bits). */
int fsdp_backend_sum_squares(const fsdp_backend_t *b, const float *x, size_t n, double *ret,
                             fsdp_status_t *st);
/* Zeroes new memory of the backend's (a GPU's is waited for on none of the backend's
 * streams: any thread, the loop included, as the memory's own making). */
int fsdp_backend_zero(const fsdp_backend_t *b, void *dst, size_t bytes, fsdp_status_t *st);

/* bytes from src to dst, each the backend's memory or the host's (a checkpoint's staging). */
int fsdp_backend_copy(const fsdp_backend_t *b, void *dst, const void *src, size_t bytes,
                      fsdp_status_t *st);
/* The same copy, run beside the other calls (a checkpoint's snapshot while the data plane
 * works on): on the calling thread alone on the host (the workers are the data plane's), on
 * a stream of its own on a GPU. */
int fsdp_backend_copy_beside(const fsdp_backend_t *b, void *dst, const void *src, size_t bytes,
                             fsdp_status_t *st);
#endif
