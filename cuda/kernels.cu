/* Cast and reduce on the GPU, element for element the host kernels' arithmetic
 * (kernels/kernels.c): the conversions and R come from kernels/elements.h, products and sums
 * are __fmul_rn/__fadd_rn (never contracted into an FMA), and the order of the sources'
 * sum is the host's. Each thread handles groups of four elements of a grid-stride loop by
 * 16- or 8-byte accesses where the buffers' alignment allows (one element at a time ran at
 * 0.75 of a device-to-device copy's bandwidth on an H100), neighbouring threads neighbouring
 * groups, so that the accesses coalesce. */
#include "cuda/kernels.h"

#include <errno.h>
#include <math.h>

#include "kernels/elements.h"
#include "kernels/optim_elements.h"

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kVec = 4; /* elements per vector access */

/* Enough blocks to fill any current GPU several times over; the grid-stride loop covers the
 * rest. */
unsigned blocks_for(size_t n) {
  size_t blocks = (n + kThreads - 1) / kThreads;
  return blocks < 65535 ? (unsigned)blocks : 65535u;
}

struct sources {
  const void *p[FSDP_CUDA_REDUCE_SOURCES_MAX];
};

/* Elements travel as their bits (a 16-bit type's in the low half) between the loads and
 * stores and the arithmetic. */
__device__ uint32_t load_bits(const void *p, size_t k, fsdp_dtype_t t) {
  return t == FSDP_DTYPE_FP32 ? static_cast<const uint32_t *>(p)[k]
                              : static_cast<const uint16_t *>(p)[k];
}

__device__ void store_bits(void *p, size_t k, fsdp_dtype_t t, uint32_t bits) {
  if (t == FSDP_DTYPE_FP32)
    static_cast<uint32_t *>(p)[k] = bits;
  else
    static_cast<uint16_t *>(p)[k] = static_cast<uint16_t>(bits);
}

/* Group g of kVec elements in one 16-byte (fp32) or 8-byte (16-bit) access, which the caller
 * checked the buffer's alignment allows. */
__device__ void load_bits4(const void *p, size_t g, fsdp_dtype_t t, uint32_t b[kVec]) {
  if (t == FSDP_DTYPE_FP32) {
    uint4 v = static_cast<const uint4 *>(p)[g];
    b[0] = v.x, b[1] = v.y, b[2] = v.z, b[3] = v.w;
  } else {
    uint2 v = static_cast<const uint2 *>(p)[g];
    b[0] = v.x & 0xffffu, b[1] = v.x >> 16, b[2] = v.y & 0xffffu, b[3] = v.y >> 16;
  }
}

__device__ void store_bits4(void *p, size_t g, fsdp_dtype_t t, const uint32_t b[kVec]) {
  if (t == FSDP_DTYPE_FP32)
    static_cast<uint4 *>(p)[g] = make_uint4(b[0], b[1], b[2], b[3]);
  else
    static_cast<uint2 *>(p)[g] = make_uint2(b[0] | b[1] << 16, b[2] | b[3] << 16);
}

__device__ float widen(uint32_t bits, fsdp_dtype_t t) {
  switch (t) {
  case FSDP_DTYPE_BF16:
    return fsdp_float_of(fsdp_bf16_to_fp32(static_cast<uint16_t>(bits)));
  case FSDP_DTYPE_FP16:
    return fsdp_float_of(fsdp_fp16_to_fp32(static_cast<uint16_t>(bits)));
  case FSDP_DTYPE_FP32:
    break;
  }
  return fsdp_float_of(bits);
}

__device__ uint32_t narrow(float x, fsdp_dtype_t t) {
  uint32_t u = fsdp_bits_of(x);
  switch (t) {
  case FSDP_DTYPE_BF16:
    return fsdp_fp32_to_bf16(u);
  case FSDP_DTYPE_FP16:
    return fsdp_fp32_to_fp16(u);
  case FSDP_DTYPE_FP32:
    break;
  }
  return u;
}

/* The first and step of this thread's grid-stride loops. */
__device__ size_t first_index() {
  return blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
}

__device__ size_t grid_stride() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

/* Every pair of types goes through fp32: widening is exact, so there is one rounding. The
 * first `groups` groups of kVec elements go by vector accesses, the rest one by one. */
