/* The CUDA backend's kernels: device twins of fsdp_cast and fsdp_reduce (kernels/kernels.h).
 *
 * Same contract, same results bit for bit: both compile the element arithmetic of
 * kernels/elements.h, and the device code is built without FMA contraction (--fmad=false)
 * and with IEEE division, square root and denormals, so every product, sum and rounding is
 * the one the host kernel performs. One difference, which kernels.h leaves unspecified: a
 * GPU's arithmetic turns every NaN it computes into the canonical NaN, where the CPU keeps
 * an operand's payload (casts are integer code and give the same NaN bits on both).
 *
 * Buffers are device memory (or memory the device can reach); sources of a reduce are
 * pointers the caller passes by value, at most FSDP_CUDA_REDUCE_SOURCES_MAX. The work is
 * queued on `stream` and the call returns at once; the caller synchronizes. Arguments are
 * checked as the host kernels check them (-EINVAL, nothing queued); a launch the runtime
 * refuses is FSDP_E_INTERNAL with st naming the CUDA error. */
#ifndef FSDP_CUDA_KERNELS_H
#define FSDP_CUDA_KERNELS_H

#include <stdbool.h>
#include <stddef.h>

#include <cuda_runtime_api.h>

#include "common/status.h"
#include "kernels/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A local collective's ranks, at most (a host's GPUs or the trainers sharing one). */
#define FSDP_CUDA_REDUCE_SOURCES_MAX 64

int fsdp_cuda_cast(void *dst, fsdp_dtype_t dst_type, const void *src, fsdp_dtype_t src_type,
                   size_t n, cudaStream_t stream, fsdp_status_t *st);

int fsdp_cuda_reduce(float *dst, bool accumulate, const void *const *srcs, unsigned n_srcs,
                     fsdp_dtype_t src_type, fsdp_dtype_t reduce_type, float pre_scale,
                     float post_scale, size_t n, cudaStream_t stream, fsdp_status_t *st);

#ifdef __cplusplus
}
#endif

#endif
