/* The CUDA module's NCCL communicators and collectives (cuda/nccl.c), which module.c puts in
 * its table (cuda/module.h says what each does) where NCCL was found at build time; the
 * communicator's type is the table's. stream: a cudaStream_t. */
#ifndef FSDP_CUDA_NCCL_H
#define FSDP_CUDA_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/dtype.h"

/* An NCCL communicator: this process's rank of it on one GPU. */
typedef struct fsdp_cuda_comm fsdp_cuda_comm_t;
#define FSDP_CUDA_NCCL_ID_BYTES 128 /* an ncclUniqueId, carried to the other ranks */

int fsdp_cuda_nccl_id(unsigned char id[FSDP_CUDA_NCCL_ID_BYTES], fsdp_status_t *st);
int fsdp_cuda_comm_new(int ordinal, int nranks, int rank,
                       const unsigned char id[FSDP_CUDA_NCCL_ID_BYTES], int64_t deadline_ms,
                       fsdp_cuda_comm_t **ret, fsdp_status_t *st);
void fsdp_cuda_comm_free(fsdp_cuda_comm_t *comm);
int fsdp_cuda_all_gather(fsdp_cuda_comm_t *comm, void *stream, const void *send, void *recv,
                         size_t count, fsdp_dtype_t type, int64_t deadline_ms,
                         fsdp_status_t *st);
int fsdp_cuda_reduce_scatter(fsdp_cuda_comm_t *comm, void *stream, const void *send,
                             void *recv, size_t count, fsdp_dtype_t type, float pre_scale,
                             int64_t deadline_ms, fsdp_status_t *st);
int fsdp_cuda_all_reduce(fsdp_cuda_comm_t *comm, void *stream, const void *send, void *recv,
                         size_t count, fsdp_dtype_t type, float pre_scale, int64_t deadline_ms,
                         fsdp_status_t *st);

#endif
