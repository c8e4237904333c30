/* The trainer's side of fsdpd: a session for one (job, local rank), the job's shared memory
 * mapped into the process, and the operations on registered units.
 *
 * A trainer process attaches once per local rank it drives (usually one), through a client
 * of <fsdp/fsdp_client.h> connected to the daemon's unix socket. Attaching opens the session
 * (Trainer.Attach), then the memory channel (proto/fsdp/v1/channel.proto): the daemon checks
 * the process's credentials, hands over the job's memory as file descriptors, and the
 * library maps it once: the buffers the trainer writes, and the unsharded buffers in a second
 * mapping, which the daemon sealed so that it can only be read. The channel stays open for
 * the session's life: if the process dies, the daemon ends the session at once.
 *
 * Units are registered with their parameters; every local rank must register the same spec.
 * The returned view points into the mapping: the fp32 master shards (write your own shard:
 * initial values, optimizer steps) and the fp32 gradient shards (ReduceScatter writes them).
 * The daemon lends the rest from bounded pools, per operation, and the view follows: the
 * unsharded copy from Unshard until Reshard (or the Unshard of a newer step), and, from an
 * Unshard for the backward until the unit's ReduceScatter completes, this rank's
 * full-gradient buffer (write it before ReduceScatter). Pointers into a lent buffer are
 * valid only while it is lent: the pool gives it to another unit after.
 *
 * Threads: a trainer is used by one thread at a time, like its client; the client must
 * outlive the trainer. Every call has a deadline (the client's default unless given).
 * Errors: negative fsdp_error codes or -errno; fsdp_client_last_error() has the daemon's
 * message. */
#ifndef FSDP_TRAINER_H
#define FSDP_TRAINER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <fsdp/fsdp_client.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fsdp_trainer fsdp_trainer_t;
typedef struct fsdp_unit_handle fsdp_unit_handle_t;

/* Element types (the protocol's DType). */
typedef enum fsdp_scalar {
  FSDP_SCALAR_DEFAULT = 0, /* param_type: the parameters' own; reduce_type: param_type */
  FSDP_SCALAR_FP32 = 1,
  FSDP_SCALAR_BF16 = 2,
  FSDP_SCALAR_FP16 = 3,
} fsdp_scalar_t;

/* Sharding strategies (the protocol's ShardingStrategy). */
typedef enum fsdp_strategy {
  FSDP_FULL_SHARD = 1,
  FSDP_SHARD_GRAD_OP = 2,
  FSDP_HYBRID_SHARD = 3,
  FSDP_NO_SHARD = 4,
} fsdp_strategy_t;

/* How a unit's parameters lie in its shards (the protocol's UnitLayout): FSDP1's flat
 * parameter cut into equal shards, or FSDP2's pieces, each parameter cut on dim 0 into
 * ceil(dim0 / shards) rows per shard. The unsharded copy holds the parameters one after the
 * other either way. */
typedef enum fsdp_layout {
  FSDP_LAYOUT_FLAT = 0,
  FSDP_LAYOUT_PER_PARAM = 1,
} fsdp_layout_t;

typedef struct fsdp_trainer_options {
  const char *job;           /* 1 to 64 of [A-Za-z0-9._-] */
  unsigned local_rank;       /* in [0, local_world_size) */
  unsigned local_world_size; /* the same for every rank of the job */
  /* Which run of the job this is, the same for all its ranks on every host: trainers that
   * restart after a failure attach with a higher one (torchrun's TORCHELASTIC_RESTART_COUNT),
   * so that the collectives among hosts of the new run never meet messages the failed run
   * left behind. 0 for a job that is never restarted. */
  uint64_t generation;
  /* NULL or "": none. A secret the job's launcher hands every trainer of the job (up to 256
   * bytes): the first trainer's fixes it, and the daemon refuses another, so that jobs whose
   * trainers run as one uid are kept apart too (different uids always are). */
  const char *job_token;
  /* The launcher's view of the world (torchrun's WORLD_SIZE and GROUP_RANK); world_size 0:
   * none. The daemon refuses the attach unless its topology is the same: world_size ranks
   * in all, this host the node_rank-th of hosts of local_world_size ranks. */
  unsigned world_size;
  unsigned node_rank;
} fsdp_trainer_options_t;

typedef struct fsdp_param_desc {
  const char *name;
  const uint64_t *shape; /* ndim sizes; ndim 0 is a scalar */
  size_t ndim;
  bool requires_grad;
} fsdp_param_desc_t;

