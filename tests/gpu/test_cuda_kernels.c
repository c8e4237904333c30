/* The CUDA kernels against the host kernels, bit for bit: every cast between fp32, bf16 and
 * fp16 over every kind of bit pattern (NaNs, infinities, subnormals, values that round
 * across a binade or past the largest finite value), and the reduce for every pair of
 * source and reduce dtype, 1 to 5 sources, with and without scaling and accumulation. A
 * reduce's NaN may differ in its bits (a GPU computes the canonical NaN); it must be a NaN
 * where the host's is one. Needs a GPU: exits 77 (skipped) where the CUDA runtime sees none. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>

#include "cuda/kernels.h"
#include "kernels/kernels.h"

#define N 100003 /* odd, and more elements than one wave of blocks covers */

static uint64_t rng = 0x9e3779b97f4a7c15u;

static uint32_t next_bits(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (uint32_t)rng;
}

/* Random bit patterns, with the edges every conversion must get right in front. */
static void fill_patterns(void *buf, fsdp_dtype_t t) {
  static const uint32_t f32_edges[] = {0x00000000, 0x80000000, 0x7f800000, 0xff800000,
                                       0x7fc00001, 0xffbfffff, 0x00000001, 0x807fffff,
                                       0x477fefff, 0x477ff000, 0x7f7fffff, 0x3f808000,
                                       0x3f818000, 0x33800000, 0x387fe000, 0x38800000};
  static const uint16_t h16_edges[] = {0x0000, 0x8000, 0x7c00, 0xfc00, 0x7c01, 0x7e00,
                                       0x0001, 0x83ff, 0x7f80, 0x7f81, 0xff80, 0x0080};
  size_t n_edges = t == FSDP_DTYPE_FP32 ? sizeof f32_edges / 4 : sizeof h16_edges / 2;
  for (size_t i = 0; i < N; i++) {
    uint32_t bits = next_bits();
    if (t == FSDP_DTYPE_FP32)
      ((uint32_t *)buf)[i] = i < n_edges ? f32_edges[i] : bits;
    else
      ((uint16_t *)buf)[i] = i < n_edges ? h16_edges[i] : (uint16_t)bits;
  }
}

/* Finite values of moderate size in t, so that sums mostly stay finite, with a few specials. */
static void fill_values(void *buf, fsdp_dtype_t t) {
  float *tmp = malloc(N * sizeof *tmp);
  assert_non_null(tmp);
  for (size_t i = 0; i < N; i++) {
    int32_t r = (int32_t)next_bits();
    tmp[i] = (float)r / 2147483648.0f * 300.0f;
  }
  uint32_t specials[] = {0x7fc00000u, 0x7f800000u, 0xff800000u, 0x00000001u};
  for (size_t k = 0; k < 4; k++)
    memcpy(&tmp[1000 + k * 7919], &specials[k], 4);
  assert_int_equal(fsdp_cast(buf, t, tmp, FSDP_DTYPE_FP32, N), 0);
  free(tmp);
}

