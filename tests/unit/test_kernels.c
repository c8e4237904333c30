/* The collectives kernels and worker pool against references written here from the IEEE
 * definitions (double arithmetic, frexp/ldexp/rint: no bit tricks shared with the kernels),
 * compared bit for bit: every 16-bit pattern of bf16 and fp16 both ways, fp32 values at and
 * around every rounding boundary, odd lengths and misaligned buffers, the L-way reduce in
 * every (source, reduce) dtype pair, and the pool's splitting at 1, 2 and 4 threads. */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/clock.h"
#include "kernels/kernels.h"
#include "kernels/workers.h"

/* ---- Reference conversions ---- */

typedef struct {
  int mbits; /* stored mantissa bits */
  int ebits; /* exponent bits */
} format_t;

static const format_t BF16 = {7, 8};
static const format_t FP16 = {10, 5};

static format_t format_of(fsdp_dtype_t t) {
  return t == FSDP_DTYPE_BF16 ? BF16 : FP16;
}

static uint32_t fbits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float ffrom(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* A 16-bit pattern of format f as fp32 bits: exact, NaNs quiet with their payload on top. */
static uint32_t ref_16_to_32(uint16_t h, format_t f) {
  uint32_t sign = (uint32_t)(h >> 15) << 31;
  int emax = (1 << f.ebits) - 1, bias = (1 << (f.ebits - 1)) - 1;
  int e = (h >> f.mbits) & emax;
  uint32_t m = h & ((1u << f.mbits) - 1);
  if (e == emax)
    return m == 0 ? sign | 0x7f800000u : sign | 0x7fc00000u | (m << (23 - f.mbits));
  double v = e == 0 ? ldexp((double)m, 1 - bias - f.mbits)
                    : ldexp((double)((1u << f.mbits) + m), e - bias - f.mbits);
  return fbits((float)(sign ? -v : v));
}

/* fp32 bits to format f, rounding to nearest even: the value is scaled by its quantum (the
 * spacing of f's values at that magnitude) and rounded with rint. */
static uint16_t ref_32_to_16(uint32_t u, format_t f) {
  uint16_t sign = (uint16_t)((u >> 31) << 15);
  int emax = (1 << f.ebits) - 1, bias = (1 << (f.ebits - 1)) - 1, emin = 1 - bias;
  float x = ffrom(u);
  if (isnan(x))
    return (uint16_t)(sign | emax << f.mbits | 1u << (f.mbits - 1) |
                      (u & 0x7fffffu) >> (23 - f.mbits));
  if (isinf(x))
    return (uint16_t)(sign | emax << f.mbits);
  double a = fabs((double)x);
  int e = 0;
  if (a != 0)
    frexp(a, &e);
  int ex = a == 0 || e - 1 < emin ? emin : e - 1;
  double r = rint(ldexp(a, f.mbits - ex)); /* in units of the quantum 2^(ex - mbits) */
  double v = ldexp(r, ex - f.mbits);
  double max_finite = ldexp((double)((2u << f.mbits) - 1), emax - 1 - bias - f.mbits);
  if (v > max_finite)
    return (uint16_t)(sign | emax << f.mbits);
  if (v < ldexp(1, emin))
    return (uint16_t)(sign | (uint16_t)ldexp(v, f.mbits - emin));
  frexp(v, &e);
  uint32_t m = (uint32_t)ldexp(v, f.mbits - (e - 1)) - (1u << f.mbits);
  return (uint16_t)(sign | (uint32_t)(e - 1 + bias) << f.mbits | m);
}

/* Element i of a buffer of type t, as fp32 bits (exact). */
static uint32_t ref_load(const void *p, size_t i, fsdp_dtype_t t) {
  if (t == FSDP_DTYPE_FP32) {
    uint32_t u;
    memcpy(&u, (const char *)p + 4 * i, 4);
    return u;
  }
  uint16_t h;
  memcpy(&h, (const char *)p + 2 * i, 2);
  return ref_16_to_32(h, format_of(t));
}

/* fp32 bits converted to type t and stored as element i. */
static void ref_store(void *p, size_t i, fsdp_dtype_t t, uint32_t u) {
  if (t == FSDP_DTYPE_FP32) {
    memcpy((char *)p + 4 * i, &u, 4);
    return;
  }
  uint16_t h = ref_32_to_16(u, format_of(t));
  memcpy((char *)p + 2 * i, &h, 2);
}

/* The expected bits of casting element i; same-type casts copy bits unchanged. */
static void ref_cast_one(void *dst, fsdp_dtype_t dt, const void *src, fsdp_dtype_t st, size_t i) {
  size_t es = fsdp_dtype_size(st);
  if (dt == st) {
    memcpy((char *)dst + i * es, (const char *)src + i * es, es);
    return;
  }
  ref_store(dst, i, dt, ref_load(src, i, st));
}

/* R of kernels.h. */
static float ref_round(float x, fsdp_dtype_t t) {
  if (t == FSDP_DTYPE_FP32)
    return x;
  format_t f = format_of(t);
  return ffrom(ref_16_to_32(ref_32_to_16(fbits(x), f), f));
}

/* The reduce contract of kernels.h, step by step, scales applied even when they are 1. */
static float ref_reduce_one(float dst, bool accumulate, const void *const *srcs, unsigned n_srcs,
                            fsdp_dtype_t st, fsdp_dtype_t rt, float pre, float post, size_t i) {
  float sum = 0;
  for (unsigned k = 0; k < n_srcs; k++) {
    float v = ref_round(ffrom(ref_load(srcs[k], i, st)), rt);
    float scaled = v * pre;
    v = ref_round(scaled, rt);
    if (k == 0) {
      sum = v;
    } else {
      float s = sum + v;
      sum = ref_round(s, rt);
    }
  }
  float scaled = sum * post;
  float out = ref_round(scaled, rt);
  if (accumulate) {
    float s = dst + out;
    return s;
  }
  return out;
}

/* ---- Helpers ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15u;

static uint64_t rng(void) {
  uint64_t x = rng_state;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return rng_state = x;
}

static const fsdp_dtype_t TYPES[] = {FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, FSDP_DTYPE_FP16};

/* Fills n elements of type t with random bit patterns: every class of value, NaNs and
 * subnormals included. */
static void fill_random_bits(void *p, fsdp_dtype_t t, size_t n) {
  size_t bytes = n * fsdp_dtype_size(t);
  unsigned char *b = p;
  for (size_t i = 0; i < bytes; i++)
    b[i] = (unsigned char)rng();
}

/* Fills n elements of type t with values a gradient could hold: mostly finite, of mixed sign
 * and magnitude (from fp16-subnormal to past fp16's range), with a few specials. */
static void fill_values(void *p, fsdp_dtype_t t, size_t n) {
  static const uint32_t specials[] = {
      0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u,
      0x477fe000u, /* fp16 max 65504 */
      0x477ff000u, /* 65520: rounds up to Inf in fp16 */
      0x33800000u, /* 2^-24: smallest fp16 subnormal */
      0x38800000u, /* 2^-14: smallest fp16 normal */
      0x00800000u, /* smallest fp32 normal */
      0x00000001u, /* smallest fp32 subnormal */
  };
  for (size_t i = 0; i < n; i++) {
    uint64_t r = rng();
    uint32_t u;
    if (r % 64 == 0) {
      u = specials[(r >> 8) % (sizeof specials / sizeof specials[0])];
    } else {
      int e = (int)((r >> 8) % 50) - 30;
      float v = ldexpf(1.0f + (float)((r >> 16) & 0xffff) / 65536.0f, e);
      u = fbits((r >> 40) & 1 ? -v : v);
    }
    u ^= (uint32_t)(r >> 63) << 31;
    ref_store(p, i, t, u);
  }
}

/* Equal bits, or both NaN: the NaN a reduce returns is unspecified. */
static bool same_value(uint32_t a, uint32_t b) {
  return a == b || (isnan(ffrom(a)) && isnan(ffrom(b)));
}

/* ---- dtype helpers and argument checks ---- */

static void test_dtype_helpers(void **state) {
  (void)state;
  assert_int_equal(fsdp_dtype_size(FSDP_DTYPE_FP32), 4);
  assert_int_equal(fsdp_dtype_size(FSDP_DTYPE_BF16), 2);
  assert_int_equal(fsdp_dtype_size(FSDP_DTYPE_FP16), 2);
  assert_int_equal(fsdp_dtype_size((fsdp_dtype_t)3), 0);
  assert_int_equal(fsdp_dtype_size((fsdp_dtype_t)-1), 0);
  for (int t = 0; t < FSDP_DTYPE_COUNT; t++) {
    fsdp_dtype_t back = (fsdp_dtype_t)99;
    assert_true(fsdp_dtype_is_valid((fsdp_dtype_t)t));
    assert_int_equal(fsdp_dtype_parse(fsdp_dtype_name((fsdp_dtype_t)t), &back), 0);
    assert_int_equal(back, t);
  }
  assert_string_equal(fsdp_dtype_name(FSDP_DTYPE_BF16), "bf16");
  assert_string_equal(fsdp_dtype_name((fsdp_dtype_t)7), "invalid");
  assert_false(fsdp_dtype_is_valid((fsdp_dtype_t)3));
  fsdp_dtype_t untouched = FSDP_DTYPE_FP16;
  assert_int_equal(fsdp_dtype_parse("FP32", &untouched), -EINVAL);
  assert_int_equal(fsdp_dtype_parse("invalid", &untouched), -EINVAL);
  assert_int_equal(fsdp_dtype_parse(NULL, &untouched), -EINVAL);
  assert_int_equal(untouched, FSDP_DTYPE_FP16);
}

static void test_bad_arguments(void **state) {
  (void)state;
  float d[4] = {0}, s[4] = {1, 2, 3, 4};
  const void *srcs[2] = {s, s};
  const void *null_src[2] = {s, NULL};
  fsdp_dtype_t bad = (fsdp_dtype_t)3;
  assert_int_equal(fsdp_cast(d, bad, s, FSDP_DTYPE_FP32, 4), -EINVAL);
  assert_int_equal(fsdp_cast(d, FSDP_DTYPE_FP32, s, bad, 4), -EINVAL);
  assert_int_equal(fsdp_cast(NULL, FSDP_DTYPE_FP32, s, FSDP_DTYPE_BF16, 4), -EINVAL);
  assert_int_equal(fsdp_cast(d, FSDP_DTYPE_FP32, NULL, FSDP_DTYPE_BF16, 4), -EINVAL);
  assert_int_equal(fsdp_cast(NULL, FSDP_DTYPE_FP32, NULL, FSDP_DTYPE_BF16, 0), 0);
  assert_int_equal(fsdp_reduce(d, false, srcs, 0, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1, 1, 4),
                   -EINVAL);
  assert_int_equal(fsdp_reduce(d, false, srcs, 2, bad, FSDP_DTYPE_FP32, 1, 1, 4), -EINVAL);
  assert_int_equal(fsdp_reduce(d, false, srcs, 2, FSDP_DTYPE_FP32, bad, 1, 1, 4), -EINVAL);
  assert_int_equal(fsdp_reduce(d, false, null_src, 2, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1, 1, 4),
                   -EINVAL);
  assert_int_equal(fsdp_reduce(NULL, false, srcs, 2, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1, 1, 4),
                   -EINVAL);
  assert_int_equal(fsdp_reduce(d, false, NULL, 2, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1, 1, 4),
                   -EINVAL);
  assert_int_equal(fsdp_reduce(d, false, srcs, 2, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, NAN, 1, 4),
                   -EINVAL);
  assert_int_equal(
      fsdp_reduce(d, false, srcs, 2, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1, INFINITY, 4), -EINVAL);
  assert_int_equal(
      fsdp_reduce_range(d, false, srcs, 2, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1, 1, 3, 2), -EINVAL);
  assert_int_equal(fsdp_reduce(NULL, false, NULL, 1, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1, 1, 0),
                   0);
  /* Nothing was written by the refused calls. */
  for (int i = 0; i < 4; i++)
    assert_true(d[i] == 0.0f);

  fsdp_workers_t *pool = NULL;
  assert_int_equal(fsdp_workers_new(0, &pool), -EINVAL);
  assert_int_equal(fsdp_workers_new(FSDP_WORKERS_MAX + 1, &pool), -EINVAL);
  assert_null(pool);
  assert_int_equal(fsdp_cast_parallel(NULL, d, bad, s, FSDP_DTYPE_FP32, 4), -EINVAL);
  assert_int_equal(fsdp_reduce_parallel(NULL, d, false, srcs, 2, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32,
                                        1, NAN, 4),
                   -EINVAL);
  assert_int_equal(fsdp_workers_for(NULL, 4, 1, NULL, NULL), -EINVAL);
  fsdp_workers_free(NULL);
  assert_int_equal(fsdp_workers_count(NULL), 1);
}

/* ---- Casts ---- */

/* Every bf16 and fp16 pattern: to fp32 exactly, back unchanged (a signaling NaN comes back
 * quiet), and to the other 16-bit type rounded once. */
static void test_every_16_bit_pattern(void **state) {
  (void)state;
  enum { N = 65536 };
  uint16_t *h = malloc(N * 2), *back = malloc(N * 2), *other = malloc(N * 2);
  uint32_t *f = malloc(N * 4);
  assert_non_null(h);
  assert_non_null(back);
  assert_non_null(other);
  assert_non_null(f);
  for (uint32_t i = 0; i < N; i++)
    h[i] = (uint16_t)i;
  for (int ti = 1; ti < 3; ti++) {
    fsdp_dtype_t t = TYPES[ti], o = TYPES[3 - ti];
    format_t fmt = format_of(t);
    assert_int_equal(fsdp_cast(f, FSDP_DTYPE_FP32, h, t, N), 0);
    assert_int_equal(fsdp_cast(back, t, f, FSDP_DTYPE_FP32, N), 0);
    assert_int_equal(fsdp_cast(other, o, h, t, N), 0);
    uint16_t exp_mask = (uint16_t)(((1u << fmt.ebits) - 1) << fmt.mbits);
    uint16_t quiet = (uint16_t)(1u << (fmt.mbits - 1));
    for (uint32_t i = 0; i < N; i++) {
      uint32_t want = ref_16_to_32(h[i], fmt);
      if (f[i] != want)
        fail_msg("%s 0x%04x -> fp32: got 0x%08x, want 0x%08x", fsdp_dtype_name(t), i, f[i], want);
      bool nan = (h[i] & exp_mask) == exp_mask && (h[i] & (exp_mask ^ 0x7fffu)) != 0;
      uint16_t round_trip = nan ? (uint16_t)(h[i] | quiet) : h[i];
      if (back[i] != round_trip)
        fail_msg("%s 0x%04x -> fp32 -> %s: got 0x%04x, want 0x%04x", fsdp_dtype_name(t), i,
                 fsdp_dtype_name(t), back[i], round_trip);
      uint16_t want_other = ref_32_to_16(want, format_of(o));
      if (other[i] != want_other)
        fail_msg("%s 0x%04x -> %s: got 0x%04x, want 0x%04x", fsdp_dtype_name(t), i,
                 fsdp_dtype_name(o), other[i], want_other);
    }
  }
  free(h);
  free(back);
  free(other);
  free(f);
}

/* fp32 values at and around every rounding boundary of bf16 and fp16: each representable
 * value, each midpoint between neighbours (the ties) and the floats just either side of it,
 * both signs; plus specials and random patterns. */
static size_t boundary_values(uint32_t *out, size_t cap) {
  size_t n = 0;
  static const uint32_t specials[] = {
      0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
      0x7f800001u, 0x7fbfffffu, 0x7fffffffu, 0xff800001u, 0x7f7fffffu, 0xff7fffffu,
      0x00800000u, 0x80800000u, 0x007fffffu, 0x00000001u, 0x80000001u, 0x477fe000u,
      0x477fefffu, 0x477ff000u, 0x477ff001u, 0x47800000u, 0xc77ff000u, 0x33000000u,
      0x33000001u, 0x32ffffffu, 0x33800000u, 0x33c00000u, 0x38800000u, 0x387fc000u,
      0x387fe000u, 0x387ff000u, 0x7f7f8000u, 0x7f7f7fffu, 0x3f808000u, 0x3f818000u,
  };
  for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++)
    out[n++] = specials[i];
  for (int fi = 0; fi < 2; fi++) {
    format_t f = fi ? FP16 : BF16;
    uint32_t top = (((1u << f.ebits) - 1) << f.mbits); /* +Inf's pattern */
    for (uint32_t p = 0; p < top; p++) {
      double v = ffrom(ref_16_to_32((uint16_t)p, f));
      double next = p + 1 == top ? ldexp(1, (1 << (f.ebits - 1))) /* where Inf starts */
                                 : (double)ffrom(ref_16_to_32((uint16_t)(p + 1), f));
      float mid = (float)((v + next) / 2); /* exact: one more bit than the format */
      uint32_t cand[4] = {fbits((float)v), fbits(mid), fbits(nextafterf(mid, 0)),
                          fbits(nextafterf(mid, INFINITY))};
      for (int c = 0; c < 4; c++) {
        assert_true(n + 2 <= cap);
        out[n++] = cand[c];
        out[n++] = cand[c] | 0x80000000u;
      }
    }
  }
  for (int i = 0; i < 1 << 18; i++) {
    assert_true(n < cap);
    out[n++] = (uint32_t)rng();
  }
  return n;
}

