/* Cast and reduce kernels. Every conversion is integer and float arithmetic on bit
 * patterns with selects instead of branches, so that GCC and clang vectorize the loops; the
 * two loop drivers are compiled once per instruction-set level (target_clones) and the
 * dynamic loader picks one. Because the code is the same C on every level, the results are
 * the same bits everywhere; hardware conversion instructions are not used because they
 * differ in corner cases (VCVTNEPS2BF16 flushes subnormals) and GCC does not vectorize
 * _Float16 conversions. */
#include "kernels/kernels.h"
#include "kernels/clones.h"
#include "kernels/elements.h"

#include <errno.h>
#include <math.h>
#include <string.h>

/* Element access through these types may alias anything and needs no alignment: buffers are
 * the caller's raw memory, possibly written as float and read as bits. */
typedef uint16_t u16u __attribute__((aligned(1), may_alias));
typedef uint32_t u32u __attribute__((aligned(1), may_alias));
typedef float f32u __attribute__((aligned(1), may_alias));

#define INLINE static inline __attribute__((always_inline))


/* Elements per block of the reduce: the running sums of one block (4 KiB) stay in L1 while
 * every source streams through once. Measured from 1024 to 16384 on the 2-core reference
 * machine, 64 MiB, 2 threads: the smallest was best (bf16 L=4 at 1.17x the traffic bound
 * against 1.31x at 4096 and 1.46x at 16384); software prefetching a block ahead only made
 * it slower. */
#define REDUCE_BLOCK 1024

bool fsdp_dtype_is_valid(fsdp_dtype_t type) {
  return type == FSDP_DTYPE_FP32 || type == FSDP_DTYPE_BF16 || type == FSDP_DTYPE_FP16;
}

size_t fsdp_dtype_size(fsdp_dtype_t type) {
  switch (type) {
  case FSDP_DTYPE_FP32:
    return 4;
  case FSDP_DTYPE_BF16:
  case FSDP_DTYPE_FP16:
    return 2;
  }
  return 0;
}

const char *fsdp_dtype_name(fsdp_dtype_t type) {
  switch (type) {
  case FSDP_DTYPE_FP32:
    return "fp32";
  case FSDP_DTYPE_BF16:
    return "bf16";
  case FSDP_DTYPE_FP16:
    return "fp16";
  }
  return "invalid";
}

int fsdp_dtype_parse(const char *name, fsdp_dtype_t *ret_type) {
  if (!name)
    return -EINVAL;
  for (int t = 0; t < FSDP_DTYPE_COUNT; t++) {
    if (strcmp(name, fsdp_dtype_name((fsdp_dtype_t)t)) == 0) {
      if (ret_type)
        *ret_type = (fsdp_dtype_t)t;
      return 0;
    }
  }
  return -EINVAL;
}

/* Element k of a buffer of dtype t, as an fp32 value (exact for every dtype). */
INLINE float load_as_float(const void *p, size_t k, fsdp_dtype_t t) {
  switch (t) {
  case FSDP_DTYPE_BF16:
    return fsdp_float_of(fsdp_bf16_to_fp32(((const u16u *)p)[k]));
  case FSDP_DTYPE_FP16:
    return fsdp_float_of(fsdp_fp16_to_fp32(((const u16u *)p)[k]));
  case FSDP_DTYPE_FP32:
    break;
  }
  return ((const f32u *)p)[k];
}

/* ---- Cast ---- */

/* One loop per (src, dst) pair: with both types constant after inlining, each becomes a
 * straight vectorizable loop. Same-type pairs never get here. */
