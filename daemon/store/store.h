/* The parameter store's registry: jobs and their units.
 *
 * A job is created by the first RegisterUnit or memory channel of any of its ranks, with
 * its two arenas, belongs to that trainer's uid and job token (Attach lets no other in),
 * and outlives its trainers' sessions: parameters stay in the daemon when a trainer dies,
 * so that it can attach again and go on.
 *
 * Memory and slots. A job's arenas are sized once (memory.job_limit each) and every local
 * rank holds descriptors to them, so whatever a trainer does it can make at most their
 * capacity resident (daemon/store/arena.h): the capacities, not the bytes allocated, are what
 * the store reserves against memory.limit, when the job is created. A job that nothing
 * refers to any more (retained for store.job_retention after its last session) never
 * keeps a new job out: when a new job needs a slot or memory and none is free, the
 * retained job that went idle first is freed to make room; only jobs in use count against
 * the limits.
 *
 * A unit is registered by every local rank of its job with the same spec; the first
 * registration fixes the spec and the layout, a later one either matches it (and only
 * records that the rank registered) or is refused naming the first differing field, both
 * values and both ranks.
 *
 * Owned by the daemon, loop thread only. */
#ifndef FSDP_STORE_H
#define FSDP_STORE_H

#include <stdbool.h>
#include <stdint.h>

#include "collectives/local.h"
#include "collectives/rank_set.h"
#include "common/status.h"
#include "daemon/backend/backend.h"
#include "daemon/session/sessions.h"
#include "daemon/store/arena.h"
#include "daemon/store/pool.h"
#include "daemon/store/staging.h"
#include "daemon/store/topology.h"
#include "daemon/store/unit_layout.h"

/* An operation waiting on a unit (daemon/dataplane/dataplane.h). */
typedef struct fsdp_dataplane_op fsdp_dataplane_op_t;

/* Where a unit's buffers are (daemon/dataplane/dataplane.h moves it along). */
typedef enum fsdp_unit_state {
  FSDP_UNIT_NEW,        /* registered, no buffers yet */
  FSDP_UNIT_ALLOCATING, /* buffers taken from the arena, being pre-faulted */
  FSDP_UNIT_READY,      /* buffers ready for unshards and reductions */
  FSDP_UNIT_FAILED,     /* buffers could not be made ready; see `error` */
} fsdp_unit_state_t;

