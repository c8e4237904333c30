/* The CUDA backend module's interface: what fsdpd finds in fsdp-cuda.so once it loads it.
 *
 * Why a module: the CUDA runtime and NCCL are shared libraries a host without GPUs may not
 * have, and a binary linked with them does not start there. fsdpd links neither; with
 * `backend = cuda` it loads the module (cuda/loader.h), which links them, and a host
 * without them gets an exit naming the library it lacks instead of a binary that does not
 * start. Both sides compile this header; `version` tells a module built from other sources
 * (FSDP_CUDA_MODULE_VERSION). */
#ifndef FSDP_CUDA_MODULE_H
#define FSDP_CUDA_MODULE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define FSDP_CUDA_MODULE_VERSION 1u
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

typedef struct fsdp_cuda_module {
  uint32_t version; /* FSDP_CUDA_MODULE_VERSION */
  /* The runtime's and driver's versions, "13.0 (driver 12.8)"-like, for logs. */
  void (*versions)(char *buf, size_t size);
  /* The GPUs this process sees, at most `max`, in *ret_n (0 and OK when the runtime works
   * but there are none). Fails, with st naming the CUDA call and its error, when the runtime
   * cannot count them (no driver, a driver older than the runtime). */
  int (*probe)(fsdp_cuda_device_t *devices, unsigned max, unsigned *ret_n, fsdp_status_t *st);
} fsdp_cuda_module_t;

/* The module's one exported symbol (FSDP_CUDA_MODULE_SYMBOL). */
const fsdp_cuda_module_t *fsdp_cuda_module(void);

#endif
