/* The kernels' element arithmetic: conversions between fp32, bf16 and fp16 on bit patterns,
 * and R (rounding an fp32 value to a dtype). One definition for every kernel that must give
 * the same bits: the host's vectorized loops (kernels.c) and the CUDA backend's (cuda/),
 * which compiles this header as host-and-device code. Each function is a handful of integer
 * and float operations with selects instead of branches, so that loops over it vectorize. */
#ifndef FSDP_KERNELS_ELEMENTS_H
#define FSDP_KERNELS_ELEMENTS_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "kernels/dtype.h"

#ifdef __CUDACC__
#define FSDP_ELEMENT static inline __host__ __device__
#else
#define FSDP_ELEMENT static inline __attribute__((always_inline))
#endif

FSDP_ELEMENT uint32_t fsdp_bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

FSDP_ELEMENT float fsdp_float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Round to nearest even by adding 0x7fff plus the lowest kept bit; carries into the
 * exponent are right (the largest finite values round up to Inf, subnormals into normals).
 * A NaN keeps its top payload bits and gets the quiet bit, which the addition could have
 * carried away or into the exponent. */
FSDP_ELEMENT uint16_t fsdp_fp32_to_bf16(uint32_t u) {
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

FSDP_ELEMENT uint32_t fsdp_bf16_to_fp32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  return (h & 0x7fffu) > 0x7f80u ? u | 0x00400000u : u;
}

/* fp16 -> fp32 is exact. Exponent and mantissa move up 13 bits and the exponent is rebiased
 * by 112; a subnormal m * 2^-24 is made a normal float 2^-14 + m * 2^-24 by giving it the
 * exponent of 2^-14, and 2^-14 is then subtracted (exactly) in float. */
FSDP_ELEMENT uint32_t fsdp_fp16_to_fp32(uint16_t h) {
  uint32_t em = (uint32_t)(h & 0x7fffu) << 13;
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = em & 0x0f800000u;
  uint32_t normal = em + 0x38000000u;
  uint32_t special = (em + 0x70000000u) | ((em & 0x007fe000u) ? 0x00400000u : 0u);
  uint32_t subnormal = fsdp_bits_of(fsdp_float_of(em + 0x38800000u) - fsdp_float_of(0x38800000u));
  uint32_t r = exp == 0x0f800000u ? special : normal;
  r = exp == 0 ? subnormal : r;
  return r | sign;
}

/* fp32 -> fp16, to nearest even. Normal results: rebias and round with the 0xfff + odd-bit
 * trick, whose carry also turns [65520, 65536) into Inf. Below 2^-14 the result is
 * subnormal: adding 0.5f puts the float's bits at fp16's subnormal scale (ulp(0.5f) = 2^-24)
 * and the FPU rounds to nearest even for us. From 65536 up: Inf; NaN keeps its top 10
 * payload bits and is made quiet. */
FSDP_ELEMENT uint16_t fsdp_fp32_to_fp16(uint32_t u) {
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  uint32_t subnormal = fsdp_bits_of(fsdp_float_of(a) + 0.5f) - 0x3f000000u;
  uint32_t special = a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu) : 0x7c00u;
  uint32_t r = a < 0x38800000u ? subnormal : normal;
  r = a >= 0x47800000u ? special : r;
  return (uint16_t)(r | sign);
}

/* R of kernels.h (fsdp_reduce): x rounded to dtype t, as an fp32 value. Same results as the conversions
 * above and back, in fewer operations, because the reduce runs it once or twice per source
 * and element.
 *
 * `clean` says that x is the result of one fp32 operation on values of type t (and finite
 * fp32 scales): then a NaN in x is one of the operands' NaNs or the CPU's default NaN, with
 * no payload bits below t's mantissa, and bf16 rounding cannot carry out of it, so the NaN
 * select is skipped. A value converted from a wider type is not clean, and neither is a
 * GPU's result (its default NaN has every payload bit). */
FSDP_ELEMENT float fsdp_round_to(float x, fsdp_dtype_t t, bool clean) {
  uint32_t u = fsdp_bits_of(x);
  switch (t) {
  case FSDP_DTYPE_BF16: {
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    if (!clean)
      r = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u : r;
    return fsdp_float_of(r);
  }
  case FSDP_DTYPE_FP16: {
    /* Normal range: round away the low 13 bits; a carry out of 65504 lands on 65536, which
     * is beyond fp16 and becomes Inf. Below 2^-14: x + 0.5f - 0.5f rounds to a multiple of
     * 2^-24 (ulp of 0.5f) exactly, both steps being exact or correctly rounded. */
    uint32_t sign = u & 0x80000000u;
    uint32_t a = u & 0x7fffffffu;
    uint32_t normal = (a + 0xfffu + ((a >> 13) & 1u)) & 0xffffe000u;
    normal = normal >= 0x47800000u ? 0x7f800000u : normal;
    uint32_t subnormal = fsdp_bits_of((fsdp_float_of(a) + 0.5f) - 0.5f);
    uint32_t r = a < 0x38800000u ? subnormal : normal;
    r = a > 0x7f800000u ? (a | 0x00400000u) & 0xffffe000u : r;
    return fsdp_float_of(r | sign);
  }
  case FSDP_DTYPE_FP32:
    break;
  }
  return x;
}

#endif