typedef struct fsdp_unit {
  struct fsdp_job *job;   /* the owner */
  uint32_t id;            /* its place among the job's units, in registration order */
  int order_index;        /* its place in the job's forward order, -1 outside it */
  bool trainable;         /* some parameter requires its gradient */
  fsdp_unit_spec_t *spec; /* private copy; owned */
  fsdp_unit_plan_t plan; /* shards across hosts, and the rings of its collectives */
  fsdp_unit_layout_t layout;
  float pre_scale, post_scale; /* the reduction's, from the gradient divide factors */
  fsdp_unit_state_t state;
  fsdp_status_t error;        /* why FAILED */
  uint64_t buffers_offset;    /* the arena block holding the persistent buffers */
  uint64_t master_offset;     /* these in the job's arena; master and grad: this host's */
  uint64_t grad_offset;
  /* The unsharded copy, lent to the ranks in `holders` (daemon/dataplane/dataplane.h).
   * copy_in_masters: the param dtype is fp32 and this host holds every shard, so the masters
   * themselves are the copy: nothing is gathered or held. Otherwise, while has_copy, the
   * copy is at copy_offset of the shared arena: from the job's pool (copy_pooled) when it
   * was gathered for a unit that reshards after forward, else a block of its own; it holds
   * `gathered_step` once `gathered` (`gathered_again`: the step's second gather, for the
   * backward), and goes back when the last holder lets go. */
  bool copy_in_masters;
  bool reshard_after_forward; /* the schedule's (SetSchedule), or the strategy's default */
  bool copy_pooled;
  bool has_copy;
  uint64_t copy_offset;
  fsdp_pool_waiter_t copy_waiter; /* a gather waiting for a pool buffer; data: the data plane */
  fsdp_rank_set_t holders;
  bool gathered;
  bool gathered_again;
  uint64_t gathered_step;
  /* Each local rank's full-gradient buffer (arena offsets), lent by the backward's Unshard
   * until the unit's ReduceScatter ends; local_world_size of them. From the ranks' pools
   * (grads_pooled) for a unit resharded after forward, else blocks of their own. */
  uint64_t *full_grad_offsets;
  fsdp_rank_set_t grads_lent;
  bool grads_pooled;
  /* The local ranks' rendezvous (collectives/local.h): the gather of a step, and its
   * reduce-scatter. */
  fsdp_collection_t gather;
  bool gather_ahead; /* the gather was the schedule's prefetch, not the ranks' asking */
  bool gather_after_resume; /* the gather waits for the job's checkpoint to be loaded */
  fsdp_collection_t reduce;
  bool reduce_accumulate;
  /* HYBRID_SHARD's gradient accumulation (FSDP2's set_requires_all_reduce(False)): a reduce
   * that defers its all-reduce among replicas (reduce_defer) adds this host's region of the
   * shard group's sum, in reduce_dtype, to a block of the arena at deferred_offset (held
   * while has_deferred), instead of writing the gradient shards; the next reduce that does
   * not defer adds the block to its sum before the all-reduce and writes the shards, adding
   * to them only if it and every deferred reduce asked to accumulate (deferred_accumulate).
   * A reduce that fails while using the block drops it. The block belongs to the run (generation) whose reduces made it: another run's first
   * reduce drops it. */
  bool reduce_defer;
  bool reduce_step; /* the running reduce steps the masters after (step_optimizer) */
  uint64_t stepped_step; /* the newest step whose reduce stepped the masters; 0: none */
  /* With clipping by the global norm: the running reduce wrote its gradient shards and
   * waits for every other trainable unit's of the step; norm_sq is its shards' part. */
  bool awaiting_norm;
  double norm_sq;
  uint64_t norm_deadline_ms; /* by which the others must have come */
  bool has_deferred;
  unsigned n_deferred;
  uint64_t deferred_offset;
  uint64_t deferred_generation;
  bool deferred_accumulate;
  uint64_t replica_all_reduces; /* all-reduces among replicas run, for fsdpctl unit */
  /* What the data plane's own work of the last gather (this host's cast) and the last
   * one-host reduce took, in microseconds, kernels and their completion: for fsdpctl unit. */
  uint64_t last_gather_us, last_reduce_us;
  /* Across hosts, while the reduce's rings run (has_sum): the host's sum of its ranks'
   * gradients, lent by the job's pool of sums, at sum_offset of the arena. */
  bool has_sum;
  uint64_t sum_offset;
  fsdp_pool_waiter_t sum_waiter; /* a reduce waiting for a pool buffer; data: the data plane */
  /* A backend that stages the rings (fsdp_backend_t.stages_rings): the host buffers of the
   * job's staging its collectives across hosts hold while they run: the gather's copy of
   * the unsharded buffer, the reduce's of the host sum (in reduce_dtype), and, while
   * has_deferred, the deferred sum itself, which then lives there and not in the arena. */
  fsdp_staging_buffer_t *gather_stage, *sum_stage, *deferred_stage;
  uint64_t reduced_step; /* of the last reduce-scatter that completed */
  /* Its ranks have all asked its reduce, which waits for the job's reduces to be let go
   * (fsdp_dataplane_hold_reduces), in the job's held_reduces through held_next. */
  bool reduce_held;
  struct fsdp_unit *held_next;
  /* Operations waiting until a collection or the buffers' preparation ends. */
  fsdp_dataplane_op_t *waiters;
  uint32_t first_rank;       /* the rank whose registration fixed the spec */
  fsdp_rank_set_t registered;
  unsigned n_registered;
  struct fsdp_unit *next;
} fsdp_unit_t;