__global__ void cast_kernel(void *dst, fsdp_dtype_t dt, const void *src, fsdp_dtype_t st,
                            size_t groups, size_t n) {
  for (size_t g = first_index(); g < groups; g += grid_stride()) {
    uint32_t b[kVec];
    load_bits4(src, g, st, b);
    for (unsigned k = 0; k < kVec; k++)
      b[k] = narrow(widen(b[k], st), dt);
    store_bits4(dst, g, dt, b);
  }
  for (size_t i = groups * kVec + first_index(); i < n; i += grid_stride())
    store_bits(dst, i, dt, narrow(widen(load_bits(src, i, st), st), dt));
}

/* R of an arithmetic result. Not the host's `clean` shortcut: a GPU's NaN result is the
 * canonical 0x7fffffff, whose payload bits below bf16's mantissa would carry the rounding out
 * of the NaN (into -0.0), so the NaN select always runs. */
__device__ float round_result(float x, fsdp_dtype_t rt) {
  return fsdp_round_to(x, rt, false);
}

/* v = R(R(src[k]) * pre), as the host's source_value. A bf16 source is widened without the
 * NaN select, as there: the arithmetic after it decides which NaN comes out. */
__device__ float source_value(uint32_t bits, fsdp_dtype_t st, fsdp_dtype_t rt, bool scale,
                              float pre) {
  float x = st == FSDP_DTYPE_BF16 ? fsdp_float_of(bits << 16) : widen(bits, st);
  if (rt != FSDP_DTYPE_FP32 && rt != st)
    x = fsdp_round_to(x, rt, false);
  if (scale)
    x = round_result(__fmul_rn(x, pre), rt);
  return x;
}

struct reduce_args {
  float *dst;
  bool accumulate;
  sources srcs;
  unsigned n_srcs;
  fsdp_dtype_t st, rt;
  bool scale_pre, scale_post;
  float pre, post;
};

/* sum <- sum + v, in source order (the first source's value is the sum). */
__device__ float summed(const reduce_args &a, unsigned k, float sum, uint32_t bits) {
  float v = source_value(bits, a.st, a.rt, a.scale_pre, a.pre);
  return k == 0 ? v : round_result(__fadd_rn(sum, v), a.rt);
}

/* The post-scale, then the store's addition: the host adds to -0.0 when not accumulating,
 * which leaves every value as it is. */
__device__ float stored(const reduce_args &a, float old, float sum) {
  float out = a.scale_post ? round_result(__fmul_rn(sum, a.post), a.rt) : sum;
  return __fadd_rn(a.accumulate ? old : -0.0f, out);
}

/* Groups of kVec elements by vector accesses, a source at a time into kVec running sums, as
 * cast_kernel. */
__global__ void reduce_kernel(reduce_args a, size_t groups, size_t n) {
  for (size_t g = first_index(); g < groups; g += grid_stride()) {
    float sum[kVec] = {};
    for (unsigned k = 0; k < a.n_srcs; k++) {
      uint32_t b[kVec];
      load_bits4(a.srcs.p[k], g, a.st, b);
      for (unsigned e = 0; e < kVec; e++)
        sum[e] = summed(a, k, sum[e], b[e]);
    }
    float4 old = a.accumulate ? reinterpret_cast<const float4 *>(a.dst)[g] : float4{};
    reinterpret_cast<float4 *>(a.dst)[g] =
        make_float4(stored(a, old.x, sum[0]), stored(a, old.y, sum[1]), stored(a, old.z, sum[2]),
                    stored(a, old.w, sum[3]));
  }
  for (size_t i = groups * kVec + first_index(); i < n; i += grid_stride()) {
    float sum = 0.0f;
    for (unsigned k = 0; k < a.n_srcs; k++)
      sum = summed(a, k, sum, load_bits(a.srcs.p[k], i, a.st));
    a.dst[i] = stored(a, a.dst[i], sum);
  }
}

bool valid(fsdp_dtype_t t) {
  return t == FSDP_DTYPE_FP32 || t == FSDP_DTYPE_BF16 || t == FSDP_DTYPE_FP16;
}

size_t size_of(fsdp_dtype_t t) {
  return t == FSDP_DTYPE_FP32 ? 4 : 2;
}

