/* A GPU's memory that the daemon exported (its CUDA backend), as a trainer maps it: imported
 * from the descriptor the memory channel carries, then mapped whole.
 *
 * Through the CUDA driver's virtual memory management, loaded at run time (libcuda.so.1):
 * libfsdp links no CUDA library, so it loads where there is none and only a job on a GPU
 * needs one. Any thread; the driver's calls are thread-safe. Without CUDA at build time
 * every call fails saying so. */
#ifndef FSDP_CLIENT_DEVICE_MEMORY_H
#define FSDP_CLIENT_DEVICE_MEMORY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct fsdp_device_memory {
  int ordinal;
  unsigned long long handle; /* the imported allocation; 0: none */
  size_t bytes;
  size_t page; /* the allocation granularity: offsets and sizes mapped are multiples */
} fsdp_device_memory_t;

/* Imports the `bytes` of GPU `ordinal`'s memory that fd (a POSIX descriptor the driver
 * exported) stands for; fd stays the caller's. */
int fsdp_device_memory_import(int fd, size_t bytes, int ordinal, fsdp_device_memory_t *ret,
                              fsdp_status_t *st);
/* Lets go of the allocation; what is mapped of it stays until unmapped. */
void fsdp_device_memory_release(fsdp_device_memory_t *memory);

/* An address range of the memory's size, nothing mapped there. */
int fsdp_device_reserve(const fsdp_device_memory_t *memory, void **ret, fsdp_status_t *st);
void fsdp_device_unreserve(void *p, size_t bytes); /* NULL-safe; p must be unmapped */

/* Maps the whole memory at p, a range reserved for it, readable by the GPU's kernels and
 * writable when asked (read-only where the driver allows it). The driver maps an imported
 * allocation only whole (cuMemMap's offset must be 0): a part of it cannot be mapped alone. */
int fsdp_device_map(const fsdp_device_memory_t *memory, void *p, bool writable,
                    fsdp_status_t *st);
/* Unmaps it, once the GPU's work has ended (it waits for the device: a kernel of the
 * trainer's may still read there). */
void fsdp_device_unmap(const fsdp_device_memory_t *memory, void *p, size_t bytes);


/* A CUDA IPC event the daemon made (handle: its cudaIpcEventHandle_t), opened in GPU
 * `ordinal`'s primary context, in *ret; closed by fsdp_device_event_close (NULL-safe). */
int fsdp_device_event_open(int ordinal, const uint8_t handle[64], void **ret, fsdp_status_t *st);
/* Records it on `stream` (a CUstream, which is a cudaStream_t; NULL: the legacy default
 * stream): the daemon's streams, told to wait on it, wait for what stream queued before. */
int fsdp_device_event_record(void *event, void *stream, fsdp_status_t *st);
void fsdp_device_event_close(void *event);

#endif