static void test_fp32_rounding_boundaries(void **state) {
  (void)state;
  size_t cap = 4u << 20;
  uint32_t *in = malloc(cap * 4);
  uint16_t *out = malloc(cap * 2);
  assert_non_null(in);
  assert_non_null(out);
  size_t n = boundary_values(in, cap);
  for (int ti = 1; ti < 3; ti++) {
    fsdp_dtype_t t = TYPES[ti];
    assert_int_equal(fsdp_cast(out, t, in, FSDP_DTYPE_FP32, n), 0);
    for (size_t i = 0; i < n; i++) {
      uint16_t want = ref_32_to_16(in[i], format_of(t));
      if (out[i] != want)
        fail_msg("fp32 0x%08x (%.9g) -> %s: got 0x%04x, want 0x%04x", in[i], (double)ffrom(in[i]),
                 fsdp_dtype_name(t), out[i], want);
    }
  }
  free(in);
  free(out);
}

/* Spot checks written out by hand, so that the reference is checked too. */
static void test_known_values(void **state) {
  (void)state;
  static const struct {
    float in;
    uint16_t bf16, fp16;
  } cases[] = {
      {1.0f, 0x3f80, 0x3c00},
      {-2.0f, 0xc000, 0xc000},
      {65504.0f, 0x4780, 0x7bff},
      {65519.996f, 0x4780, 0x7bff},
      {65520.0f, 0x4780, 0x7c00},      /* tie between 65504 and "65536": even is Inf */
      {1e10f, 0x5015, 0x7c00},         /* overflow to Inf in fp16 */
      {0x1p-24f, 0x3380, 0x0001},       /* smallest fp16 subnormal */
      {0x1p-25f, 0x3300, 0x0000},       /* tie between 0 and 2^-24: even is 0 */
      {0x1.8p-24f, 0x33c0, 0x0002},     /* tie between 1 and 2 units: even is 2 */
      {0x1.7p-24f, 0x33b8, 0x0001},     /* just below that tie */
      {0x1.ffcp-15f, 0x3880, 0x0400},   /* tie of the largest subnormal and 2^-14: even */
      {0x1p-14f, 0x3880, 0x0400},       /* smallest fp16 normal */
      {1.00390625f, 0x3f80, 0x3c04},    /* 1 + 2^-8: bf16 tie, even is 1 */
      {1.01171875f, 0x3f82, 0x3c0c},    /* 1 + 3 * 2^-8: bf16 tie, even is 1 + 2^-6 */
      {-0.0f, 0x8000, 0x8000},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint16_t b, h;
    assert_int_equal(fsdp_cast(&b, FSDP_DTYPE_BF16, &cases[i].in, FSDP_DTYPE_FP32, 1), 0);
    assert_int_equal(fsdp_cast(&h, FSDP_DTYPE_FP16, &cases[i].in, FSDP_DTYPE_FP32, 1), 0);
    if (b != cases[i].bf16 || h != cases[i].fp16)
      fail_msg("%.9g: bf16 0x%04x fp16 0x%04x, want 0x%04x 0x%04x", (double)cases[i].in, b, h,
               cases[i].bf16, cases[i].fp16);
    assert_int_equal(ref_32_to_16(fbits(cases[i].in), BF16), cases[i].bf16);
    assert_int_equal(ref_32_to_16(fbits(cases[i].in), FP16), cases[i].fp16);
  }
  /* NaN stays NaN, quiet, with the top of its payload; Inf stays Inf. */
  uint32_t snan = 0x7f800001u, nan_payload = 0xffa5a000u;
  uint16_t out;
  assert_int_equal(fsdp_cast(&out, FSDP_DTYPE_BF16, &snan, FSDP_DTYPE_FP32, 1), 0);
  assert_int_equal(out, 0x7fc0);
  assert_int_equal(fsdp_cast(&out, FSDP_DTYPE_FP16, &snan, FSDP_DTYPE_FP32, 1), 0);
  assert_int_equal(out, 0x7e00);
  assert_int_equal(fsdp_cast(&out, FSDP_DTYPE_BF16, &nan_payload, FSDP_DTYPE_FP32, 1), 0);
  assert_int_equal(out, 0xffe5);
  assert_int_equal(fsdp_cast(&out, FSDP_DTYPE_FP16, &nan_payload, FSDP_DTYPE_FP32, 1), 0);
  assert_int_equal(out, 0xff2d);
  uint16_t h_snan = 0x7c01;
  uint32_t f;
  assert_int_equal(fsdp_cast(&f, FSDP_DTYPE_FP32, &h_snan, FSDP_DTYPE_FP16, 1), 0);
  assert_int_equal(f, 0x7fc02000u);
}