typedef struct fsdp_job {
  char name[FSDP_JOB_NAME_MAX + 1];
  uint32_t local_world_size;
  /* The bounded pools (daemon/store/pool.h), capped at max_inflight: the unsharded copies
   * of units that reshard after forward, in shared_arena, each local rank's full-gradient
   * buffers (local_world_size pools) and the host sums of reduces across hosts, in arena. */
  unsigned max_inflight;
  fsdp_pool_t copies;
  fsdp_pool_t *grad_pools;
  fsdp_pool_t sums;
  const fsdp_backend_t *backend; /* whose memory the arenas are: the store's */
  fsdp_staging_t staging; /* host buffers of the rings, where the backend stages them */
  fsdp_job_owner_t owner; /* of the session that created it: whom Attach lets in */
  /* The memory every local rank maps, made on first need, owned: the unsharded buffers in
   * `shared_arena`, sealed so that trainers can only map it read-only, and every other
   * buffer in `arena`, which trainers map read-write. */
  fsdp_arena_t *arena;
  fsdp_arena_t *shared_arena;
  fsdp_unit_t *units; /* in registration order */
  fsdp_unit_t **units_tail;
  unsigned n_units;
  fsdp_unit_t **units_by_id; /* unit i's id is i (its place in registration order) */
  unsigned units_by_id_capacity;
  /* The schedule the daemon runs (SetSchedule; daemon/dataplane/dataplane.h says how). The
   * forward order, n_order units (each unit's order_index is its place, -1 outside it):
   * given, or recorded from local rank 0's forward Unshards of each step (`recorded`, of
   * step recording_step) and taken when a step's differs from it. */
  fsdp_unit_t **order;
  unsigned n_order;
  bool order_given;
  fsdp_unit_t **recorded;
  unsigned n_recorded;
  uint64_t recording_step;
  unsigned forward_prefetch, backward_prefetch; /* units gathered ahead; 0: none */
  /* Per local rank, where its forward stands in a given order: the step and the place of
   * the unit it asks for next. */
  uint64_t forward_step[FSDP_LOCAL_WORLD_MAX];
  unsigned forward_next[FSDP_LOCAL_WORLD_MAX];
  uint64_t masters_final_step; /* every local rank asked a gather of it: masters are final */
  /* The newest step a collective of the job completed or a checkpoint loaded into it holds
   * (fsdp_dataplane_reached_step): with resume_step, where the steps its unit operations
   * may name start (fsdp_unit_ops_check_step). */
  uint64_t last_step;
  uint64_t checkpointed_step;  /* the last step checkpoint.every_steps saved */
  /* While a save's snapshot copies the job's state beside the work queue
   * (fsdp_dataplane_hold_reduces): reduces wait in held_reduces, but while
   * reduces_quiet(reduces_quiet_arg) waits for the running ones' end, those of steps up to
   * hold_after_step still start. */
  bool reduces_held;
  uint64_t hold_after_step;
  fsdp_unit_t *held_reduces;
  void (*reduces_quiet)(void *arg);
  void *reduces_quiet_arg;
  /* A save's snapshot of the job's state, written from while training goes on (the
   * dataplane's), kept for the next save; owned. */
  void *checkpoint_staging;
  size_t checkpoint_staging_bytes;
  uint64_t last_checkpoint_step; /* the last save this daemon wrote, in last_checkpoint */
  char *last_checkpoint;         /* its step directory, owned; NULL: none */
  /* checkpoint.resume = latest: looked for at the job's first unit; the checkpoint to load
   * before its first gather (owned) and its step, which its units report as reduced; set
   * while the load runs. */
  bool resume_looked;
  char *resume_from;
  uint64_t resume_step;
  bool resuming;
  /* The optimizer the daemon runs (daemon/dataplane/optimizer.h), NULL without one; freed
   * with the job through optimizer_free, which its maker sets. */
  struct fsdp_optimizer *optimizer;
  void (*optimizer_free)(struct fsdp_optimizer *optimizer);
  /* Loop time since which nothing refers to it (set as its last session ends, or by the
   * housekeeping when its work ends after that); 0 while in use. */
  uint64_t idle_since_ms;
  /* When it went idle among the jobs, from fsdp_store_job_went_idle: the clock counts whole
   * milliseconds, in which several jobs may go idle, and the first of them is still the one
   * idle longest. */
  uint64_t idle_order;
  /* For each rank whose session ended and that has not attached again: the serial of the
   * first session attached after, 0 otherwise. A session older than that (it was there when
   * the rank went) fails a collective that needs the rank at once: the rank died under it.
   * A newer session (a restarted trainer) waits for the rank like for any rank not there
   * yet. */
  uint64_t gone_before_serial[FSDP_LOCAL_WORLD_MAX];
  struct fsdp_job *next;
} fsdp_job_t;

