/* The optimizer the daemon runs over a job's fp32 master shards (Trainer.SetOptimizer).
 *
 * Why here: the daemon owns the shards, so it owns their optimizer too. The state then
 * outlives a crashed trainer, a checkpoint needs no trainer, and each unit is stepped as soon
 * as its gradient shards are written, on the daemon's workers, while the trainers still run
 * the backward of earlier units.
 *
 * A job's optimizer is a kind and its groups: torch's param_groups, each a set of the job's
 * original parameter names with hyperparameters. The first SetOptimizer fixes the kind and
 * which parameters each group holds; later ones change the hyperparameters only (an LR
 * schedule sends one per step). Each trainable unit gets its state on first need: one block
 * of the job's arena beside its masters, a step count and then fp32 arrays of the host's
 * shard length (fsdp_optimizer_state_t says which), which trainers map to read or write
 * (state_dict). A parameter's elements are stepped with its group's hyperparameters; the
 * padding is never stepped.
 *
 * This is the configuration and the state's place; the data plane runs the steps from a
 * plan (fsdp_optimizer_plan_t) through the job's backend (daemon/backend/backend.h), on the
 * host's workers or on the GPU that holds the job. Loop thread only, but for the runs. */
#ifndef FSDP_DATAPLANE_OPTIMIZER_H
#define FSDP_DATAPLANE_OPTIMIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "daemon/backend/backend.h"
#include "daemon/store/store.h"
#include "kernels/optim.h"

typedef enum fsdp_optimizer_kind {
  FSDP_OPTIMIZER_NONE = 0,
  FSDP_OPTIMIZER_ADAMW = 1,
  FSDP_OPTIMIZER_ADAM = 2,
  FSDP_OPTIMIZER_SGD = 3,
} fsdp_optimizer_kind_t;

/* One param_group, as SetOptimizer gives it. */
typedef struct fsdp_optimizer_group {
  const char *const *params; /* original parameter names; none: those no group names */
  size_t n_params;
  fsdp_optim_hyper_t hyper;
} fsdp_optimizer_group_t;

/* Where a unit's state is in its job's arena. */
typedef struct fsdp_optimizer_state {
  uint64_t steps_offset;  /* the uint64 step count */
  uint64_t arrays_offset; /* the first fp32 array of the host's shard length */
  unsigned arrays;        /* Adam(W): exp_avg, exp_avg_sq (and max_exp_avg_sq); SGD: momentum */
  uint64_t array_stride;  /* bytes from one array to the next */
} fsdp_optimizer_state_t;

/* Sets the job's optimizer, or its hyperparameters when it has one: checked whole first (st
 * names the field and the value: INVALID_ARGUMENT for a value torch refuses, a parameter
 * named twice or not registered, a change of kind or of a group's parameters), then made
 * the job's, with the state of its registered trainable units made ready. */
int fsdp_optimizer_set(fsdp_job_t *job, fsdp_optimizer_kind_t kind,
                       const fsdp_optimizer_group_t *groups, size_t n_groups,
                       double max_grad_norm, fsdp_status_t *st);

/* The norm the job's gradient is clipped to before each step; 0: no clipping. */
double fsdp_optimizer_max_grad_norm(const fsdp_job_t *job);

/* Whether the job's optimizer steps some of the unit's elements on this host (a trainable
 * unit whose parameters a group names): the units a step's clipping waits for. */
bool fsdp_optimizer_steps_unit(fsdp_job_t *job, const fsdp_unit_t *u);

/* Whether the job has an optimizer. */
bool fsdp_optimizer_is_set(const fsdp_job_t *job);

/* Its kind's name, as the .proto spells it ("ADAMW"); "" without one. */
const char *fsdp_optimizer_kind_name(const fsdp_job_t *job);

/* The unit's state, made on first need (RESOURCE_EXHAUSTED when the arena is full); fails
 * without an optimizer or for a unit without gradients. */
int fsdp_optimizer_unit_state(fsdp_job_t *job, fsdp_unit_t *u, fsdp_optimizer_state_t *ret,
                              fsdp_status_t *st);

/* The unit's optimizer step count, 0 before the first or without state. */
uint64_t fsdp_optimizer_unit_steps(const fsdp_job_t *job, const fsdp_unit_t *u);

/* Bytes of optimizer state the job holds. */
size_t fsdp_optimizer_state_bytes(const fsdp_job_t *job);

/* A step of a unit is pieces of this host's shards, the parameters' elements there, padding
 * left out (daemon/store/unit_layout.h): elements [begin, end) of the host's arrays, with
 * group `group`'s hyperparameters. */
typedef struct fsdp_optimizer_piece {
  uint64_t begin, end;
  unsigned group;
} fsdp_optimizer_piece_t;

/* What one step of a unit needs on a pool thread, taken on the loop as it starts: the
 * hyperparameters are a copy (a SetOptimizer meanwhile changes the next step's), the pieces
 * stay as they are while the job lives. */
typedef struct fsdp_optimizer_plan {
  fsdp_optimizer_kind_t kind;
  /* The unit's step count in the job's memory, which the run reads and counts up (trainers
   * write it too: a state_dict loaded), and the count the run stepped with: 1 the first. */
  uint64_t *steps;
  uint64_t step;
  const fsdp_optimizer_piece_t *pieces;
  size_t n_pieces;
  fsdp_optimizer_group_t *groups; /* owned; their params are not copied */
  size_t n_groups;
  float *master, *grad;
  float *state[3]; /* the state arrays, as fsdp_optimizer_state_t orders them */
  /* With clipping: the gradient shards are multiplied by it first (and keep the result, as
   * clip_grad_norm_ leaves them). */
  bool clip;
  float clip_coef;
} fsdp_optimizer_plan_t;

/* Plans the unit's next step, making its state on first need. */
int fsdp_optimizer_plan(fsdp_job_t *job, fsdp_unit_t *u, fsdp_optimizer_plan_t *ret_plan,
                        fsdp_status_t *st);
void fsdp_optimizer_plan_cleanup(fsdp_optimizer_plan_t *plan); /* NULL-safe plans and groups */

/* On a pool thread: counts the unit's step and runs it, piece by piece, through the
 * backend. */
int fsdp_optimizer_run(fsdp_optimizer_plan_t *plan, const fsdp_backend_t *backend,
                       fsdp_status_t *st);

/* On the loop: the unit's step count as a run counted it (whether or not the step then
 * succeeded) or a checkpoint load wrote it. What fsdpctl shows of a GPU's job, whose count
 * the loop cannot read (a trainer's own write of it shows from its next step). */
void fsdp_optimizer_stepped(fsdp_job_t *job, const fsdp_unit_t *u, uint64_t step);

/* On a pool thread: the sum of the squares of the unit's gradient shards on this host, in
 * double (fsdp_backend_sum_squares: the same sum on every run), in *ret. */
int fsdp_optimizer_grad_norm_sq(const fsdp_job_t *job, const fsdp_unit_t *u,
                                const fsdp_backend_t *backend, double *ret, fsdp_status_t *st);


#endif