/* All nine pairs at odd lengths, with source and destination off any alignment, against the
 * reference element by element; the bytes after the destination stay untouched. */
static void test_lengths_and_alignment(void **state) {
  (void)state;
  static const size_t lengths[] = {0, 1, 7, 63, 1000003};
  enum { GUARD = 64 };
  size_t max_n = 1000003;
  unsigned char *src_buf = malloc(max_n * 4 + 8), *dst_buf = malloc(max_n * 4 + 8 + GUARD),
                *want_buf = malloc(max_n * 4);
  assert_non_null(src_buf);
  assert_non_null(dst_buf);
  assert_non_null(want_buf);
  unsigned round = 0;
  for (int si = 0; si < 3; si++) {
    for (int di = 0; di < 3; di++) {
      fsdp_dtype_t st = TYPES[si], dt = TYPES[di];
      for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++, round++) {
        size_t n = lengths[li];
        /* Offsets 0..3 bytes, varied by round: aligned, 2-aligned and odd addresses. */
        unsigned char *src = src_buf + round % 4, *dst = dst_buf + (round / 2 + 1) % 4;
        size_t dbytes = n * fsdp_dtype_size(dt);
        fill_random_bits(src, st, n);
        memset(dst, 0xa5, dbytes + GUARD);
        for (size_t i = 0; i < n; i++)
          ref_cast_one(want_buf, dt, src, st, i);
        assert_int_equal(fsdp_cast(dst, dt, src, st, n), 0);
        if (memcmp(dst, want_buf, dbytes) != 0) {
          for (size_t i = 0; i < dbytes; i++)
            if (dst[i] != want_buf[i])
              fail_msg("%s -> %s, n %zu: byte %zu differs (element %zu)", fsdp_dtype_name(st),
                       fsdp_dtype_name(dt), n, i, i / fsdp_dtype_size(dt));
        }
        for (size_t i = 0; i < GUARD; i++)
          assert_int_equal(dst[dbytes + i], 0xa5);
      }
    }
  }
  free(src_buf);
  free(dst_buf);
  free(want_buf);
}

