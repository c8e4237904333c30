/* The CUDA backend's kernels: device twins of fsdp_cast and fsdp_reduce (kernels/kernels.h)
 * and of the optimizers' step (kernels/optim.h), and a sum of squares (a gradient's norm).
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
#include "kernels/optim_elements.h"

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

/* One optimizer step over n elements (kernels/optim.h's fsdp_optim_run, whose bits it
 * gives): state as there, the arrays the step's rule and flags use non-NULL. */
int fsdp_cuda_optim_step(const fsdp_optim_step_t *step, float *p, float *g,
                         float *const state[3], size_t n, cudaStream_t stream,
                         fsdp_status_t *st);

/* The sum of x[i]^2 over n elements, in double, into partials[FSDP_CUDA_SUM_PARTIALS]
 * (device memory of FSDP_CUDA_SUM_PARTIALS + 1 doubles, the blocks' parts before it); the
 * same bits on every run, not the host's sequential sum's. */
#define FSDP_CUDA_SUM_PARTIALS 1024
int fsdp_cuda_sum_squares(const float *x, size_t n, double *partials, cudaStream_t stream,
                          fsdp_status_t *st);

#ifdef __cplusplus
}
#endif

#endif
