/* Finding the CUDA backend for `backend = cuda`: loads the module (cuda/module.h) that sits
 * beside this build's fsdpd and lists the GPUs the backend can use.
 *
 * Every way it can fail is a message an operator can act on: this build has no CUDA
 * backend; the module or a library it needs cannot be loaded (the loader's words name the
 * file); the runtime cannot count GPUs (no driver, or one older than the runtime); there
 * are none; or none can do what the backend needs, naming each GPU and what it lacks. */
#ifndef FSDP_CUDA_LOADER_H
#define FSDP_CUDA_LOADER_H

#include "common/status.h"
#include "cuda/module.h"

/* Loads the module once per process (later calls return the same one). */
int fsdp_cuda_load(const fsdp_cuda_module_t **ret_module, fsdp_status_t *st);

/* The GPUs of module that the backend can use, in *ret_n (> 0 on success); fails naming why
 * there are none. */
int fsdp_cuda_usable_devices(const fsdp_cuda_module_t *module, fsdp_cuda_device_t *devices,
                             unsigned max, unsigned *ret_n, fsdp_status_t *st);

/* "GPU 0 (NVIDIA H100 80GB HBM3, 79.6 GiB, compute 9.0)". */
void fsdp_cuda_device_format(const fsdp_cuda_device_t *device, char *buf, size_t size);

#endif