/* ---- Reduce ---- */

typedef struct {
  float pre, post;
} scales_t;

static const scales_t SCALES[] = {{1.0f, 1.0f}, {0.5f, 1.0f}, {1.0f / 3.0f, 0.7f}};

/* Reduces n elements for one configuration and compares with the reference. */
static void check_reduce(fsdp_workers_t *pool, unsigned n_srcs, fsdp_dtype_t st,
                         fsdp_dtype_t rt, bool accumulate, scales_t sc, size_t n,
                         size_t misalign) {
  size_t es = fsdp_dtype_size(st);
  unsigned char *bufs[16];
  const void *srcs[16];
  for (unsigned k = 0; k < n_srcs; k++) {
    bufs[k] = malloc(n * es + 8);
    assert_non_null(bufs[k]);
    srcs[k] = bufs[k] + (misalign ? (k + misalign) % 4 : 0);
    fill_values((void *)srcs[k], st, n);
  }
  float *dst = malloc(n * 4 + 4), *want = malloc(n * 4);
  assert_non_null(dst);
  assert_non_null(want);
  float *d = (float *)((char *)dst + misalign % 4);
  fill_values(d, FSDP_DTYPE_FP32, n);
  for (size_t i = 0; i < n; i++) {
    float before;
    memcpy(&before, (char *)d + 4 * i, 4);
    want[i] = ref_reduce_one(before, accumulate, srcs, n_srcs, st, rt, sc.pre, sc.post, i);
  }
  int r = pool ? fsdp_reduce_parallel(pool, d, accumulate, srcs, n_srcs, st, rt, sc.pre, sc.post,
                                      n)
               : fsdp_reduce(d, accumulate, srcs, n_srcs, st, rt, sc.pre, sc.post, n);
  assert_int_equal(r, 0);
  for (size_t i = 0; i < n; i++) {
    uint32_t got;
    memcpy(&got, (char *)d + 4 * i, 4);
    if (!same_value(got, fbits(want[i]))) {
      fail_msg("reduce L=%u %s in %s, accumulate %d, pre %g post %g, element %zu of %zu: got "
               "0x%08x (%.9g), want 0x%08x (%.9g)",
               n_srcs, fsdp_dtype_name(st), fsdp_dtype_name(rt), accumulate, (double)sc.pre,
               (double)sc.post, i, n, got, (double)ffrom(got), fbits(want[i]), (double)want[i]);
    }
  }
  for (unsigned k = 0; k < n_srcs; k++)
    free(bufs[k]);
  free(dst);
  free(want);
}