INLINE void cast_loop(void *dst, fsdp_dtype_t dt, const void *src, fsdp_dtype_t st, size_t n) {
  if (dt == FSDP_DTYPE_FP32) {
    u32u *d = dst;
    for (size_t i = 0; i < n; i++)
      d[i] = fsdp_bits_of(load_as_float(src, i, st));
  } else if (st == FSDP_DTYPE_FP32) {
    const u32u *s = src;
    u16u *d = dst;
    if (dt == FSDP_DTYPE_BF16)
      for (size_t i = 0; i < n; i++)
        d[i] = fsdp_fp32_to_bf16(s[i]);
    else
      for (size_t i = 0; i < n; i++)
        d[i] = fsdp_fp32_to_fp16(s[i]);
  } else {
    /* Between the 16-bit types through fp32: widening is exact, so there is one rounding. */
    u16u *d = dst;
    if (dt == FSDP_DTYPE_BF16)
      for (size_t i = 0; i < n; i++)
        d[i] = fsdp_fp32_to_bf16(fsdp_bits_of(load_as_float(src, i, st)));
    else
      for (size_t i = 0; i < n; i++)
        d[i] = fsdp_fp32_to_fp16(fsdp_bits_of(load_as_float(src, i, st)));
  }
}

KERNEL static void cast_kernel(void *dst, fsdp_dtype_t dt, const void *src, fsdp_dtype_t st,
                               size_t n) {
  switch (st * FSDP_DTYPE_COUNT + dt) {
#define CAST_CASE(s, d)                                  \
  case FSDP_DTYPE_##s * FSDP_DTYPE_COUNT + FSDP_DTYPE_##d: \
    cast_loop(dst, FSDP_DTYPE_##d, src, FSDP_DTYPE_##s, n); \
    break;
    CAST_CASE(FP32, BF16)
    CAST_CASE(FP32, FP16)
    CAST_CASE(BF16, FP32)
    CAST_CASE(FP16, FP32)
    CAST_CASE(BF16, FP16)
    CAST_CASE(FP16, BF16)
#undef CAST_CASE
  default:
    break;
  }
}

int fsdp_cast(void *dst, fsdp_dtype_t dst_type, const void *src, fsdp_dtype_t src_type,
              size_t n) {
  if (!fsdp_dtype_is_valid(dst_type) || !fsdp_dtype_is_valid(src_type))
    return -EINVAL;
  if (n == 0)
    return 0;
  if (!dst || !src)
    return -EINVAL;
  if (dst_type == src_type) {
    if (dst != src)
      memcpy(dst, src, n * fsdp_dtype_size(src_type));
    return 0;
  }
  cast_kernel(dst, dst_type, src, src_type, n);
  return 0;
}

/* ---- Reduce ---- */

/* v = R(R(src[k]) * pre), the value one source adds. Converting to reduce_type is a no-op
 * when the source already is that type or reduce_type is fp32 (widening is exact). A NaN
 * source is not made quiet here: the arithmetic that follows does that, and kernels.h
 * leaves which NaN comes out unspecified. */
INLINE float source_value(const void *src, size_t k, fsdp_dtype_t st, fsdp_dtype_t rt,
                          bool scale, float pre) {
  float x;
  if (st == FSDP_DTYPE_BF16)
    x = fsdp_float_of((uint32_t)((const u16u *)src)[k] << 16);
  else
    x = load_as_float(src, k, st);
  if (rt != FSDP_DTYPE_FP32 && rt != st)
    x = fsdp_round_to(x, rt, false);
  if (scale)
    x = fsdp_round_to(x * pre, rt, true);
  return x;
}

/* The fp32 value a reduce adds its result to: dst itself when accumulating, else -0.0,
 * which leaves every x unchanged in -0.0 + x (+0 and -0 included). Selecting with masks
 * rather than a branch keeps one loop for both modes; reading dst costs no memory traffic
 * of its own, because storing to it fetches the line anyway. */
INLINE float accumulate_base(float d, uint32_t keep_mask) {
  return fsdp_float_of((fsdp_bits_of(d) & keep_mask) | (~keep_mask & 0x80000000u));
}

/* One pass over a block of m elements: adds source a (and b when two) to the running sums,
 * which come from `sum` (from_sum) or start at a. The flags are constants at every call
 * site, so each combination is its own branch-free loop. */
INLINE void reduce_pass(float *sum, const char *a, const char *b, bool from_sum, bool two,
                        fsdp_dtype_t st, fsdp_dtype_t rt, bool scale_pre, float pre, size_t m) {
  for (size_t i = 0; i < m; i++) {
    float x = source_value(a, i, st, rt, scale_pre, pre);
    if (from_sum)
      x = fsdp_round_to(sum[i] + x, rt, true);
    if (two)
      x = fsdp_round_to(x + source_value(b, i, st, rt, scale_pre, pre), rt, true);
    sum[i] = x;
  }
}

/* One block of at most REDUCE_BLOCK elements starting at element `off`. The running sums
 * stay in L1 while the sources stream through two per pass (which halves the traffic to
 * `sum`); a last pass applies post_scale and stores or accumulates into dst. The passes are
 * short branch-free loops that vectorize whatever n_srcs is. (Fusing the last source pass
 * with the store was measured: no faster, twice the code.) */
INLINE void reduce_block(float *dst, uint32_t keep_mask, const void *const *srcs,
                         unsigned n_srcs, fsdp_dtype_t st, fsdp_dtype_t rt, bool scale_pre,
                         float pre, bool scale_post, float post, size_t off, size_t m) {
  float sum[REDUCE_BLOCK];
  size_t es = fsdp_dtype_size(st);
  const char *a = (const char *)srcs[0] + off * es;
  if (n_srcs == 1)
    reduce_pass(sum, a, a, false, false, st, rt, scale_pre, pre, m);
  else
    reduce_pass(sum, a, (const char *)srcs[1] + off * es, false, true, st, rt, scale_pre, pre, m);
  unsigned k = 2;
  for (; k + 1 < n_srcs; k += 2)
    reduce_pass(sum, (const char *)srcs[k] + off * es, (const char *)srcs[k + 1] + off * es,
                true, true, st, rt, scale_pre, pre, m);
  if (k < n_srcs) {
    a = (const char *)srcs[k] + off * es;
    reduce_pass(sum, a, a, true, false, st, rt, scale_pre, pre, m);
  }
  f32u *d = dst + off;
  if (scale_post)
    for (size_t i = 0; i < m; i++)
      d[i] = accumulate_base(d[i], keep_mask) + fsdp_round_to(sum[i] * post, rt, true);
  else
    for (size_t i = 0; i < m; i++)
      d[i] = accumulate_base(d[i], keep_mask) + sum[i];
}

INLINE void reduce_loop(float *dst, bool accumulate, const void *const *srcs, unsigned n_srcs,
                        fsdp_dtype_t st, fsdp_dtype_t rt, float pre, float post, size_t begin,
                        size_t end) {
  /* In fp32 a multiplication by 1 is exact and the rounding after it a no-op, so only the
   * 16-bit reduce types get copies without the scale steps; fp32 always multiplies. */
  bool fp32 = rt == FSDP_DTYPE_FP32;
  bool scale_pre = fp32 || pre != 1.0f, scale_post = fp32 || post != 1.0f;
  uint32_t keep_mask = accumulate ? 0xffffffffu : 0u;
  for (size_t off = begin; off < end; off += REDUCE_BLOCK) {
    size_t m = end - off < REDUCE_BLOCK ? end - off : REDUCE_BLOCK;
    /* The branches pick one specialized copy of the block per call; none is taken per
     * element. */
    if (scale_pre)
      reduce_block(dst, keep_mask, srcs, n_srcs, st, rt, true, pre, scale_post, post, off, m);
    else
      reduce_block(dst, keep_mask, srcs, n_srcs, st, rt, false, pre, scale_post, post, off, m);
  }
}

KERNEL static void reduce_kernel(float *dst, bool accumulate, const void *const *srcs,
                                 unsigned n_srcs, fsdp_dtype_t st, fsdp_dtype_t rt, float pre,
                                 float post, size_t begin, size_t end) {
  switch (st * FSDP_DTYPE_COUNT + rt) {
#define REDUCE_CASE(s, r)                                                                   \
  case FSDP_DTYPE_##s * FSDP_DTYPE_COUNT + FSDP_DTYPE_##r:                                  \
    reduce_loop(dst, accumulate, srcs, n_srcs, FSDP_DTYPE_##s, FSDP_DTYPE_##r, pre, post, begin, \
                end);                                                                          \
    break;
    REDUCE_CASE(FP32, FP32)
    REDUCE_CASE(FP32, BF16)
    REDUCE_CASE(FP32, FP16)
    REDUCE_CASE(BF16, FP32)
    REDUCE_CASE(BF16, BF16)
    REDUCE_CASE(BF16, FP16)
    REDUCE_CASE(FP16, FP32)
    REDUCE_CASE(FP16, BF16)
    REDUCE_CASE(FP16, FP16)
#undef REDUCE_CASE
  default:
    break;
  }
}

int fsdp_reduce_range(float *dst, bool accumulate, const void *const *srcs, unsigned n_srcs,
                      fsdp_dtype_t src_type, fsdp_dtype_t reduce_type, float pre_scale,
                      float post_scale, size_t begin, size_t end) {
  if (!fsdp_dtype_is_valid(src_type) || !fsdp_dtype_is_valid(reduce_type) || n_srcs == 0 ||
      begin > end || !isfinite(pre_scale) || !isfinite(post_scale))
    return -EINVAL;
  if (begin == end)
    return 0;
  if (!dst || !srcs)
    return -EINVAL;
  for (unsigned k = 0; k < n_srcs; k++)
    if (!srcs[k])
      return -EINVAL;
  reduce_kernel(dst, accumulate, srcs, n_srcs, src_type, reduce_type, pre_scale, post_scale,
                begin, end);
  return 0;
}

int fsdp_reduce(float *dst, bool accumulate, const void *const *srcs, unsigned n_srcs,
                fsdp_dtype_t src_type, fsdp_dtype_t reduce_type, float pre_scale,
                float post_scale, size_t n) {
  return fsdp_reduce_range(dst, accumulate, srcs, n_srcs, src_type, reduce_type, pre_scale,
                           post_scale, 0, n);
}

/* ---- Add ---- */

/* Each sum is one fp32 operation on two values of `type`, so the rounding back is the
 * correctly rounded sum in that type; the NaN select of the conversions stays in because the
 * bit patterns are the caller's (a signaling NaN in fp16 must come out quiet). */
KERNEL static void add_kernel(void *dst, const void *src, fsdp_dtype_t type, size_t n) {
  switch (type) {
  case FSDP_DTYPE_FP32: {
    f32u *d = dst;
    const f32u *s = src;
    for (size_t i = 0; i < n; i++)
      d[i] = d[i] + s[i];
    break;
  }
  case FSDP_DTYPE_BF16: {
    u16u *d = dst;
    const u16u *s = src;
    for (size_t i = 0; i < n; i++)
      d[i] = fsdp_fp32_to_bf16(fsdp_bits_of(fsdp_float_of((uint32_t)d[i] << 16) + fsdp_float_of((uint32_t)s[i] << 16)));
    break;
  }
  case FSDP_DTYPE_FP16: {
    u16u *d = dst;
    const u16u *s = src;
    for (size_t i = 0; i < n; i++)
      d[i] = fsdp_fp32_to_fp16(fsdp_bits_of(fsdp_float_of(fsdp_fp16_to_fp32(d[i])) + fsdp_float_of(fsdp_fp16_to_fp32(s[i]))));
    break;
  }
  }
}

int fsdp_add(void *dst, const void *src, fsdp_dtype_t type, size_t n) {
  if (!fsdp_dtype_is_valid(type))
    return -EINVAL;
  if (n == 0)
    return 0;
  if (!dst || !src)
    return -EINVAL;
  add_kernel(dst, src, type, n);
  return 0;
}