typedef struct fsdp_unit_desc {
  const char *name;
  const fsdp_param_desc_t *params; /* fp32 parameters, in flattening order */
  size_t n_params;
  fsdp_strategy_t strategy;
  fsdp_scalar_t param_type;  /* the unsharded copy's type */
  fsdp_scalar_t reduce_type; /* the gradient reduction's type */
  double gradient_predivide_factor;  /* 0: default */
  double gradient_postdivide_factor; /* 0: default */
  /* The caller's own unit (a scratch buffer for its collectives), not the model's:
   * checkpoints leave it out and the job's step is counted without it. */
  bool scratch;
  fsdp_layout_t layout;
} fsdp_unit_desc_t;

/* Which pass an Unshard serves: the backward's also lends the rank a full-gradient buffer. */
typedef enum fsdp_pass {
  FSDP_PASS_FORWARD = 0,
  FSDP_PASS_BACKWARD = 1,
} fsdp_pass_t;

/* Where a registered unit lives in this process. Element counts; pointers into the mapping. */
typedef struct fsdp_unit_view {
  uint64_t numel;        /* the parameters' elements */
  uint64_t padded_numel; /* shard_numel times the shard count: the shards side by side */
  uint64_t shard_numel;
  unsigned shard;        /* the shard this rank holds */
  const uint64_t *param_offsets; /* element offset of each parameter in the unsharded copy */
  size_t n_params;
  /* padded_numel of param_type, lent from Unshard until Reshard; NULL otherwise */
  const void *unsharded;
  /* The fp32 master and gradient shards of this host: host_shards shards, shard s at
   * master + (s - host_first_shard) * shard_numel. On one host, host_first_shard is 0 and
   * the host holds every shard. */
  float *master;
  float *grad;
  unsigned host_first_shard;
  unsigned host_shards;
  /* this rank's padded_numel of param_type, lent from an Unshard for the backward until
   * the unit's ReduceScatter completes; NULL otherwise */
  void *full_grad;
  /* As of registration: the newest step whose gather / reduce-scatter completed on the
   * unit, 0 before the first (a trainer that attaches again finds its masters trained). */
  uint64_t gathered_step;
  uint64_t reduced_step;
  /* Which copy of its shard this rank holds among all ranks holding it (HYBRID_SHARD's
   * replicas, NO_SHARD's every rank); 0 for the first. */
  unsigned replica;
  /* The daemon's optimizer state of this host's shards, from fsdp_trainer_set_optimizer on
   * (NULL before, and for a unit without gradients): its step count, and optimizer_arrays
   * fp32 arrays laid out like `master` (Adam, AdamW: exp_avg, exp_avg_sq, then
   * max_exp_avg_sq with amsgrad; SGD: the momentum buffer). A trainer may read them, and
   * write them while no step runs (load_state_dict). */
  uint64_t *optimizer_steps;
  float *optimizer_state[3];
  unsigned optimizer_arrays;
  /* FSDP_LAYOUT_PER_PARAM (NULL for FLAT): where each parameter's piece lies in every shard,
   * and its rows per shard: shard s holds the parameter's rows from s times that, the rows
   * past its last being padding. A rank's piece of parameter i is
   * master + (shard - host_first_shard) * shard_numel + param_shard_offsets[i]. */
  fsdp_layout_t layout;
  const uint64_t *param_shard_offsets;
  const uint64_t *param_rows_per_shard;
} fsdp_unit_view_t;

/* How the daemon runs the job's units (Trainer.SetSchedule); every local rank sets the same,
 * and the last one set is the job's. */
typedef struct fsdp_unit_schedule {
  const fsdp_unit_handle_t *unit;
  /* Whether the unit lets go of its copy after its forward (FSDP's reshard_after_forward),
   * so that its copies come from the job's pool, under max_inflight; a unit that keeps its
   * copy until its backward (the root) has one of its own. Default: FULL_SHARD and
   * HYBRID_SHARD units do. */
  bool reshard_after_forward;
} fsdp_unit_schedule_t;

typedef struct fsdp_schedule {
  /* The copies of units that reshard after forward the job's ranks hold at once, and the
   * full-gradient buffers of such units each rank holds (FSDP's limit_all_gathers), 1 to
   * 64; 0 keeps the job's (the daemon's store.max_inflight when it was made). */
  unsigned max_inflight;
  const fsdp_unit_schedule_t *units; /* registered units; the others keep their default */
  size_t n_units;
  /* The units in the order the forward runs them, each at most once; none: the daemon
   * records it from the steps (local rank 0's forward Unshards). The backward is its
   * reverse. */
  fsdp_unit_handle_t *const *forward_order;
  size_t n_forward_order;
  /* How many units the daemon gathers ahead (0 to 64) on every rank's behalf: after a
   * rank's forward Unshard the next ones in the forward order, after its backward's the
   * previous ones with gradients (FSDP's BACKWARD_PRE). With either set, a rank's Unshard of
   * step s says that all its master shards are final for s. */
  unsigned forward_prefetch;
  unsigned backward_prefetch;
} fsdp_schedule_t;

