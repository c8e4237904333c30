/* The optimizer step kernels (kernels/optim.h) against a scalar reference written from
 * torch 2.13's single-tensor formulas as its x86-64 kernels round them (fmaf where torch
 * fuses; exp_avg by torch.lerp's rule; the square root IEEE's), bit for bit: every rule and flag
 * (clipping, maximize, weight decay, amsgrad, momentum, dampening, nesterov), beta1 on both
 * sides of lerp's switch, three steps so that the state is read back, odd lengths and
 * unaligned starts (the vector loops' edges), and a range stepped in pieces equal to the
 * range stepped whole (the daemon splits a unit over its workers). This file is compiled
 * without FMA contraction, as the kernels are. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/optim.h"

#define N 1037

typedef struct arrays {
  float p[N + 1], g[N + 1], s0[N + 1], s1[N + 1], s2[N + 1];
} arrays_t;

static uint32_t rng = 12345;

static float next_value(void) {
  rng = rng * 1664525u + 1013904223u;
  return ((float)(rng >> 8) / (float)(1u << 24) - 0.5f) * 4.0f;
}

static void fill(arrays_t *a) {
  for (size_t i = 0; i < N + 1; i++) {
    a->p[i] = next_value();
    a->g[i] = next_value();
    a->s0[i] = a->s1[i] = a->s2[i] = 0;
  }
}

/* The formulas, element by element. */
static void reference(fsdp_optim_rule_t rule, const fsdp_optim_hyper_t *h, uint64_t step,
                      bool clip, float coef, float *p, float *g, float *const s[3], size_t n) {
  float bc2s = (float)pow(1 - pow(h->beta2, (double)step), 0.5); /* Python's ** 0.5 */
  float neg_step = (float)-(h->lr / (1 - pow(h->beta1, (double)step)));
  for (size_t i = 0; i < n; i++) {
    if (clip)
      g[i] = g[i] * coef;
    float gi = h->maximize ? -g[i] : g[i];
    if (rule == FSDP_OPTIM_RULE_SGD) {
      if (h->weight_decay != 0)
        gi = fmaf(p[i], (float)h->weight_decay, gi);
      if (h->momentum != 0) {
        s[0][i] = step == 1 ? gi
                            : fmaf(gi, (float)(1 - h->dampening), s[0][i] * (float)h->momentum);
        gi = h->nesterov ? fmaf(s[0][i], (float)h->momentum, gi) : s[0][i];
      }
      p[i] = fmaf(gi, (float)-h->lr, p[i]);
      continue;
    }
    if (rule == FSDP_OPTIM_RULE_ADAMW)
      p[i] = p[i] * (float)(1 - h->lr * h->weight_decay);
    else if (h->weight_decay != 0)
      gi = fmaf(p[i], (float)h->weight_decay, gi);
    /* exp_avg.lerp_(grad, 1 - beta1): ATen's lerp, from the start below a weight of 0.5,
     * from the end above it, each one fused multiply-add. */
    float w = (float)(1 - h->beta1);
    s[0][i] = fabsf(w) < 0.5f ? fmaf(w, gi - s[0][i], s[0][i]) : fmaf(w - 1, gi - s[0][i], gi);
    s[1][i] = fmaf(gi * (float)(1 - h->beta2), gi, s[1][i] * (float)h->beta2);
    float second = s[1][i];
    if (h->amsgrad) {
      s[2][i] = s[2][i] > second ? s[2][i] : second;
      second = s[2][i];
    }
    float denom = sqrtf(second) / bc2s + (float)h->eps;
    p[i] = p[i] + neg_step * s[0][i] / denom;
  }
}

static void assert_same(const arrays_t *a, const arrays_t *b, const char *what) {
  if (memcmp(a, b, sizeof *a) != 0)
    fail_msg("%s: the kernel differs from the formulas", what);
}

static void check(fsdp_optim_rule_t rule, const fsdp_optim_hyper_t *h, bool clip,
                  const char *what) {
  for (size_t offset = 0; offset < 2; offset++) { /* aligned, then one float in */
    arrays_t *got = calloc(1, sizeof *got), *want = calloc(1, sizeof *want);
    assert_true(got && want);
    fill(got);
    memcpy(want, got, sizeof *got);
    size_t n = N - offset;
    for (uint64_t step = 1; step <= 3; step++) {
      float coef = 0.75f / (float)step;
      float *gs[3] = {got->s0 + offset, got->s1 + offset, got->s2 + offset};
      float *ws[3] = {want->s0 + offset, want->s1 + offset, want->s2 + offset};
      if (step == 2) { /* in pieces, as the workers step a unit */
        for (size_t at = 0; at < n; at += 100) {
          size_t len = n - at < 100 ? n - at : 100;
          float *ps[3] = {gs[0] + at, gs[1] + at, gs[2] + at};
          fsdp_optim_step(rule, h, step, clip, coef, got->p + offset + at,
                          got->g + offset + at, ps, len);
        }
      } else {
        fsdp_optim_step(rule, h, step, clip, coef, got->p + offset, got->g + offset, gs, n);
      }
      reference(rule, h, step, clip, coef, want->p + offset, want->g + offset, ws, n);
      assert_same(got, want, what);
    }
    free(got);
    free(want);
  }
}

static void test_adam_and_adamw(void **state) {
  (void)state;
  for (int rule = FSDP_OPTIM_RULE_ADAMW; rule <= FSDP_OPTIM_RULE_ADAM; rule++)
    for (int flags = 0; flags < 32; flags++) {
      /* beta1 0.3: lerp's weight 0.7, its other form */
      fsdp_optim_hyper_t h = {.lr = 1e-2, .beta1 = (flags & 16) ? 0.3 : 0.9, .beta2 = 0.999,
                              .eps = 1e-8,
                              .weight_decay = (flags & 1) ? 0.1 : 0.0,
                              .amsgrad = flags & 2, .maximize = flags & 4};
      check((fsdp_optim_rule_t)rule, &h, flags & 8,
            rule == FSDP_OPTIM_RULE_ADAMW ? "AdamW" : "Adam");
    }
}

static void test_sgd(void **state) {
  (void)state;
  for (int flags = 0; flags < 32; flags++) {
    fsdp_optim_hyper_t h = {.lr = 0.1, .weight_decay = (flags & 1) ? 1e-2 : 0.0,
                            .momentum = (flags & 2) ? 0.9 : 0.0,
                            .dampening = (flags & 4) ? 0.1 : 0.0, .maximize = flags & 8};
    h.nesterov = h.momentum != 0 && h.dampening == 0 && (flags & 16);
    check(FSDP_OPTIM_RULE_SGD, &h, flags & 16, "SGD");
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_adam_and_adamw),
      cmocka_unit_test(test_sgd),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
