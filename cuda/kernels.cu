/* Cast and reduce on the GPU, element for element the host kernels' arithmetic
 * (kernels/kernels.c): the conversions and R come from kernels/elements.h, products and sums
 * are __fmul_rn/__fadd_rn (never contracted into an FMA), and the order of the sources'
 * sum is the host's. Each thread handles elements of a grid-stride loop; the loads and
 * stores of neighbouring threads are neighbouring elements, so they coalesce. */
#include "cuda/kernels.h"

#include <errno.h>
#include <math.h>

#include "kernels/elements.h"

namespace {

constexpr unsigned kThreads = 256;

/* Enough blocks to fill any current GPU several times over; the grid-stride loop covers the
 * rest. */
unsigned blocks_for(size_t n) {
  size_t blocks = (n + kThreads - 1) / kThreads;
  return blocks < 65535 ? (unsigned)blocks : 65535u;
}

struct sources {
  const void *p[FSDP_CUDA_REDUCE_SOURCES_MAX];
};

__device__ float load_as_float(const void *p, size_t k, fsdp_dtype_t t) {
  switch (t) {
  case FSDP_DTYPE_BF16:
    return fsdp_float_of(fsdp_bf16_to_fp32(static_cast<const uint16_t *>(p)[k]));
  case FSDP_DTYPE_FP16:
    return fsdp_float_of(fsdp_fp16_to_fp32(static_cast<const uint16_t *>(p)[k]));
  case FSDP_DTYPE_FP32:
    break;
  }
  return static_cast<const float *>(p)[k];
}

__device__ void store_from_float(void *p, size_t k, fsdp_dtype_t t, float x) {
  uint32_t u = fsdp_bits_of(x);
  switch (t) {
  case FSDP_DTYPE_BF16:
    static_cast<uint16_t *>(p)[k] = fsdp_fp32_to_bf16(u);
    return;
  case FSDP_DTYPE_FP16:
    static_cast<uint16_t *>(p)[k] = fsdp_fp32_to_fp16(u);
    return;
  case FSDP_DTYPE_FP32:
    break;
  }
  static_cast<uint32_t *>(p)[k] = u;
}

/* Every pair of types goes through fp32: widening is exact, so there is one rounding. */
__global__ void cast_kernel(void *dst, fsdp_dtype_t dt, const void *src, fsdp_dtype_t st,
                            size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    store_from_float(dst, i, dt, load_as_float(src, i, st));
}

/* v = R(R(src[k]) * pre), as the host's source_value. A bf16 source is widened without the
 * NaN select, as there: the arithmetic after it decides which NaN comes out. */
__device__ float source_value(const void *src, size_t k, fsdp_dtype_t st, fsdp_dtype_t rt,
                              bool scale, float pre) {
  float x = st == FSDP_DTYPE_BF16
                ? fsdp_float_of((uint32_t) static_cast<const uint16_t *>(src)[k] << 16)
                : load_as_float(src, k, st);
  if (rt != FSDP_DTYPE_FP32 && rt != st)
    x = fsdp_round_to(x, rt, false);
  if (scale)
    x = fsdp_round_to(__fmul_rn(x, pre), rt, true);
  return x;
}

__global__ void reduce_kernel(float *dst, bool accumulate, sources srcs, unsigned n_srcs,
                              fsdp_dtype_t st, fsdp_dtype_t rt, bool scale_pre, float pre,
                              bool scale_post, float post, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float sum = source_value(srcs.p[0], i, st, rt, scale_pre, pre);
    for (unsigned k = 1; k < n_srcs; k++)
      sum = fsdp_round_to(__fadd_rn(sum, source_value(srcs.p[k], i, st, rt, scale_pre, pre)),
                          rt, true);
    float out = scale_post ? fsdp_round_to(__fmul_rn(sum, post), rt, true) : sum;
    /* The host adds to -0.0 when not accumulating, which leaves every value as it is. */
    dst[i] = __fadd_rn(accumulate ? dst[i] : -0.0f, out);
  }
}

bool valid(fsdp_dtype_t t) {
  return t == FSDP_DTYPE_FP32 || t == FSDP_DTYPE_BF16 || t == FSDP_DTYPE_FP16;
}

size_t size_of(fsdp_dtype_t t) {
  return t == FSDP_DTYPE_FP32 ? 4 : 2;
}

int launched(const char *what, fsdp_status_t *st) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess)
    return 0;
  return fsdp_status_set(st, FSDP_E_INTERNAL, "%s: %s (%s)", what, cudaGetErrorString(e),
                         cudaGetErrorName(e));
}

} // namespace

int fsdp_cuda_cast(void *dst, fsdp_dtype_t dst_type, const void *src, fsdp_dtype_t src_type,
                   size_t n, cudaStream_t stream, fsdp_status_t *st) {
  if (!valid(dst_type) || !valid(src_type) || (n > 0 && (!dst || !src)))
    return fsdp_status_set(st, -EINVAL, "cast: invalid dtype or buffer");
  if (n == 0 || (dst == src && dst_type == src_type))
    return 0;
  if (dst_type == src_type) {
    cudaError_t e = cudaMemcpyAsync(dst, src, n * size_of(src_type), cudaMemcpyDefault, stream);
    return e == cudaSuccess ? 0
                            : fsdp_status_set(st, FSDP_E_INTERNAL, "cast: copy: %s (%s)",
                                              cudaGetErrorString(e), cudaGetErrorName(e));
  }
  cast_kernel<<<blocks_for(n), kThreads, 0, stream>>>(dst, dst_type, src, src_type, n);
  return launched("cast", st);
}

int fsdp_cuda_reduce(float *dst, bool accumulate, const void *const *srcs, unsigned n_srcs,
                     fsdp_dtype_t src_type, fsdp_dtype_t reduce_type, float pre_scale,
                     float post_scale, size_t n, cudaStream_t stream, fsdp_status_t *st) {
  if (!valid(src_type) || !valid(reduce_type) || n_srcs == 0 ||
      n_srcs > FSDP_CUDA_REDUCE_SOURCES_MAX || !isfinite(pre_scale) || !isfinite(post_scale))
    return fsdp_status_set(st, -EINVAL, "reduce: invalid dtype, source count %u or scale",
                           n_srcs);
  if (n == 0)
    return 0;
  sources s = {};
  for (unsigned k = 0; k < n_srcs; k++)
    if (!(s.p[k] = srcs ? srcs[k] : nullptr))
      return fsdp_status_set(st, -EINVAL, "reduce: source %u is NULL", k);
  if (!dst)
    return fsdp_status_set(st, -EINVAL, "reduce: the destination is NULL");
  /* As the host: a 16-bit reduce skips a scale of exactly 1 (x * 1 is exact), fp32 always
   * multiplies. */
  bool fp32 = reduce_type == FSDP_DTYPE_FP32;
  reduce_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      dst, accumulate, s, n_srcs, src_type, reduce_type, fp32 || pre_scale != 1.0f, pre_scale,
      fp32 || post_scale != 1.0f, post_scale, n);
  return launched("reduce", st);
}