/* fsdp_add against the reference: the fp32 sum of the two exact values, rounded to the type
 * once; every dtype, odd lengths, misaligned buffers, random bit patterns (NaNs, Infs and
 * subnormals among them) and gradient-like values, and dst == src. */
static void check_add(fsdp_dtype_t t, size_t n, size_t misalign, bool random_bits, bool same) {
  size_t es = fsdp_dtype_size(t);
  unsigned char *a = malloc(n * es + 8), *b = malloc(n * es + 8), *want = malloc(n * es + 1);
  assert_non_null(a);
  assert_non_null(b);
  assert_non_null(want);
  void *d = a + misalign % 4, *s = same ? d : b + (misalign + 1) % 4;
  if (random_bits) {
    fill_random_bits(d, t, n);
    fill_random_bits(s, t, n);
  } else {
    fill_values(d, t, n);
    fill_values(s, t, n);
  }
  for (size_t i = 0; i < n; i++)
    ref_store(want, i, t, fbits(ffrom(ref_load(d, i, t)) + ffrom(ref_load(s, i, t))));
  assert_int_equal(fsdp_add(d, s, t, n), 0);
  for (size_t i = 0; i < n; i++) {
    uint32_t got = ref_load(d, i, t), exp = ref_load(want, i, t);
    if (!same_value(got, exp))
      fail_msg("add %s, n %zu, misalign %zu, dst==src %d, element %zu: got 0x%08x (%.9g), want "
               "0x%08x (%.9g)",
               fsdp_dtype_name(t), n, misalign, same, i, got, (double)ffrom(got), exp,
               (double)ffrom(exp));
  }
  free(a);
  free(b);
  free(want);
}

