/* The CUDA kernels against the host kernels, bit for bit: every cast between fp32, bf16 and
 * fp16 over every kind of bit pattern (NaNs, infinities, subnormals, values that round
 * across a binade or past the largest finite value), the reduce for every pair of source
 * and reduce dtype, 1 to 5 sources, with and without scaling and accumulation, and the
 * optimizers' steps (AdamW, Adam, SGD, with each flag that changes the work). A computed
 * NaN may differ in its bits (a GPU computes the canonical NaN); it must be a NaN where the
 * host's is one. The sum of squares (a gradient's norm) is the host's within double's
 * rounding, and the same on every run. Needs a GPU: exits 77 (skipped) where the CUDA
 * runtime sees none. */
#include <errno.h>
#include <math.h>
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
#include "kernels/optim.h"

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

/* Bits equal, or both NaNs. */
static void check_same(const float *got, const float *want, const char *what, const char *step) {
  for (size_t i = 0; i < N; i++) {
    uint32_t g, w;
    memcpy(&g, &got[i], 4);
    memcpy(&w, &want[i], 4);
    if (g != w && !(is_nan_bits(g) && is_nan_bits(w)))
      fail_msg("%s: %s element %zu is 0x%08x, the host's 0x%08x", step, what, i, g, w);
  }
}

/* One step on the GPU and on the host from the same arrays: parameters, gradients and
 * state (second moments made non-negative, as steps leave them). */
static void check_optim(fsdp_optim_rule_t rule, const fsdp_optim_hyper_t *h, uint64_t step,
                        bool clip, const char *name) {
  static const char *const names[5] = {"parameter", "gradient", "state 0", "state 1",
                                       "state 2"};
  float *host[5], *got[5];
  void *dev[5];
  for (size_t a = 0; a < 5; a++) {
    host[a] = malloc(N * 4);
    got[a] = malloc(N * 4);
    assert_true(host[a] && got[a]);
    fill_values(host[a], FSDP_DTYPE_FP32);
    for (size_t i = 0; a >= 3 && i < N; i++)
      host[a][i] = fabsf(host[a][i]);
    dev[a] = to_device(host[a], N * 4);
  }
  float *host_state[3] = {host[2], host[3], host[4]};
  float *dev_state[3] = {dev[2], dev[3], dev[4]};
  fsdp_optim_step(rule, h, step, clip, 0.37f, host[0], host[1], host_state, N);
  fsdp_optim_step_t s = fsdp_optim_prepare(rule, h, step, clip, 0.37f);
  fsdp_status_t status;
  assert_int_equal(fsdp_cuda_optim_step(&s, dev[0], dev[1], dev_state, N, 0, &status), 0);
  for (size_t a = 0; a < 5; a++) {
    from_device(got[a], dev[a], N * 4);
    check_same(got[a], host[a], names[a], name);
    cudaFree(dev[a]);
    free(host[a]);
    free(got[a]);
  }
}

static void test_every_optimizer_step_gives_the_host_bits(void **state) {
  (void)state;
  const fsdp_optim_hyper_t adamw = {.lr = 1e-3, .weight_decay = 0.01, .beta1 = 0.9,
                                    .beta2 = 0.999, .eps = 1e-8};
  fsdp_optim_hyper_t h = adamw;
  for (int clip = 0; clip < 2; clip++) {
    check_optim(FSDP_OPTIM_RULE_ADAMW, &adamw, 1, clip, "AdamW, step 1");
    check_optim(FSDP_OPTIM_RULE_ADAMW, &adamw, 7, clip, "AdamW, step 7");
    h = adamw;
    h.amsgrad = true;
    h.maximize = true;
    check_optim(FSDP_OPTIM_RULE_ADAMW, &h, 3, clip, "AdamW, amsgrad, maximize");
    h = adamw;
    h.weight_decay = 0.1;
    check_optim(FSDP_OPTIM_RULE_ADAM, &h, 2, clip, "Adam, weight decay");
    h.weight_decay = 0;
    check_optim(FSDP_OPTIM_RULE_ADAM, &h, 2, clip, "Adam");
    const fsdp_optim_hyper_t sgd = {.lr = 0.05, .momentum = 0.9, .dampening = 0.1,
                                    .weight_decay = 1e-4};
    check_optim(FSDP_OPTIM_RULE_SGD, &sgd, 1, clip, "SGD, momentum, first step");
    check_optim(FSDP_OPTIM_RULE_SGD, &sgd, 4, clip, "SGD, momentum");
    h = sgd;
    h.dampening = 0;
    h.nesterov = true;
    check_optim(FSDP_OPTIM_RULE_SGD, &h, 4, clip, "SGD, nesterov");
    h = sgd;
    h.momentum = 0;
    h.weight_decay = 0;
    check_optim(FSDP_OPTIM_RULE_SGD, &h, 1, clip, "SGD, plain");
  }
}

static void test_the_sum_of_squares_is_the_hosts_and_the_same_every_run(void **state) {
  (void)state;
  float *x = malloc(N * 4);
  assert_non_null(x);
  double want = 0;
  for (size_t i = 0; i < N; i++) {
    x[i] = (float)(int32_t)next_bits() / 2147483648.0f * 3.0f;
    want += (double)x[i] * x[i];
  }
  void *dx = to_device(x, N * 4);
  double *partials = NULL;
  assert_int_equal(cudaMalloc((void **)&partials, (FSDP_CUDA_SUM_PARTIALS + 1) * sizeof(double)),
                   cudaSuccess);
  double got[2];
  for (int run = 0; run < 2; run++) {
    fsdp_status_t status;
    assert_int_equal(fsdp_cuda_sum_squares(dx, N, partials, 0, &status), 0);
    from_device(&got[run], partials + FSDP_CUDA_SUM_PARTIALS, sizeof got[run]);
  }
  assert_memory_equal(&got[0], &got[1], sizeof got[0]);
  assert_true(fabs(got[0] - want) <= 1e-12 * want);
  cudaFree(partials);
  cudaFree(dx);
  free(x);
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
      cmocka_unit_test(test_every_optimizer_step_gives_the_host_bits),
      cmocka_unit_test(test_the_sum_of_squares_is_the_hosts_and_the_same_every_run),
      cmocka_unit_test(test_bad_arguments_queue_nothing),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
