/* Optimizer steps over fp32 arrays: torch 2.13's AdamW, Adam and SGD (its single-tensor
 * path, which torch.optim takes for CPU tensors by default), for the daemon's optimizer
 * (daemon/dataplane/optimizer.h). torch 1.13's arithmetic is no longer followed: it formed
 * exp_avg as mul_(beta1).add_(grad), where 2.x takes lerp_.
 *
 * Numbers: torch's own, bit for bit, as its x86-64 CPU kernels (AVX2, AVX-512) compute
 * them, but for the square root, which is IEEE's (sqrtf) here, as in torch's CUDA kernels:
 * the x86-64 wheels take a CPU tensor's sqrt from MKL, one ulp off for about a sixth of fp32
 * values and by CPU (tests/integration/ieee_sqrt.py). The coefficients torch computes in
 * Python doubles (1 - lr * weight_decay, the bias corrections, the step size,
 * bias_correction2 ** 0.5) are computed here in double the same way and rounded to fp32
 * once, as torch does with a Python scalar. Per element, in torch's order: what torch fuses
 * is one fused multiply-add (fmaf, rounded once: its vectorized `add(x, alpha=a)` and
 * lerp are Vectorized::fmadd, and its addcmul's a + v*t1*t2 is contracted into one); every
 * other product, sum, quotient and square root rounds to fp32 on its own.
 * The loops are compiled for several instruction sets (kernels/clones.h) with contraction
 * off and each fusion explicit, so every x86-64 CPU gives the same bits (a CPU without FMA
 * gets them from libm's fmaf, slower).
 *
 * Threads and memory: no state; any thread may step disjoint ranges of the same arrays at
 * once (the daemon splits a unit over its worker pool). */
#ifndef FSDP_KERNELS_OPTIM_H
#define FSDP_KERNELS_OPTIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/optim_elements.h"

/* A param_group's hyperparameters, as torch holds them (doubles). */
typedef struct fsdp_optim_hyper {
  double lr, weight_decay;
  bool maximize;
  double beta1, beta2, eps; /* Adam, AdamW */
  bool amsgrad;
  double momentum, dampening; /* SGD */
  bool nesterov;
} fsdp_optim_hyper_t;

/* Step number `step` (1 for the first) of the rule with h's hyperparameters, clipping the
 * gradients by clip_coef first when clip: its coefficients and flags, for fsdp_optim_run or
 * a device's kernel. */
fsdp_optim_step_t fsdp_optim_prepare(fsdp_optim_rule_t rule, const fsdp_optim_hyper_t *h,
                                     uint64_t step, bool clip, float clip_coef);

/* The step over n elements of the parameters p with the gradients g, and the state: Adam
 * and AdamW state[0] exp_avg, state[1] exp_avg_sq, state[2] max_exp_avg_sq (amsgrad only);
 * SGD state[0] the momentum buffer (read from the second step on). With clip, each gradient
 * element is first multiplied by clip_coef and stored back (as clip_grad_norm_ leaves
 * .grad). The arrays must not overlap. */
void fsdp_optim_run(const fsdp_optim_step_t *s, float *p, float *g, float *const state[3],
                    size_t n);

/* fsdp_optim_prepare, then fsdp_optim_run. */
void fsdp_optim_step(fsdp_optim_rule_t rule, const fsdp_optim_hyper_t *h, uint64_t step,
                     bool clip, float clip_coef, float *p, float *g, float *const state[3],
                     size_t n);

#endif