static void test_add_every_dtype(void **state) {
  (void)state;
  static const size_t ns[] = {1, 7, 31, 1000, 4096 + 37};
  for (int ti = 0; ti < 3; ti++)
    for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
      for (int mode = 0; mode < 3; mode++)
        check_add(TYPES[ti], ns[ni], ni + (size_t)mode, mode == 1, mode == 2);
  /* Known sums: fp16 overflow to Inf, bf16 ties to even, Inf - Inf. */
  uint16_t h[2] = {0x7bff /* 65504 */, 0x5000 /* 32 */};
  assert_int_equal(fsdp_add(&h[0], &h[1], FSDP_DTYPE_FP16, 1), 0);
  assert_int_equal(h[0], 0x7c00);
  uint16_t g[2] = {0x3f80 /* 1.0 */, 0x3b80 /* 2^-8: half an ulp of 1.0 */};
  assert_int_equal(fsdp_add(&g[0], &g[1], FSDP_DTYPE_BF16, 1), 0);
  assert_int_equal(g[0], 0x3f80);
  float f[2] = {INFINITY, -INFINITY};
  assert_int_equal(fsdp_add(&f[0], &f[1], FSDP_DTYPE_FP32, 1), 0);
  assert_true(isnan(f[0]));
  assert_int_equal(fsdp_add(f, f, (fsdp_dtype_t)7, 1), -EINVAL);
  assert_int_equal(fsdp_add(NULL, f, FSDP_DTYPE_FP32, 1), -EINVAL);
  assert_int_equal(fsdp_add(NULL, NULL, FSDP_DTYPE_FP32, 0), 0);
}

static void test_reduce_every_dtype_pair(void **state) {
  (void)state;
  static const unsigned ls[] = {1, 2, 3, 4, 5, 16};
  /* Long enough to cross a block of the kernel; an odd length leaves a tail. */
  size_t n = 4096 + 37;
  for (size_t li = 0; li < sizeof ls / sizeof ls[0]; li++)
    for (int si = 0; si < 3; si++)
      for (int ri = 0; ri < 3; ri++)
        for (int acc = 0; acc < 2; acc++)
          for (size_t s = 0; s < sizeof SCALES / sizeof SCALES[0]; s++)
            check_reduce(NULL, ls[li], TYPES[si], TYPES[ri], acc, SCALES[s],
                         ls[li] == 16 ? 1000 : n, (size_t)(li + si + ri) % 3);
}

/* Sums that leave the reduce type's range or precision: fp16 overflow to Inf, Inf - Inf,
 * fp16 subnormal sums, bf16 rounding of a running sum. */
static void test_reduce_special_sums(void **state) {
  (void)state;
  float a[6] = {60000.0f, INFINITY, 3e-8f, 1.0f, 1e-45f, -0.0f};
  float b[6] = {10000.0f, -INFINITY, 3e-8f, 0.00390625f, 1e-45f, -0.0f};
  const void *srcs[2] = {a, b};
  float d[6];
  assert_int_equal(fsdp_reduce(d, false, srcs, 2, FSDP_DTYPE_FP32, FSDP_DTYPE_FP16, 1, 1, 6), 0);
  assert_true(isinf(d[0]) && d[0] > 0); /* 70000 is beyond fp16 */
  assert_true(isnan(d[1]));
  assert_true(d[2] == 0x1p-23f);    /* 3e-8 rounds to 2^-24 in fp16, twice that is 2^-23 */
  assert_true(d[3] == 1.00390625f); /* 1 + 2^-8 is exact in fp16 */
  assert_int_equal(fbits(d[4]), 0); /* fp32 subnormals vanish in fp16 */
  assert_int_equal(fbits(d[5]), 0x80000000u);
  assert_int_equal(fsdp_reduce(d, false, srcs, 2, FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, 1, 1, 6), 0);
  /* 60000 -> 59904 and 10000 -> 9984 in bf16; their sum 69888 is 136.5 steps of 512,
   * a tie that goes to the even 136 * 512. */
  assert_true(d[0] == 69632.0f);
  assert_true(d[3] == 1.0f); /* 1 + 2^-8 ties to even in bf16 */
  assert_int_equal(fbits(d[4]), 0);
}

