/* The CUDA backend module's interface: what fsdpd finds in fsdp-cuda.so once it loads it.
 *
 * Why a module: the CUDA runtime is a shared library a host without GPUs may not have, and
 * a binary linked with it does not start there. fsdpd does not link it; with
 * `backend = cuda` it loads the module (cuda/loader.h), which does, and a host
 * without them gets an exit naming the library it lacks instead of a binary that does not
 * start. Both sides compile this header; `version` tells a module built from other sources
 * (FSDP_CUDA_MODULE_VERSION). */
#ifndef FSDP_CUDA_MODULE_H
#define FSDP_CUDA_MODULE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "cuda/nccl.h"
#include "kernels/dtype.h"
#include "kernels/optim_elements.h"

#define FSDP_CUDA_MODULE_VERSION 7u
#define FSDP_CUDA_MODULE_SYMBOL "fsdp_cuda_module"
#define FSDP_CUDA_DEVICES_MAX 16

/* What the backend needs of a GPU: memory it can export to trainers as file descriptors
 * (the driver's virtual memory management), and events trainers' streams can wait on. */
typedef struct fsdp_cuda_device {
  int ordinal;
  char name[256];
  size_t memory_bytes;
  int major, minor; /* compute capability */
  bool virtual_memory; /* cuMemCreate / cuMemMap */
  bool fd_export;      /* cuMemExportToShareableHandle to a POSIX file descriptor */
  bool ipc_events;     /* a trainer's stream can wait on the daemon's events */
} fsdp_cuda_device_t;

/* Device memory trainers can map: one physical allocation (cuMemCreate) made for export as
 * a POSIX file descriptor, mapped read-write into the daemon's address space, zeroed once.
 * Its size is a whole number of the GPU's allocation granularity (`page`). */
typedef struct fsdp_cuda_memory {
  int ordinal;
  void *base;   /* the daemon's mapping, a device address */
  size_t bytes; /* a multiple of page */
  size_t page;  /* the allocation granularity: a trainer maps whole memories */
  int fd;       /* the exported descriptor, owned: send it, the receiver imports it */
  unsigned long long handle; /* the driver's allocation handle */
} fsdp_cuda_memory_t;

/* A stream of the daemon's own on one GPU: the backend's work is queued there and waited
 * for with `synchronize`, on the thread that queued it. */
typedef struct fsdp_cuda_stream fsdp_cuda_stream_t;

/* An event another process can record (a CUDA IPC event: interprocess, no timing), which
 * the daemon's streams wait on. */
typedef struct fsdp_cuda_event fsdp_cuda_event_t;

