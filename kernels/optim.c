/* Optimizer steps: one straight loop per combination of the flags that change the work
 * (clipping, weight decay added to the gradient, amsgrad, momentum) over the element
 * arithmetic of kernels/optim_elements.h, each vectorized by the compiler and cloned per
 * instruction set (kernels/clones.h). What only changes a value is one: maximize flips the
 * sign bit, AdamW's decay and Adam's lack of it are a factor (1 is exact). */
#include "kernels/optim.h"

#include <math.h>

#include "kernels/clones.h"

#define INLINE static inline __attribute__((always_inline))

fsdp_optim_step_t fsdp_optim_prepare(fsdp_optim_rule_t rule, const fsdp_optim_hyper_t *h,
                                     uint64_t step, bool clip, float clip_coef) {
  double bias_correction1 = 1 - pow(h->beta1, (double)step);
  double bias_correction2 = 1 - pow(h->beta2, (double)step);
  float lerp_weight = (float)(1 - h->beta1);
  bool lerp_small = fabsf(lerp_weight) < 0.5f;
  bool sgd = rule == FSDP_OPTIM_RULE_SGD;
  return (fsdp_optim_step_t){
      .rule = rule,
      .clip = clip,
      .coupled_decay = rule == FSDP_OPTIM_RULE_ADAM && h->weight_decay != 0,
      .amsgrad = !sgd && h->amsgrad,
      .decay = sgd && h->weight_decay != 0,
      .momentum = !sgd || h->momentum == 0 ? 0 : step == 1 ? 1 : 2,
      .nesterov = sgd && h->momentum != 0 && h->nesterov,
      .sign = h->maximize ? 0x80000000u : 0u,
      .clip_coef = clip_coef,
      .decay_factor = rule == FSDP_OPTIM_RULE_ADAMW ? (float)(1 - h->lr * h->weight_decay) : 1.0f,
      .weight_decay = (float)h->weight_decay,
      .lerp_small = lerp_small,
      .lerp_weight = lerp_small ? lerp_weight : lerp_weight - 1.0f,
      .beta2 = (float)h->beta2,
      .one_minus_beta2 = (float)(1 - h->beta2),
      .bias_correction2_sqrt = (float)pow(bias_correction2, 0.5),
      .eps = (float)h->eps,
      .neg_step_size = (float)-(h->lr / bias_correction1),
      .momentum_factor = (float)h->momentum,
      .one_minus_dampening = (float)(1 - h->dampening),
      .neg_lr = (float)-h->lr,
  };
}

/* The loops take the flags as constants: the step is copied with them set, so that each
 * inlined copy is specialized (and vectorized) for its combination. */
INLINE void adam_loop(const fsdp_optim_step_t *step, bool clip, bool coupled_decay,
                      bool amsgrad, float *restrict p, float *restrict g, float *restrict m,
                      float *restrict v, float *restrict vmax, size_t n) {
  fsdp_optim_step_t s = *step;
  s.clip = clip;
  s.coupled_decay = coupled_decay;
  s.amsgrad = amsgrad;
  for (size_t i = 0; i < n; i++)
    fsdp_optim_adam_element(&s, p, g, m, v, vmax, i);
}

KERNEL static void adam_kernel(const fsdp_optim_step_t *s, float *p, float *g, float *m,
                               float *v, float *vmax, size_t n) {
  /* Each combination its own loop, the flags constant in it. */
  switch ((s->clip ? 4 : 0) | (s->coupled_decay ? 2 : 0) | (s->amsgrad ? 1 : 0)) {
#define ADAM_CASE(k, a, b, d)                                                                 \
  case k:                                                                                     \
    adam_loop(s, a, b, d, p, g, m, v, vmax, n);                                               \
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

INLINE void sgd_loop(const fsdp_optim_step_t *step, bool clip, bool decay, int momentum,
                     bool nesterov, float *restrict p, float *restrict g, float *restrict buf,
                     size_t n) {
  fsdp_optim_step_t s = *step;
  s.clip = clip;
  s.decay = decay;
  s.momentum = momentum;
  s.nesterov = nesterov;
  for (size_t i = 0; i < n; i++)
    fsdp_optim_sgd_element(&s, p, g, buf, i);
}

KERNEL static void sgd_kernel(const fsdp_optim_step_t *s, float *p, float *g, float *buf,
                              size_t n) {
  /* Each combination its own loop, the flags constant in it. */
#define SGD_KEY(a, b, m, d) ((((a) * 2 + (b)) * 3 + (m)) * 2 + (d))
  switch (SGD_KEY(s->clip, s->decay, s->momentum, s->nesterov)) {
#define SGD_CASE(a, b, m, d)                                                                  \
  case SGD_KEY(a, b, m, d):                                                                   \
    sgd_loop(s, a, b, m, d, p, g, buf, n);                                                    \
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

void fsdp_optim_run(const fsdp_optim_step_t *s, float *p, float *g, float *const state[3],
                    size_t n) {
  if (s->rule == FSDP_OPTIM_RULE_SGD)
    sgd_kernel(s, p, g, state[0], n);
  else
    adam_kernel(s, p, g, state[0], state[1], state[2], n);
}

void fsdp_optim_step(fsdp_optim_rule_t rule, const fsdp_optim_hyper_t *h, uint64_t step,
                     bool clip, float clip_coef, float *p, float *g, float *const state[3],
                     size_t n) {
  fsdp_optim_step_t s = fsdp_optim_prepare(rule, h, step, clip, clip_coef);
  fsdp_optim_run(&s, p, g, state, n);
}
