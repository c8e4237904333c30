/* Optimizer steps: one straight loop per combination of the flags that change the work
 * (clipping, weight decay added to the gradient, amsgrad, momentum), each vectorized by the
 * compiler and cloned per instruction set (kernels/clones.h); fmaf where torch fuses
 * (kernels/optim.h). What only changes a value is one: maximize flips the sign bit, AdamW's
 * decay and Adam's lack of it are a factor (1 is exact). */
#include "kernels/optim.h"

#include <math.h>
#include <string.h>

#include "kernels/clones.h"
#include "kernels/elements.h"

#define INLINE static inline __attribute__((always_inline))

/* The step's fp32 coefficients, rounded once from torch's Python doubles. */
typedef struct coefficients {
  uint32_t sign; /* 0x80000000 with maximize: the gradient's sign bit is flipped */
  float clip_coef;
  float decay;        /* AdamW: 1 - lr * weight_decay; else 1 */
  float weight_decay; /* Adam, SGD: added to the gradient times the parameter */
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float bias_correction2_sqrt, eps, neg_step_size;
  float momentum, one_minus_dampening, neg_lr;
} coefficients_t;

static coefficients_t coefficients(fsdp_optim_rule_t rule, const fsdp_optim_hyper_t *h,
                                   uint64_t step, float clip_coef) {
  double bias_correction1 = 1 - pow(h->beta1, (double)step);
  double bias_correction2 = 1 - pow(h->beta2, (double)step);
  return (coefficients_t){
      .sign = h->maximize ? 0x80000000u : 0u,
      .clip_coef = clip_coef,
      .decay = rule == FSDP_OPTIM_RULE_ADAMW ? (float)(1 - h->lr * h->weight_decay) : 1.0f,
      .weight_decay = (float)h->weight_decay,
      .beta1 = (float)h->beta1,
      .one_minus_beta1 = (float)(1 - h->beta1),
      .beta2 = (float)h->beta2,
      .one_minus_beta2 = (float)(1 - h->beta2),
      .bias_correction2_sqrt = (float)sqrt(bias_correction2),
      .eps = (float)h->eps,
      .neg_step_size = (float)-(h->lr / bias_correction1),
      .momentum = (float)h->momentum,
      .one_minus_dampening = (float)(1 - h->dampening),
      .neg_lr = (float)-h->lr,
  };
}

/* The gradient element as the step uses it: clipped (and stored so), its sign flipped with
 * maximize. */
INLINE float gradient(float *g, size_t i, const coefficients_t *c, bool clip) {
  float x = g[i];
  if (clip) {
    x = x * c->clip_coef;
    g[i] = x;
  }
  return fsdp_float_of(fsdp_bits_of(x) ^ c->sign);
}

/* torch.maximum: the larger, or a NaN when either is one. */
INLINE float maximum(float a, float b) {
  return (a > b || a != a) ? a : b;
}

INLINE void adam_loop(const coefficients_t *c, bool clip, bool coupled_decay, bool amsgrad,
                      float *restrict p, float *restrict g, float *restrict m,
                      float *restrict v, float *restrict vmax, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float gi = gradient(g, i, c, clip);
    float pi = p[i] * c->decay;
    if (coupled_decay)
      gi = fmaf(pi, c->weight_decay, gi);
    float mi = fmaf(gi, c->one_minus_beta1, m[i] * c->beta1);
    float vi = fmaf(gi * c->one_minus_beta2, gi, v[i] * c->beta2);
    m[i] = mi;
    v[i] = vi;
    if (amsgrad) {
      vi = maximum(vmax[i], vi);
      vmax[i] = vi;
    }
    float denom = sqrtf(vi) / c->bias_correction2_sqrt + c->eps;
    p[i] = pi + c->neg_step_size * mi / denom;
  }
}

KERNEL static void adam_kernel(const coefficients_t *c, bool clip, bool coupled_decay,
                               bool amsgrad, float *p, float *g, float *m, float *v,
                               float *vmax, size_t n) {
  /* Each combination its own loop, the flags constant in it. */
  switch ((clip ? 4 : 0) | (coupled_decay ? 2 : 0) | (amsgrad ? 1 : 0)) {
#define ADAM_CASE(k, a, b, d)                                                                 \
  case k:                                                                                     \
    adam_loop(c, a, b, d, p, g, m, v, vmax, n);                                               \
    break;
    ADAM_CASE(0, false, false, false)
    ADAM_CASE(1, false, false, true)
    ADAM_CASE(2, false, true, false)
    ADAM_CASE(3, false, true, true)
    ADAM_CASE(4, true, false, false)
    ADAM_CASE(5, true, false, true)
    ADAM_CASE(6, true, true, false)
    ADAM_CASE(7, true, true, true)
#undef ADAM_CASE
  default:
    break;
  }
}

/* torch's SGD. momentum: 0 none, 1 the first step (the buffer is a copy of the decayed
 * gradient), 2 a later one. */
INLINE void sgd_loop(const coefficients_t *c, bool clip, bool decay, int momentum,
                     bool nesterov, float *restrict p, float *restrict g, float *restrict buf,
                     size_t n) {
  for (size_t i = 0; i < n; i++) {
    float d = gradient(g, i, c, clip);
    if (decay)
      d = fmaf(p[i], c->weight_decay, d);
    if (momentum) {
      float b = momentum == 1 ? d : fmaf(d, c->one_minus_dampening, buf[i] * c->momentum);
      buf[i] = b;
      d = nesterov ? fmaf(b, c->momentum, d) : b;
    }
    p[i] = fmaf(d, c->neg_lr, p[i]);
  }
}

KERNEL static void sgd_kernel(const coefficients_t *c, bool clip, bool decay, int momentum,
                              bool nesterov, float *p, float *g, float *buf, size_t n) {
  /* Each combination its own loop, the flags constant in it. */
#define SGD_KEY(a, b, m, d) ((((a) * 2 + (b)) * 3 + (m)) * 2 + (d))
  switch (SGD_KEY(clip, decay, momentum, nesterov)) {
#define SGD_CASE(a, b, m, d)                                                                  \
  case SGD_KEY(a, b, m, d):                                                                   \
    sgd_loop(c, a, b, m, d, p, g, buf, n);                                                    \
    break;
#define SGD_CASES(a, b)                                                                       \
  SGD_CASE(a, b, 0, false)                                                                    \
  SGD_CASE(a, b, 1, false)                                                                    \
  SGD_CASE(a, b, 1, true)                                                                     \
  SGD_CASE(a, b, 2, false)                                                                    \
  SGD_CASE(a, b, 2, true)
    SGD_CASES(false, false)
    SGD_CASES(false, true)
    SGD_CASES(true, false)
    SGD_CASES(true, true)
#undef SGD_CASES
#undef SGD_CASE
#undef SGD_KEY
  default: /* no momentum: nesterov needs it */
    break;
  }
}

void fsdp_optim_step(fsdp_optim_rule_t rule, const fsdp_optim_hyper_t *h, uint64_t step,
                     bool clip, float clip_coef, float *p, float *g, float *const state[3],
                     size_t n) {
  coefficients_t c = coefficients(rule, h, step, clip_coef);
  if (rule == FSDP_OPTIM_RULE_SGD)
    sgd_kernel(&c, clip, h->weight_decay != 0, h->momentum == 0 ? 0 : step == 1 ? 1 : 2,
               h->momentum != 0 && h->nesterov, p, g, state[0], n);
  else
    adam_kernel(&c, clip, rule == FSDP_OPTIM_RULE_ADAM && h->weight_decay != 0, h->amsgrad, p,
                g, state[0], state[1], state[2], n);
}