/* Set by the daemon: what the store cannot see itself. */
typedef struct fsdp_store_hooks {
  /* Whether nothing refers to the job (no session, parked call or queued work), so that it
   * may be freed to make room for a new one. */
  bool (*job_idle)(void *data, const fsdp_job_t *job);
  /* Frees such a job (logging `why`), ending with fsdp_store_remove_job(). */
  void (*free_job)(void *data, fsdp_job_t *job, const char *why);
  void *data;
} fsdp_store_hooks_t;

typedef struct fsdp_store {
  fsdp_job_t *jobs;
  unsigned n_jobs;
  /* Set by the daemon: jobs at once (session.max_sessions: jobs cost descriptors), the
   * bytes their arenas may reserve together (memory.limit) and each arena's size
   * (memory.job_limit). */
  unsigned max_jobs;
  size_t memory_limit;
  size_t arena_capacity;
  unsigned max_inflight; /* a new job's (store.max_inflight) */
  const fsdp_backend_t *backend; /* whose memory the arenas are (daemon.backend) */
  size_t reserved; /* the capacities of every job's arenas */
  uint64_t idle_serial; /* the last idle_order given */
  fsdp_store_hooks_t hooks;
  /* Set by the daemon from cluster.*: the hosts, and the local world size every job must
   * have when there are several (0: any). */
  fsdp_topology_t topology;
  uint32_t local_world_size;
} fsdp_store_t;

void fsdp_store_init(fsdp_store_t *store);
/* Frees every job (NULL-safe). */
void fsdp_store_cleanup(fsdp_store_t *store);

/* Registers spec's unit for the session's rank, creating the job on first use. Returns the
 * unit (borrowed) whose layout the reply carries. */
int fsdp_store_register_unit(fsdp_store_t *store, const fsdp_session_t *session,
                             const fsdp_unit_spec_t *spec, fsdp_unit_t **ret_unit,
                             fsdp_status_t *st);

fsdp_job_t *fsdp_store_find_job(const fsdp_store_t *store, const char *name);
/* Records that nothing refers to job any more since now_ms (loop time, not 0): its
 * retention counts from then, and it gives way to a new job after those idle before it. */
void fsdp_store_job_went_idle(fsdp_store_t *store, fsdp_job_t *job, uint64_t now_ms);
fsdp_unit_t *fsdp_store_find_unit(const fsdp_job_t *job, const char *name);
/* The unit whose id (fsdp_unit_t.id) is id, or NULL. */
fsdp_unit_t *fsdp_store_unit_by_id(const fsdp_job_t *job, uint32_t id);
bool fsdp_store_unit_registered_by(const fsdp_unit_t *unit, uint32_t rank);

/* The session's job, created on first use with its two arenas of store->arena_capacity
 * bytes (no pre-fault: buffers are pre-faulted as they are allocated), freeing retained jobs
 * to make room when needed. FAILED_PRECONDITION if it exists with another local world size,
 * or if its local world size is not cluster.local_world_size; RESOURCE_EXHAUSTED naming the
 * job, its arenas, what jobs in use reserve and the limit when the jobs in use leave no
 * room. The session's rank no longer counts as gone. */
int fsdp_store_job_for(fsdp_store_t *store, const fsdp_session_t *session, fsdp_job_t **ret_job,
                       fsdp_status_t *st);

/* Bytes of buffers allocated over every job's arenas. */
size_t fsdp_store_memory_used(const fsdp_store_t *store);

/* Frees a job, its units and arenas. Only when nothing refers to them: no session, no waiting
 * operation, no work queued (daemon/dataplane/dataplane.h says when). */
void fsdp_store_remove_job(fsdp_store_t *store, fsdp_job_t *job);


#endif