/* The optimizer the daemon runs over the job's master shards (Trainer.SetOptimizer), with
 * torch.optim's formulas. */
typedef enum fsdp_optim_kind {
  FSDP_OPTIM_ADAMW = 1,
  FSDP_OPTIM_ADAM = 2,
  FSDP_OPTIM_SGD = 3,
} fsdp_optim_kind_t;

/* torch's param_group: hyperparameters for some of the job's original parameters, by the
 * names their units registered; a group naming none takes those no other group names. */
typedef struct fsdp_param_group {
  const char *const *params;
  size_t n_params;
  double lr, weight_decay;
  bool maximize;
  double beta1, beta2, eps; /* Adam, AdamW */
  bool amsgrad;
  double momentum, dampening; /* SGD */
  bool nesterov;
} fsdp_param_group_t;

typedef struct fsdp_optim {
  fsdp_optim_kind_t kind;
  const fsdp_param_group_t *groups;
  size_t n_groups;
  /* > 0: each step first clips the gradient by its global norm, as clip_grad_norm_ would;
   * the units of a step are then stepped once every one's reduce wrote its gradient, and
   * those reduces return after the steps: start them (fsdp_trainer_reduce_scatter_start),
   * then wait. */
  double max_grad_norm;
} fsdp_optim_t;

/* A checkpoint of the trainer's job on this host (docs/DESIGN.md, "Checkpoints"), written by
 * the daemon into dir/step-N/ (dir absolute, the daemon's user writes it): every unit's
 * masters and the daemon optimizer's state as they are, so call it between steps, once every
 * local rank's optimizer step is done (one rank calls it). N: step, or when 0 the least
 * step its trainable units completed a reduce of; *ret_step (may be NULL): N. */
int fsdp_trainer_save_checkpoint(fsdp_trainer_t *trainer, const char *dir, uint64_t step,
                                 uint64_t *ret_step);

/* Reads dir (a step directory, or the newest complete one under it) into the job's
 * registered units, which must be laid out as saved (the same units and local world size);
 * *ret_step: its step, after which the trainers go on. Between steps, one rank. */
int fsdp_trainer_load_checkpoint(fsdp_trainer_t *trainer, const char *dir, uint64_t *ret_step);

/* Attaches for opts->job and opts->local_rank: the session, the memory channel, the mapping.
 * client is borrowed and must outlive the trainer. */
int fsdp_trainer_attach(fsdp_client_t *client, const fsdp_trainer_options_t *opts,
                        fsdp_trainer_t **ret_trainer);

/* Detaches (the daemon keeps the job's units and memory for a later attach), unmaps and
 * frees the trainer; its unit handles go with it. NULL-safe. Returns the Detach's result;
 * the trainer is freed either way. */
int fsdp_trainer_detach(fsdp_trainer_t *trainer);

uint64_t fsdp_trainer_session_id(const fsdp_trainer_t *trainer);

/* The job's read-write memory as mapped here (masters, gradients), and its size. The
 * unsharded buffers are in a second, read-only mapping, reached through the unit views. */
void *fsdp_trainer_memory(const fsdp_trainer_t *trainer, size_t *ret_size);

/* Where the job's memory is, and so every pointer of the unit views: -1, host memory; d,
 * memory of CUDA device d (a daemon whose backend is cuda), mapped in the device's primary
 * context, which the CUDA runtime and PyTorch use. Device pointers are then read and written
 * by the trainer's kernels only, and the daemon must read what they wrote after they ran:
 * name the stream they run on with fsdp_trainer_set_cuda_stream, or synchronize it before
 * each unit operation. The replies come after the daemon's own work has ended, so what it
 * wrote is there for any kernel queued after a call returns. */
int fsdp_trainer_memory_device(const fsdp_trainer_t *trainer);

/* A job on a GPU: the CUDA stream (a cudaStream_t or CUstream; NULL: the legacy default
 * stream) that the trainer's kernels run on, until set again. Each unit operation then
 * records one of the session's CUDA IPC events on it before its request, and the daemon's
 * work for the request waits for it on the GPU: no thread of either side waits for the
 * other's kernels, and a started Unshard overlaps the compute queued after it.
 * FAILED_PRECONDITION, saying why, when the session has no events (host memory,
 * FSDP_CUDA_EVENTS=off, or a daemon that sent none): synchronize instead. */