/* dst may be an fp32 source itself. */
static void test_reduce_in_place(void **state) {
  (void)state;
  size_t n = 5000;
  float *a = malloc(n * 4), *b = malloc(n * 4), *want = malloc(n * 4);
  assert_non_null(a);
  assert_non_null(b);
  assert_non_null(want);
  fill_values(a, FSDP_DTYPE_FP32, n);
  fill_values(b, FSDP_DTYPE_FP32, n);
  const void *srcs[3] = {b, a, b};
  for (size_t i = 0; i < n; i++)
    want[i] = ref_reduce_one(a[i], true, srcs, 3, FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, 0.5f, 0.25f, i);
  assert_int_equal(fsdp_reduce(a, true, srcs, 3, FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, 0.5f, 0.25f, n),
                   0);
  for (size_t i = 0; i < n; i++)
    assert_true(same_value(fbits(a[i]), fbits(want[i])));
  free(a);
  free(b);
  free(want);
}

/* ---- Worker pool ---- */

typedef struct {
  atomic_uint *hits;
  size_t grain, n_items;
  atomic_uint bad;
} cover_t;

static void cover_chunk(void *arg, size_t begin, size_t end) {
  cover_t *c = arg;
  if (begin >= end || begin % c->grain != 0 || (end % c->grain != 0 && end != c->n_items) ||
      end > c->n_items)
    atomic_fetch_add(&c->bad, 1);
  for (size_t i = begin; i < end && i < c->n_items; i++)
    atomic_fetch_add(&c->hits[i], 1);
}

/* Every index exactly once, boundaries on multiples of grain, for ranges smaller than the
 * thread count and far larger. */
static void test_pool_covers_every_index_once(void **state) {
  (void)state;
  static const unsigned threads[] = {1, 2, 4};
  static const size_t sizes[] = {1, 2, 3, 5, 31, 32, 33, 1000, 100003};
  static const size_t grains[] = {0, 1, 7, 32, 4096};
  atomic_uint *hits = malloc(100003 * sizeof *hits);
  assert_non_null(hits);
  for (size_t ti = 0; ti < 3; ti++) {
    fsdp_workers_t *pool = NULL;
    assert_int_equal(fsdp_workers_new(threads[ti], &pool), 0);
    assert_int_equal(fsdp_workers_count(pool), threads[ti]);
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
      for (size_t gi = 0; gi < sizeof grains / sizeof grains[0]; gi++) {
        cover_t c = {hits, grains[gi] ? grains[gi] : 1, sizes[si], 0};
        for (size_t i = 0; i < sizes[si]; i++)
          atomic_init(&hits[i], 0);
        assert_int_equal(fsdp_workers_for(pool, sizes[si], grains[gi], cover_chunk, &c), 0);
        assert_int_equal(atomic_load(&c.bad), 0);
        for (size_t i = 0; i < sizes[si]; i++)
          if (atomic_load(&hits[i]) != 1)
            fail_msg("%u threads, %zu items, grain %zu: index %zu ran %u times", threads[ti],
                     sizes[si], grains[gi], i, atomic_load(&hits[i]));
      }
    }
    assert_int_equal(fsdp_workers_for(pool, 0, 1, NULL, NULL), 0);
    fsdp_workers_free(pool);
  }
  free(hits);
}

typedef struct {
  atomic_uint arrived;
  unsigned expected;
  atomic_uint timed_out;
} meet_t;

/* Each chunk waits (up to 10 s) until every chunk has started: only possible if they run on
 * different threads at the same time. */
static void meet_chunk(void *arg, size_t begin, size_t end) {
  (void)begin;
  (void)end;
  meet_t *m = arg;
  atomic_fetch_add(&m->arrived, 1);
  int64_t deadline = fsdp_clock_deadline_ms(10000);
  while (atomic_load(&m->arrived) < m->expected) {
    if (fsdp_clock_now_ms() > deadline) {
      atomic_store(&m->timed_out, 1);
      return;
    }
  }
}

static void test_pool_threads_work_together(void **state) {
  (void)state;
  fsdp_workers_t *pool = NULL;
  assert_int_equal(fsdp_workers_new(4, &pool), 0);
  /* 4 items of grain 1 make 4 chunks of one item: one per thread. */
  for (int round = 0; round < 3; round++) {
    meet_t m = {0, 4, 0};
    assert_int_equal(fsdp_workers_for(pool, 4, 1, meet_chunk, &m), 0);
    assert_int_equal(atomic_load(&m.timed_out), 0);
    assert_int_equal(atomic_load(&m.arrived), 4);
  }
  fsdp_workers_free(pool);
}

typedef struct {
  fsdp_workers_t *pool;
  atomic_int nested_result;
} nest_t;

static void nest_chunk(void *arg, size_t begin, size_t end) {
  (void)begin;
  (void)end;
  nest_t *n = arg;
  atomic_store(&n->nested_result, fsdp_workers_for(n->pool, 100, 1, cover_chunk, NULL));
}