/* Whether a buffer of type t allows kVec-element vector accesses. */
bool vectorizable(const void *p, fsdp_dtype_t t) {
  return reinterpret_cast<uintptr_t>(p) % (kVec * size_of(t)) == 0;
}

int launched(const char *what, fsdp_status_t *st) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess)
    return 0;
  return fsdp_status_set(st, FSDP_E_INTERNAL, "%s: %s (%s)", what, cudaGetErrorString(e),
                         cudaGetErrorName(e));
}

/* One optimizer step, element for element kernels/optim_elements.h's (the host's loops run
 * the same functions). The flags are the same for every thread, so the branches on them
 * cost nothing. */
__global__ void optim_kernel(fsdp_optim_step_t s, float *p, float *g, float *s0, float *s1,
                             float *s2, size_t n) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (s.rule == FSDP_OPTIM_RULE_SGD)
      fsdp_optim_sgd_element(&s, p, g, s0, i);
    else
      fsdp_optim_adam_element(&s, p, g, s0, s1, s2, i);
  }
}

/* The sum of squares in double, in a fixed order (so every run gives the same bits): each
 * of the kSumBlocks blocks sums its grid-stride elements per thread and then in a tree over
 * its threads into partials[block]; one block then sums the partials the same way. */
constexpr unsigned kSumBlocks = FSDP_CUDA_SUM_PARTIALS;

__device__ double block_sum(double v, double *shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half)
      shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  return shared[0];
}

__global__ void squares_kernel(const float *x, size_t n, double *partials) {
  __shared__ double shared[kThreads];
  double v = 0;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    v += (double)x[i] * x[i];
  double sum = block_sum(v, shared);
  if (threadIdx.x == 0)
    partials[blockIdx.x] = sum;
}

__global__ void partials_kernel(double *partials) {
  __shared__ double shared[kThreads];
  double v = 0;
  for (unsigned i = threadIdx.x; i < kSumBlocks; i += blockDim.x)
    v += partials[i];
  double sum = block_sum(v, shared);
  if (threadIdx.x == 0)
    partials[kSumBlocks] = sum;
}

} // namespace

int fsdp_cuda_optim_step(const fsdp_optim_step_t *step, float *p, float *g,
                         float *const state[3], size_t n, cudaStream_t stream,
                         fsdp_status_t *st) {
  bool sgd = step->rule == FSDP_OPTIM_RULE_SGD;
  if (n > 0 && (!p || !g || (sgd ? step->momentum && !state[0]
                                 : !state[0] || !state[1] || (step->amsgrad && !state[2]))))
    return fsdp_status_set(st, -EINVAL, "optimizer step: a NULL array");
  if (n == 0)
    return 0;
  optim_kernel<<<blocks_for(n), kThreads, 0, stream>>>(*step, p, g, state[0], state[1],
                                                       state[2], n);
  return launched("optimizer step", st);
}

int fsdp_cuda_sum_squares(const float *x, size_t n, double *partials, cudaStream_t stream,
                          fsdp_status_t *st) {
  if ((n > 0 && !x) || !partials)
    return fsdp_status_set(st, -EINVAL, "sum of squares: a NULL buffer");
  squares_kernel<<<kSumBlocks, kThreads, 0, stream>>>(x, n, partials);
  int r = launched("sum of squares", st);
  if (r == 0)
    partials_kernel<<<1, kThreads, 0, stream>>>(partials);
  return r < 0 ? r : launched("sum of squares", st);
}

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
  size_t groups = vectorizable(dst, dst_type) && vectorizable(src, src_type) ? n / kVec : 0;
  cast_kernel<<<blocks_for(groups ? groups : n), kThreads, 0, stream>>>(dst, dst_type, src,
                                                                       src_type, groups, n);
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
  reduce_args a = {dst,         accumulate, s, n_srcs, src_type, reduce_type,
                   fp32 || pre_scale != 1.0f, fp32 || post_scale != 1.0f, pre_scale,
                   post_scale};
  bool vec = vectorizable(dst, FSDP_DTYPE_FP32);
  for (unsigned k = 0; k < n_srcs; k++)
    vec = vec && vectorizable(s.p[k], src_type);
  size_t groups = vec ? n / kVec : 0;
  reduce_kernel<<<blocks_for(groups ? groups : n), kThreads, 0, stream>>>(a, groups, n);
  return launched("reduce", st);
}