typedef struct fsdp_cuda_module {
  uint32_t version; /* FSDP_CUDA_MODULE_VERSION */
  /* The runtime's and driver's versions, "13.0 (driver 12.8)"-like, for logs. */
  void (*versions)(char *buf, size_t size);
  /* The GPUs this process sees, at most `max`, in *ret_n (0 and OK when the runtime works
   * but there are none). Fails, with st naming the CUDA call and its error, when the runtime
   * cannot count them (no driver, a driver older than the runtime). */
  int (*probe)(fsdp_cuda_device_t *devices, unsigned max, unsigned *ret_n, fsdp_status_t *st);

  /* At least `bytes` of memory on GPU `ordinal`, in *ret (the caller's storage); undone with
   * memory_free, which unmaps the daemon's view and closes the descriptor (a trainer that
   * imported it keeps the memory until it lets go). */
  int (*memory_new)(int ordinal, size_t bytes, fsdp_cuda_memory_t *ret, fsdp_status_t *st);
  void (*memory_free)(fsdp_cuda_memory_t *memory);

  /* Pinned host memory (page-locked, known to every GPU): what the rings among hosts move,
   * staged there, copied to and from a GPU at the link's speed. */
  int (*host_new)(size_t bytes, void **ret, fsdp_status_t *st);
  void (*host_free)(void *memory); /* NULL-safe */

  int (*stream_new)(int ordinal, fsdp_cuda_stream_t **ret, fsdp_status_t *st);
  void (*stream_free)(fsdp_cuda_stream_t *stream); /* NULL-safe */
  /* Queued on the stream; the same contracts as cuda/kernels.h. */
  int (*cast)(fsdp_cuda_stream_t *stream, void *dst, fsdp_dtype_t dst_type, const void *src,
              fsdp_dtype_t src_type, size_t n, fsdp_status_t *st);
  int (*reduce)(fsdp_cuda_stream_t *stream, float *dst, bool accumulate,
                const void *const *srcs, unsigned n_srcs, fsdp_dtype_t src_type,
                fsdp_dtype_t reduce_type, float pre_scale, float post_scale, size_t n,
                fsdp_status_t *st);
  /* One optimizer step of n elements (cuda/kernels.h). */
  int (*optim_step)(fsdp_cuda_stream_t *stream, const fsdp_optim_step_t *step, float *p,
                    float *g, float *const state[3], size_t n, fsdp_status_t *st);
  /* The sum of the squares of n fp32 elements, in double, in *ret: waits for the stream. */
  int (*sum_squares)(fsdp_cuda_stream_t *stream, const float *x, size_t n, double *ret,
                     fsdp_status_t *st);
  /* Zeroes bytes of GPU `ordinal`'s memory and waits for it, on no stream of the daemon's
   * (memory just allocated, which nothing else uses yet). */
  int (*zero)(int ordinal, void *dst, size_t bytes, fsdp_status_t *st);
  /* bytes from src to dst, each in the GPU's memory or the host's (unified addressing tells
   * which). */
  int (*copy)(fsdp_cuda_stream_t *stream, void *dst, const void *src, size_t bytes,
              fsdp_status_t *st);
  /* Waits until everything queued on the stream has run; its error is the first that any of
   * that work met. */
  int (*synchronize)(fsdp_cuda_stream_t *stream, fsdp_status_t *st);

  /* A new IPC event on GPU `ordinal` in *ret, its handle (cudaIpcEventHandle_t) in
   * `handle` for another process to open (cudaIpcOpenEventHandle) and record. */
  int (*event_new)(int ordinal, fsdp_cuda_event_t **ret, unsigned char handle[64],
                   fsdp_status_t *st);
  void (*event_free)(fsdp_cuda_event_t *event); /* NULL-safe */
  /* Work queued on the stream from now on waits for the event's latest record, whichever
   * process recorded it; the host thread does not wait. */
  int (*stream_wait)(fsdp_cuda_stream_t *stream, fsdp_cuda_event_t *event, fsdp_status_t *st);

  /* NCCL, where the module was built with it (every pointer below NULL otherwise). Each
   * communicator is non-blocking and every call takes a deadline (fsdp_clock_now_ms's
   * clock): past it the communicator is aborted and the call fails with DEADLINE_EXCEEDED,
   * so a rank that never joins ends the wait; an aborted communicator only frees.
   * A new communicator's id, made by one rank and carried to the others. */
  int (*nccl_id)(unsigned char id[FSDP_CUDA_NCCL_ID_BYTES], fsdp_status_t *st);
  /* Rank `rank` of `nranks` on GPU `ordinal` of the communicator `id` names, once every
   * rank joined. */
  int (*comm_new)(int ordinal, int nranks, int rank,
                  const unsigned char id[FSDP_CUDA_NCCL_ID_BYTES], int64_t deadline_ms,
                  fsdp_cuda_comm_t **ret, fsdp_status_t *st);
  void (*comm_free)(fsdp_cuda_comm_t *comm); /* NULL-safe */
  /* Collectives queued on the stream and waited for: count elements from each rank into
   * recv (count x nranks); each rank's count-element part of the sum of every rank's send
   * (count x nranks) times pre_scale; all of that sum, count elements. The reductions are
   * of fp32. */
  int (*all_gather)(fsdp_cuda_comm_t *comm, fsdp_cuda_stream_t *stream, const void *send,
                    void *recv, size_t count, fsdp_dtype_t type, int64_t deadline_ms,
                    fsdp_status_t *st);
  int (*reduce_scatter)(fsdp_cuda_comm_t *comm, fsdp_cuda_stream_t *stream, const void *send,
                        void *recv, size_t count, fsdp_dtype_t type, float pre_scale,
                        int64_t deadline_ms, fsdp_status_t *st);
  int (*all_reduce)(fsdp_cuda_comm_t *comm, fsdp_cuda_stream_t *stream, const void *send,
                    void *recv, size_t count, fsdp_dtype_t type, float pre_scale,
                    int64_t deadline_ms, fsdp_status_t *st);
} fsdp_cuda_module_t;

/* The module's one exported symbol (FSDP_CUDA_MODULE_SYMBOL). */
const fsdp_cuda_module_t *fsdp_cuda_module(void);

#endif