static void test_pool_refuses_overlapping_calls(void **state) {
  (void)state;
  fsdp_workers_t *pool = NULL;
  assert_int_equal(fsdp_workers_new(2, &pool), 0);
  nest_t n = {pool, 0};
  assert_int_equal(fsdp_workers_for(pool, 1, 1, nest_chunk, &n), 0);
  assert_int_equal(atomic_load(&n.nested_result), -EBUSY);
  /* The pool still works after refusing. */
  atomic_uint hits[64];
  cover_t c = {hits, 1, 64, 0};
  for (int i = 0; i < 64; i++)
    atomic_init(&hits[i], 0);
  assert_int_equal(fsdp_workers_for(pool, 64, 1, cover_chunk, &c), 0);
  for (int i = 0; i < 64; i++)
    assert_int_equal(atomic_load(&hits[i]), 1);
  fsdp_workers_free(pool);
}

typedef struct {
  atomic_ulong sum;
} sum_t;

static void sum_chunk(void *arg, size_t begin, size_t end) {
  sum_t *s = arg;
  unsigned long local = 0;
  for (size_t i = begin; i < end; i++)
    local += i;
  atomic_fetch_add(&s->sum, local);
}

/* Many small calls in a row: every one complete before the next starts. */
static void test_pool_many_small_calls(void **state) {
  (void)state;
  fsdp_workers_t *pool = NULL;
  assert_int_equal(fsdp_workers_new(4, &pool), 0);
  for (unsigned call = 0; call < 20000; call++) {
    size_t n = 1 + call % 97;
    sum_t s = {0};
    assert_int_equal(fsdp_workers_for(pool, n, 1, sum_chunk, &s), 0);
    assert_int_equal(atomic_load(&s.sum), n * (n - 1) / 2);
  }
  fsdp_workers_free(pool);
}

/* The parallel wrappers give the serial kernels' bits at 1, 2 and 4 threads. */
static void test_parallel_matches_serial(void **state) {
  (void)state;
  size_t n = 1000003;
  float *src32 = malloc(n * 4), *out32 = malloc(n * 4), *ser32 = malloc(n * 4);
  uint16_t *src16 = malloc(n * 2), *out16 = malloc(n * 2), *ser16 = malloc(n * 2);
  assert_non_null(src32);
  assert_non_null(out32);
  assert_non_null(ser32);
  assert_non_null(src16);
  assert_non_null(out16);
  assert_non_null(ser16);
  fill_values(src32, FSDP_DTYPE_FP32, n);
  fill_random_bits(src16, FSDP_DTYPE_BF16, n);
  const void *srcs[4] = {src32, src32 + 1, src32 + 2, src32 + 3};
  static const unsigned threads[] = {1, 2, 4};
  for (size_t ti = 0; ti < 3; ti++) {
    fsdp_workers_t *pool = NULL;
    assert_int_equal(fsdp_workers_new(threads[ti], &pool), 0);

    assert_int_equal(fsdp_cast(ser16, FSDP_DTYPE_FP16, src32, FSDP_DTYPE_FP32, n), 0);
    assert_int_equal(fsdp_cast_parallel(pool, out16, FSDP_DTYPE_FP16, src32, FSDP_DTYPE_FP32, n),
                     0);
    assert_memory_equal(out16, ser16, n * 2);

    assert_int_equal(fsdp_cast(ser32, FSDP_DTYPE_FP32, src16, FSDP_DTYPE_BF16, n), 0);
    assert_int_equal(fsdp_cast_parallel(pool, out32, FSDP_DTYPE_FP32, src16, FSDP_DTYPE_BF16, n),
                     0);
    assert_memory_equal(out32, ser32, n * 4);

    assert_int_equal(fsdp_cast_parallel(pool, out32, FSDP_DTYPE_FP32, src32, FSDP_DTYPE_FP32, n),
                     0);
    assert_memory_equal(out32, src32, n * 4);

    memcpy(ser32, src32, n * 4);
    memcpy(out32, src32, n * 4);
    assert_int_equal(fsdp_reduce(ser32, true, srcs, 4, FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, 0.5f,
                                 0.5f, n - 3),
                     0);
    assert_int_equal(fsdp_reduce_parallel(pool, out32, true, srcs, 4, FSDP_DTYPE_FP32,
                                          FSDP_DTYPE_BF16, 0.5f, 0.5f, n - 3),
                     0);
    assert_memory_equal(out32, ser32, n * 4);

    fsdp_workers_free(pool);
  }
  /* And the reference agrees with a parallel reduce on a misaligned, block-crossing range. */
  fsdp_workers_t *pool = NULL;
  assert_int_equal(fsdp_workers_new(2, &pool), 0);
  check_reduce(pool, 3, FSDP_DTYPE_BF16, FSDP_DTYPE_FP16, true, SCALES[2], 100003, 1);
  fsdp_workers_free(pool);
  free(src32);
  free(out32);
  free(ser32);
  free(src16);
  free(out16);
  free(ser16);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_dtype_helpers),
      cmocka_unit_test(test_bad_arguments),
      cmocka_unit_test(test_every_16_bit_pattern),
      cmocka_unit_test(test_fp32_rounding_boundaries),
      cmocka_unit_test(test_known_values),
      cmocka_unit_test(test_lengths_and_alignment),
      cmocka_unit_test(test_reduce_every_dtype_pair),
      cmocka_unit_test(test_add_every_dtype),
      cmocka_unit_test(test_reduce_special_sums),
      cmocka_unit_test(test_reduce_in_place),
      cmocka_unit_test(test_pool_covers_every_index_once),
      cmocka_unit_test(test_pool_threads_work_together),
      cmocka_unit_test(test_pool_refuses_overlapping_calls),
      cmocka_unit_test(test_pool_many_small_calls),
      cmocka_unit_test(test_parallel_matches_serial),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
