/* The CUDA backend: one GPU's memory, exported to trainers, and the CUDA module's kernels
 * queued on the daemon's stream and waited for (cuda/module.h). Apart from backend.h so that
 * the interface names no CUDA type. */
#ifndef FSDP_CUDA_BACKEND_H
#define FSDP_CUDA_BACKEND_H

#include "common/status.h"
#include "cuda/module.h"
#include "daemon/backend/backend.h"

/* The CUDA backend on `device` (one the loader found usable), through `cuda` (borrowed: it
 * outlives the backend). Fails naming the GPU, and leaves *b as it was. */
int fsdp_backend_init_cuda(fsdp_backend_t *b, const fsdp_cuda_module_t *cuda,
                           const fsdp_cuda_device_t *device, fsdp_status_t *st);

#endif
