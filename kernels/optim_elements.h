/* The optimizers' element arithmetic (kernels/optim.h says whose numbers): one element of a
 * step of each rule, given the step's fp32 coefficients. One definition for the host's
 * cloned loops (optim.c) and the CUDA backend's kernel (cuda/), which compiles this header
 * as host-and-device code: every product, sum, quotient and square root rounds on its own,
 * and fmaf is the one fused multiply-add where torch fuses (the host builds without
 * contraction, the device with --fmad=false and IEEE division and square root). */
#ifndef FSDP_KERNELS_OPTIM_ELEMENTS_H
#define FSDP_KERNELS_OPTIM_ELEMENTS_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/elements.h"

typedef enum fsdp_optim_rule {
  FSDP_OPTIM_RULE_ADAMW, /* weight decay decoupled: param *= 1 - lr * weight_decay */
  FSDP_OPTIM_RULE_ADAM,  /* weight decay added to the gradient */
  FSDP_OPTIM_RULE_SGD,   /* momentum, dampening, nesterov, weight decay added */
} fsdp_optim_rule_t;

/* One step of a rule over arrays: its fp32 coefficients, rounded once from torch's Python
 * doubles (fsdp_optim_prepare), and the flags that change the work. */
typedef struct fsdp_optim_step {
  fsdp_optim_rule_t rule;
  bool clip;          /* each gradient element is first multiplied by clip_coef, stored so */
  bool coupled_decay; /* Adam: weight decay added to the gradient */
  bool amsgrad;       /* Adam, AdamW */
  bool decay;         /* SGD: weight decay added to the gradient */
  int momentum;       /* SGD: 0 none, 1 the first step (the buffer starts as d), 2 later */
  bool nesterov;      /* SGD, with momentum */
  uint32_t sign;      /* 0x80000000 with maximize: the gradient's sign bit is flipped */
  float clip_coef;
  float decay_factor; /* AdamW: 1 - lr * weight_decay; else 1 */
  float weight_decay; /* Adam, SGD: added to the gradient times the parameter */
  bool lerp_small;    /* Adam, AdamW: 1 - beta1 < 0.5, torch.lerp's choice of its two forms */
  float lerp_weight;  /* Adam, AdamW: 1 - beta1 when lerp_small, else (1 - beta1) - 1 */
  float beta2, one_minus_beta2;
  float bias_correction2_sqrt, eps, neg_step_size;
  float momentum_factor, one_minus_dampening, neg_lr;
} fsdp_optim_step_t;

/* The gradient element as the step uses it: clipped (and stored so), its sign flipped with
 * maximize. */
FSDP_ELEMENT float fsdp_optim_gradient(const fsdp_optim_step_t *s, float *g, size_t i) {
  float x = g[i];
  if (s->clip) {
    x = x * s->clip_coef;
    g[i] = x;
  }
  return fsdp_float_of(fsdp_bits_of(x) ^ s->sign);
}

/* torch.maximum: the larger, or a NaN when either is one. */
FSDP_ELEMENT float fsdp_optim_maximum(float a, float b) {
  return (a > b || a != a) ? a : b;
}

/* exp_avg.lerp_(grad, w = 1 - beta1) as torch's CPU kernel (ATen's lerp_vec) computes it:
 * below a weight of 0.5 from the start, m + w * (g - m), else from the end,
 * g + (w - 1) * (g - m), each one fused multiply-add (the scalar form for a loop's tail is
 * contracted into the same). */
FSDP_ELEMENT float fsdp_optim_lerp(const fsdp_optim_step_t *s, float m, float g) {
  return fmaf(s->lerp_weight, g - m, s->lerp_small ? m : g);
}

/* Element i of Adam's or AdamW's step: m exp_avg, v exp_avg_sq, vmax max_exp_avg_sq. */
FSDP_ELEMENT void fsdp_optim_adam_element(const fsdp_optim_step_t *s, float *p, float *g,
                                          float *m, float *v, float *vmax, size_t i) {
  float gi = fsdp_optim_gradient(s, g, i);
  float pi = p[i] * s->decay_factor;
  if (s->coupled_decay)
    gi = fmaf(pi, s->weight_decay, gi);
  float mi = fsdp_optim_lerp(s, m[i], gi);
  float vi = fmaf(gi * s->one_minus_beta2, gi, v[i] * s->beta2);
  m[i] = mi;
  v[i] = vi;
  if (s->amsgrad) {
    vi = fsdp_optim_maximum(vmax[i], vi);
    vmax[i] = vi;
  }
  float denom = sqrtf(vi) / s->bias_correction2_sqrt + s->eps;
  p[i] = pi + s->neg_step_size * mi / denom;
}

/* Element i of SGD's step: buf the momentum buffer. */
FSDP_ELEMENT void fsdp_optim_sgd_element(const fsdp_optim_step_t *s, float *p, float *g,
                                         float *buf, size_t i) {
  float d = fsdp_optim_gradient(s, g, i);
  if (s->decay)
    d = fmaf(p[i], s->weight_decay, d);
  if (s->momentum) {
    float b = s->momentum == 1 ? d : fmaf(d, s->one_minus_dampening, buf[i] * s->momentum_factor);
    buf[i] = b;
    d = s->nesterov ? fmaf(b, s->momentum_factor, d) : b;
  }
  p[i] = fmaf(d, s->neg_lr, p[i]);
}

#endif