static void *to_device(const void *host, size_t bytes) {
  void *d = NULL;
  assert_int_equal(cudaMalloc(&d, bytes), cudaSuccess);
  assert_int_equal(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

static void from_device(void *host, const void *d, size_t bytes) {
  assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
  assert_int_equal(cudaMemcpy(host, d, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

static const fsdp_dtype_t types[] = {FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, FSDP_DTYPE_FP16};

static void test_every_cast_gives_the_host_bits(void **state) {
  (void)state;
  for (size_t s = 0; s < 3; s++) {
    for (size_t d = 0; d < 3; d++) {
      fsdp_dtype_t st = types[s], dt = types[d];
      size_t in_bytes = N * fsdp_dtype_size(st), out_bytes = N * fsdp_dtype_size(dt);
      void *src = malloc(in_bytes), *want = malloc(out_bytes), *got = malloc(out_bytes);
      assert_true(src && want && got);
      fill_patterns(src, st);
      assert_int_equal(fsdp_cast(want, dt, src, st, N), 0);
      void *dsrc = to_device(src, in_bytes), *ddst = NULL;
      assert_int_equal(cudaMalloc(&ddst, out_bytes), cudaSuccess);
      size_t es = fsdp_dtype_size(dt);
      /* From element `off` on: 0 takes the vector accesses, 1 the element-wise path. */
      for (size_t off = 0; off < 2; off++) {
        fsdp_status_t status;
        assert_int_equal(fsdp_cuda_cast((char *)ddst + off * es, dt,
                                         (char *)dsrc + off * fsdp_dtype_size(st), st, N - off,
                                         0, &status),
                         0);
        from_device(got, ddst, out_bytes);
        for (size_t i = off; i < N; i++)
          if (memcmp((char *)got + i * es, (char *)want + i * es, es) != 0)
            fail_msg("cast %s -> %s from element %zu: element %zu differs from the host's",
                     fsdp_dtype_name(st), fsdp_dtype_name(dt), off, i);
      }
      cudaFree(dsrc);
      cudaFree(ddst);
      free(src);
      free(want);
      free(got);
    }
  }
}

static bool is_nan_bits(uint32_t u) {
  return (u & 0x7fffffffu) > 0x7f800000u;
}

/* From element `off` of every buffer: 0 takes the vector accesses, 1 the element-wise path. */
static void check_reduce(fsdp_dtype_t st, fsdp_dtype_t rt, unsigned n_srcs, bool accumulate,
                         float pre, float post, size_t off) {
  size_t es = fsdp_dtype_size(st);
  void *srcs[5], *dsrcs[5];
  for (unsigned k = 0; k < n_srcs; k++) {
    srcs[k] = malloc(N * es);
    assert_non_null(srcs[k]);
    fill_values(srcs[k], st);
    dsrcs[k] = to_device(srcs[k], N * es);
  }
  float *base = malloc(N * 4), *want = malloc(N * 4), *got = malloc(N * 4);
  assert_true(base && want && got);
  fill_values(base, FSDP_DTYPE_FP32);
  memcpy(want, base, N * 4);
  assert_int_equal(fsdp_reduce(want, accumulate, (const void *const *)srcs, n_srcs, st, rt, pre,
                               post, N),
                   0);
  float *ddst = to_device(base, N * 4);
  const void *from[5];
  for (unsigned k = 0; k < n_srcs; k++)
    from[k] = (const char *)dsrcs[k] + off * es;
  fsdp_status_t status;
  assert_int_equal(fsdp_cuda_reduce(ddst + off, accumulate, from, n_srcs, st, rt, pre, post,
                                    N - off, 0, &status),
                   0);
  from_device(got, ddst, N * 4);
  for (size_t i = off; i < N; i++) {
    uint32_t g, w;
    memcpy(&g, &got[i], 4);
    memcpy(&w, &want[i], 4);
    if (g != w && !(is_nan_bits(g) && is_nan_bits(w)))
      fail_msg("reduce %s in %s, %u sources, accumulate %d, scales %g %g, from element %zu: "
               "element %zu is 0x%08x, the host's 0x%08x",
               fsdp_dtype_name(st), fsdp_dtype_name(rt), n_srcs, accumulate, (double)pre,
               (double)post, off, i, g, w);
  }
  for (unsigned k = 0; k < n_srcs; k++) {
    cudaFree(dsrcs[k]);
    free(srcs[k]);
  }
  cudaFree(ddst);
  free(base);
  free(want);
  free(got);
}

static void test_every_reduce_gives_the_host_bits(void **state) {
  (void)state;
  static const float scales[][2] = {{1.0f, 1.0f}, {0.5f, 0.25f}, {1.0f / 3, 1.0f / 7}};
  for (size_t s = 0; s < 3; s++)
    for (size_t r = 0; r < 3; r++)
      for (unsigned n_srcs = 1; n_srcs <= 5; n_srcs += 2)
        for (int accumulate = 0; accumulate < 2; accumulate++)
          for (size_t k = 0; k < 3; k++)
            for (size_t off = 0; off < 2; off++)
              check_reduce(types[s], types[r], n_srcs, accumulate, scales[k][0], scales[k][1],
                           off);
}

static void test_bad_arguments_queue_nothing(void **state) {
  (void)state;
  fsdp_status_t status;
  float *d = NULL;
  assert_int_equal(cudaMalloc((void **)&d, 64), cudaSuccess);
  const void *srcs[1] = {d};
  assert_int_equal(fsdp_cuda_reduce(d, false, srcs, 0, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32, 1, 1, 4,
                                    0, &status),
                   -EINVAL);
  assert_int_equal(fsdp_cuda_reduce(d, false, srcs, 1, FSDP_DTYPE_FP32, FSDP_DTYPE_FP32,
                                    1.0f / 0.0f, 1, 4, 0, &status),
                   -EINVAL);
  assert_int_equal(fsdp_cuda_cast(d, (fsdp_dtype_t)7, d, FSDP_DTYPE_FP32, 4, 0, &status), -EINVAL);
  cudaFree(d);
}

int main(void) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    printf("skipped: no GPU (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "none seen");
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_cast_gives_the_host_bits),
      cmocka_unit_test(test_every_reduce_gives_the_host_bits),
      cmocka_unit_test(test_bad_arguments_queue_nothing),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