int fsdp_trainer_set_cuda_stream(fsdp_trainer_t *trainer, void *stream);

/* Renews the session's lease; trainers idle longer than the lease call it. */
int fsdp_trainer_keepalive(fsdp_trainer_t *trainer);

/* Registers a unit (waiting while the daemon prepares its buffers) and returns a handle owned
 * by the trainer; registering the same spec again returns the same handle. */
int fsdp_trainer_register_unit(fsdp_trainer_t *trainer, const fsdp_unit_desc_t *desc,
                               fsdp_unit_handle_t **ret_unit);

/* The view of a registered unit; valid while the trainer lives. */
const fsdp_unit_view_t *fsdp_unit_view(const fsdp_unit_handle_t *unit);

/* Gathers the unit for this rank; returns once view->unsharded holds the step (and, for the
 * backward pass, view->full_grad is lent). */
int fsdp_trainer_unshard(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit, uint64_t step,
                         fsdp_pass_t pass);

/* Lets go of the unsharded copy (view->unsharded becomes NULL). */
int fsdp_trainer_reshard(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit, uint64_t step);

/* How a reduce treats the gradient shards: fsdp_trainer_reduce_scatter's flags, or 0. */
enum {
  FSDP_REDUCE_ACCUMULATE = 1u << 0, /* add to the gradient shards instead of writing them */
  /* Gradient accumulation with HYBRID_SHARD (FSDP2's set_requires_all_reduce(False)): reduce
   * among the shard group only and keep the sum, without writing the shards; the next reduce
   * without this flag adds it to its own before the all-reduce among the replicas and writes
   * the shards, adding to them only if every reduce since had FSDP_REDUCE_ACCUMULATE. One
   * all-reduce among hosts per accumulated step instead of one per micro-batch. No effect on
   * a unit without replicas on other hosts. Every local rank passes the same flags. */
  FSDP_REDUCE_DEFER_ALL_REDUCE = 1u << 1,
  /* Then the daemon steps the unit's master shards with the job's optimizer
   * (fsdp_trainer_set_optimizer), and the reduce returns after the step: the last
   * micro-batch's reduces of a step ask for it. */
  FSDP_REDUCE_STEP_OPTIMIZER = 1u << 2,
  /* The step alone, with no gradient: FSDP_REDUCE_STEP_OPTIMIZER's step over what the
   * gradient shards hold, once earlier reduces (those of the backwards since the last step)
   * wrote them; the rank holds no full-gradient buffer. torch's opt.step(). Implies
   * FSDP_REDUCE_STEP_OPTIMIZER; not with the other flags. */
  FSDP_REDUCE_STEP_ONLY = 1u << 3,
};

/* Submits this rank's full gradient (view->full_grad, lent by an Unshard for the backward)
 * and returns once every local rank's is reduced into the gradient shards (AllReduce for
 * NO_SHARD units); the buffer goes back to the pool (view->full_grad becomes NULL). flags:
 * FSDP_REDUCE_* (true still means FSDP_REDUCE_ACCUMULATE). */
int fsdp_trainer_reduce_scatter(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit,
                                uint64_t step, unsigned flags);

/* Sets the job's schedule. */
int fsdp_trainer_set_schedule(fsdp_trainer_t *trainer, const fsdp_schedule_t *schedule);

/* Sets the job's optimizer in the daemon, or its hyperparameters once set (an LR schedule
 * calls it each step, before the step's reduces): the kind and each group's parameters stay
 * as first set. Reduces with FSDP_REDUCE_STEP_OPTIMIZER step the units with it. The views of
 * the trainer's trainable units then show their optimizer state. */
int fsdp_trainer_set_optimizer(fsdp_trainer_t *trainer, const fsdp_optim_t *optim);

/* Unshard and ReduceScatter started now and waited for later (prefetch; a reduce that does
 * not hold up the backward): at most one started operation per unit; fsdp_trainer_wait()
 * returns its result and updates the view (timeout_ms <= 0: the client's default). Until
 * then other operations on the unit fail with -EBUSY; a wait that runs out cancels the
 * operation (FSDP_E_DEADLINE_EXCEEDED), and detach cancels one still started. */
int fsdp_trainer_unshard_start(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit,
                               uint64_t step, fsdp_pass_t pass);
int fsdp_trainer_reduce_scatter_start(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit,
                                      uint64_t step, unsigned flags);
int fsdp_trainer_wait(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit, int timeout_ms);

#ifdef __cplusplus
}
#endif
#endif
