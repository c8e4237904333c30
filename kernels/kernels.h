/* Copy/cast and L-way reduce kernels: the daemon's local data plane.
 *
 * Unshard gathers fp32 master shards into the unsharded buffer in param_dtype
 * (fsdp_cast); reduce-scatter sums the L local ranks' full gradients in reduce_dtype, scales
 * them and writes or accumulates each rank's fp32 gradient shard (fsdp_reduce). Both run
 * near memory bandwidth: the loops are written so the compiler vectorizes them, and they are
 * compiled for several instruction sets (SSE2, AVX2, AVX-512) with one chosen at load time,
 * so a single binary runs on any x86-64. fsdp_workers_t (workers.h) splits them across
 * threads.
 *
 * Numbers. bf16 and fp16 values are IEEE bit patterns held in uint16_t. Results are
 * bit-exact and the same on every instruction set. Conversions round to nearest, ties to
 * even; a value that rounds past the largest finite value of the target becomes Inf (fp16
 * from 65520 up); subnormals of both 16-bit types are converted exactly both ways; Inf
 * stays Inf; every NaN a cast produces is quiet and keeps the top bits of its payload.
 * (This assumes the default floating-point environment, round to nearest without
 * flush-to-zero; a caller that changes MXCSR gets what it asked for.)
 *
 * Threads and memory. The functions keep no state; any thread may call them at any time on
 * buffers it owns for the duration of the call. They never allocate and never fail on valid
 * input; the only errors are -EINVAL for a bad argument (an unknown dtype, no sources, a
 * scale that is not finite, a NULL buffer with n > 0), and arguments are checked before any
 * memory is touched. */
#ifndef FSDP_KERNELS_H
#define FSDP_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/dtype.h"


/* True for the three values above; anything else (an int cast from a request) is false. */
bool fsdp_dtype_is_valid(fsdp_dtype_t type);

/* Bytes per element (4 or 2); 0 for an invalid dtype. */
size_t fsdp_dtype_size(fsdp_dtype_t type);

/* "fp32", "bf16", "fp16"; "invalid" for anything else. Static strings. */
const char *fsdp_dtype_name(fsdp_dtype_t type);

/* Parses a name as printed by fsdp_dtype_name (exact, lower case). Returns 0 and sets
 * *ret_type, or -EINVAL. */
int fsdp_dtype_parse(const char *name, fsdp_dtype_t *ret_type);

/* Converts n elements from src (src_type) to dst (dst_type); all nine pairs. Same type is a
 * plain copy (bits unchanged, NaNs included). dst and src must not overlap unless they are
 * the same pointer with the same type. Buffers need no alignment, not even that of their
 * element type (64-byte alignment is fastest). Returns 0, or -EINVAL for a bad dtype or a
 * NULL buffer with n > 0. */
int fsdp_cast(void *dst, fsdp_dtype_t dst_type, const void *src, fsdp_dtype_t src_type, size_t n);

/* The local step of a reduce-scatter: sums n elements of n_srcs (>= 1, no upper limit)
 * buffers of src_type into the fp32 buffer dst, emulating arithmetic in reduce_type the way
 * NCCL performs it. For each element i:
 *
 *   v_k   = R(R(srcs[k][i]) * pre_scale)          for k = 0 .. n_srcs-1
 *   sum   = v_0, then sum = R(sum + v_k)          in order k = 1, 2, ...
 *   out   = R(sum * post_scale)
 *   dst[i] = accumulate ? dst[i] + out : out      (this addition in fp32)
 *
 * where R rounds an fp32 value to reduce_type (to nearest even; a no-op for fp32) and each
 * product and sum is computed in fp32 before R. For bf16 and fp16 operands fp32 holds the
 * exact sum or rounds it so that R of it is the correctly rounded reduce_type sum (24 >=
 * 2p+2 bits), so this is summing in reduce_type. A 16-bit reduce skips a scale of exactly 1,
 * which changes nothing (x * 1 is exact). Averaging over a group of N is pre_scale *
 * post_scale = 1/N, split as the caller wants; both must be finite. Overflow gives Inf as
 * the arithmetic would; a NaN input or Inf - Inf gives a NaN, but which NaN (payload, quiet
 * or not for a lone signaling NaN passed through unscaled) is unspecified.
 *
 * dst is read even when not accumulating (its old contents are then ignored, whatever they
 * are): it must be readable memory. dst may be the same pointer as an fp32 source (in
 * place); otherwise dst must not overlap any source. Sources may repeat and overlap each
 * other. No alignment is needed. Returns 0, or -EINVAL for a bad dtype, n_srcs == 0, a
 * scale that is not finite, or a NULL pointer with n > 0. */
int fsdp_reduce(float *dst, bool accumulate, const void *const *srcs, unsigned n_srcs,
                fsdp_dtype_t src_type, fsdp_dtype_t reduce_type, float pre_scale,
                float post_scale, size_t n);

/* fsdp_reduce on elements [begin, end) of the same buffers (dst[begin..end) from every
 * srcs[k][begin..end)), for a caller that splits one reduce into pieces: no offset copy of
 * the source array is needed. Also -EINVAL for begin > end. */
int fsdp_reduce_range(float *dst, bool accumulate, const void *const *srcs, unsigned n_srcs,
                      fsdp_dtype_t src_type, fsdp_dtype_t reduce_type, float pre_scale,
                      float post_scale, size_t begin, size_t end);

/* In-place elementwise sum in one dtype: dst[i] = R(dst[i] + src[i]) for n elements, where
 * the addition is done in fp32 and R rounds to `type` (to nearest even). For bf16 and fp16
 * this is the correctly rounded sum in that type (see fsdp_reduce), so a sum built by
 * repeated calls is the sum a peer computing in `type` gets, in the same order. This is the
 * reduce step of a ring reduce-scatter between hosts, where each hop adds one partial sum
 * to the local contribution. Overflow gives Inf; a NaN operand or Inf - Inf gives a NaN
 * (which one is unspecified). dst and src must be the same pointer or not overlap; no
 * alignment is needed. Returns 0, or -EINVAL for a bad dtype or a NULL buffer with n > 0. */
int fsdp_add(void *dst, const void *src, fsdp_dtype_t type, size_t n);

#endif
