/* What the data plane's files share: the kinds of waits and of work, a work item, a unit's
 * sizes and dtypes, and the steps each file offers the others. Internal to
 * daemon/dataplane/ (dataplane.h is the contract); loop thread only, but what run_work
 * calls, on a pool thread. */
#ifndef FSDP_DATAPLANE_INTERNAL_H
#define FSDP_DATAPLANE_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "collectives/ring.h"
#include "daemon/dataplane/dataplane.h"
#include "daemon/dataplane/optimizer.h"
#include "kernels/kernels.h"

typedef enum waiter_kind { WAIT_REGISTER, WAIT_UNSHARD, WAIT_REDUCE } waiter_kind_t;

/* Work on the thread pool. A gather casts this host's master shards into the unsharded
 * buffer, then (across hosts) an all-gather fills in the other hosts' regions. A reduce on
 * one host writes the gradient shards in one pass; across hosts the same work is done by
 * the rings' hooks, chunk by chunk, as the transfers go (rings.c), but for
 * a reduce that defers its all-reduce when the host is its own shard group: no ring runs,
 * and one pass adds the host sum to the deferred sum. A backend that stages the rings adds
 * the copies to and from its host buffers around them (staged.c). Another
 * module's work (a checkpoint's) runs in turn with them as a call. */
typedef enum work_kind {
  WORK_PREFAULT,
  WORK_GATHER,
  WORK_REDUCE,
  WORK_DEFER,
  WORK_OPTIMIZE,
  WORK_NORM,
  WORK_STAGE_SUM,
  WORK_UNSTAGE_GATHER,
  WORK_UNSTAGE_SUM,
  WORK_CALL,
} work_kind_t;

struct fsdp_dataplane_work {
  work_kind_t kind;
  fsdp_job_t *job;
  fsdp_unit_t *unit;
  /* WORK_PREFAULT: the block's length, read on the loop: the block list is the loop's. */
  size_t bytes;
  fsdp_optimizer_plan_t plan; /* WORK_OPTIMIZE */
  /* WORK_CALL (fsdp_dataplane_queue_call); unit is NULL. */
  void (*call_run)(void *arg);
  void (*call_ran)(void *arg, int status);
  void *call_arg;
  double norm_sq;             /* WORK_NORM */
  int result;
  uint64_t queued_ns, start_ns; /* when it was queued and when run_work began it */
  uint64_t run_ns;              /* how long run_work took */
  fsdp_status_t error; /* what the backend said of a failure, when it said something */
  fsdp_dataplane_work_t *next;
};

/* A unit's element types, as the kernels name them. */
static inline fsdp_dtype_t kernel_dtype(fsdp_unit_dtype_t dtype) {
  switch (dtype) {
  case FSDP_UNIT_DTYPE_BF16:
    return FSDP_DTYPE_BF16;
  case FSDP_UNIT_DTYPE_FP16:
    return FSDP_DTYPE_FP16;
  default:
    return FSDP_DTYPE_FP32;
  }
}

static inline fsdp_collection_t *collection_of(fsdp_unit_t *u, waiter_kind_t kind) {
  return kind == WAIT_UNSHARD ? &u->flight->gather : &u->flight->reduce;
}

/* This host's region of the flat buffer, in elements. */
static inline uint64_t host_first(const fsdp_unit_t *u) {
  return (uint64_t)u->plan.first_shard * u->layout.shard_numel;
}

static inline uint64_t host_numel(const fsdp_unit_t *u) {
  return (uint64_t)u->plan.local_shards * u->layout.shard_numel;
}

static inline fsdp_dtype_t param_dtype(const fsdp_unit_t *u) {
  return kernel_dtype(fsdp_unit_spec_param_dtype(u->spec));
}

static inline fsdp_dtype_t reduce_dtype(const fsdp_unit_t *u) {
  return kernel_dtype(fsdp_unit_spec_reduce_dtype(u->spec));
}

static inline size_t round64(size_t n) {
  return (n + 63) / 64 * 64;
}

static inline bool stages_rings(const fsdp_job_t *job) {
  return job->backend && job->backend->stages_rings;
}

static inline size_t copy_bytes(const fsdp_unit_t *u) {
  return (size_t)u->layout.padded_numel * fsdp_dtype_size(param_dtype(u));
}

/* What a prefetch keeps of the Unshard that caused it, which may be answered (and its storage
 * reused) before the prefetch starts. */
typedef struct prefetch_cause {
  bool backward;
  uint64_t generation;
  uint64_t deadline_ms;
} prefetch_cause_t;

/* waiters.c */

/* An operation's storage, filled for a new request of `kind` (not yet parked). */
void dp_op_init(fsdp_dataplane_op_t *op, fsdp_unit_t *unit, const fsdp_dataplane_rank_t *who,
                waiter_kind_t kind, fsdp_dataplane_done_fn done, void *data);

/* Calls the operation back, with OK or with err (< 0) and the message. The caller may reuse
 * its storage from then on, so nothing touches op after. */
void dp_op_ok(fsdp_dataplane_op_t *op);
__attribute__((format(printf, 3, 4))) void dp_op_fail(fsdp_dataplane_op_t *op, int err,
                                                     const char *fmt, ...);

/* Takes a parked operation out of its unit's waiters. */
void dp_op_unlink(fsdp_dataplane_op_t *op);

/* The operation waits in its unit until it is called back or cancelled. */
void dp_park(fsdp_dataplane_op_t *op);

/* Calls back every waiter of `kind`: with the result, or with the unit's error once it
 * failed. */
void dp_wake(fsdp_unit_t *u, waiter_kind_t kind);

/* Ends the collection of `kind`: every waiter gets err and the message. What it held goes
 * back: the gradient buffers of the ranks that submitted to a reduce, and the copy a gather
 * was writing. */
void dp_abort_collection(fsdp_job_t *job, fsdp_unit_t *u, waiter_kind_t kind, int err,
                         const char *message);

/* How a message names a step's second gather, the one for its backward. */
const char *dp_again_text(bool again);

/* Parks op as its rank's part of the unit's collection of `kind` for `step` (now_ms: loop
 * time); returns whether it completed the collection (every local rank has asked: it runs
 * now), or -1 when op was answered instead. A rank asking for another step than the one
 * being collected aborts the collection for everyone: nobody could complete it. */
int dp_collect(fsdp_unit_t *u, waiter_kind_t kind, fsdp_dataplane_op_t *op,
               fsdp_job_t *job, uint64_t step, bool regather, uint64_t deadline_ms,
               uint64_t now_ms);

/* A collective of `kind` ended for the local ranks (st: NULL or OK when it succeeded):
 * every waiter hears the result. A gather lends its copy to every rank that asked; a
 * reduce gives the ranks' gradient buffers back. */
void dp_finish_collective(fsdp_job_t *job, fsdp_unit_t *u, waiter_kind_t kind,
                          const fsdp_status_t *st);

/* Whether the unit's buffers are there to work on; st says why not. */
int dp_check_ready(const fsdp_unit_t *unit, fsdp_status_t *st);

/* Whether the unit's buffers are there to work on; fails op otherwise. */
bool dp_ready(fsdp_dataplane_op_t *op);

/* buffers.c */

/* HYBRID_SHARD's deferred sum, if kept, goes back: to the staging or the arena. */
void dp_drop_deferred(fsdp_job_t *job, fsdp_unit_t *u);

/* The reduce's host sum (and its staged copy) goes back to the job's pool of sums. */
void dp_give_back_sum(fsdp_job_t *job, fsdp_unit_t *u);

/* The gather's staged copy goes back to the job's staging. */
void dp_give_back_gather_stage(fsdp_unit_t *u);

/* Across hosts, the host sum lent to a reduce: the fp32 buffer the pre-reduction writes
 * first, then the sum in reduce_dtype (what the rings move) when that is narrower. */
size_t dp_host_sum_bytes(const fsdp_unit_t *u);

/* The host sum's fp32 buffer, in the arena. */
float *dp_host_sum_fp32(const fsdp_job_t *job, const fsdp_unit_t *u);

/* The host sum in reduce_dtype, in the arena. */
char *dp_arena_host_sum(const fsdp_job_t *job, const fsdp_unit_t *u);

/* The host sum the rings move: its staged copy, where the backend stages the rings. */
void *dp_host_sum(const fsdp_job_t *job, const fsdp_unit_t *u);

/* The local ranks' lent full gradients, in local rank order. */
void dp_full_grads(const fsdp_job_t *job, const fsdp_unit_t *u,
                   const void *srcs[FSDP_LOCAL_WORLD_MAX]);

/* Elements [begin, end) of the unit, from the host sum into the deferred sum: copied by the
 * first deferred reduce, added by the next ones (as FSDP2 adds its partial reduce output). */
int dp_keep_deferred(const fsdp_job_t *job, const fsdp_unit_t *u, uint64_t begin,
                     uint64_t end);

/* Elements [begin, end) of the deferred sum, added to the host sum before its all-reduce. */
int dp_add_deferred(const fsdp_job_t *job, const fsdp_unit_t *u, uint64_t begin,
                    uint64_t end);

/* Takes the unit's persistent buffers from the arena, in one block: this host's master
 * shards and gradient shards. The block starts on a page, so that a trainer can map the
 * masters as the unit's copy. */
int dp_allocate(fsdp_job_t *job, fsdp_unit_t *u, fsdp_status_t *st);

/* The unit's copy goes back: to the pool (which may lend it to a gather waiting there at
 * once), or to the arena. */
void dp_give_back_copy(fsdp_job_t *job, fsdp_unit_t *u);

/* rank lets go of the unit's copy; the last holder's letting go gives it back. */
void dp_let_go(fsdp_job_t *job, fsdp_unit_t *u, uint32_t rank);

/* A block of whole pages, which a trainer can map alone. */
int dp_alloc_pages(fsdp_arena_t *arena, size_t bytes, uint64_t *ret_offset,
                   fsdp_status_t *st);

/* The full-gradient buffers lent to `ranks` go back: to each rank's pool, or the arena. */
void dp_give_back_grads(fsdp_job_t *job, fsdp_unit_t *u, const fsdp_rank_set_t *ranks);

/* Lends op's rank the copy and, for a backward, its gradient buffer; answers op, now or when
 * the buffer comes. A unit resharded after forward takes the buffer from the rank's pool
 * (waiting while the rank holds max_inflight); one that keeps its copy (the root) takes a
 * block of its own, as its copy does: it holds the buffer for the whole backward, so within
 * the cap it would keep every other unit waiting once max_inflight is 1. */
void dp_lend(fsdp_job_t *job, fsdp_unit_t *u, fsdp_dataplane_op_t *op);

/* work.c */

/* What follows a stage of a collective that succeeded: a work item (done_work) or a ring
 * (done_ring); the other is -1. This host's cast is followed by the all-gather among the
 * shard group, a reduce-scatter among the shard group by the all-reduce among the replicas,
 * if any and not deferred; a reduce that steps the optimizer by its step; every other stage
 * ends its collective. */
void dp_next_stage(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u, int done_work,
                   int done_ring);

/* A work item of `kind` on the unit, queued; -ENOMEM when it cannot be. */
int dp_queue(fsdp_dataplane_t *dp, work_kind_t kind, fsdp_job_t *job, fsdp_unit_t *unit);

/* A stage of a running collective, queued, or the collective aborted. */
void dp_queue_or_abort(fsdp_dataplane_t *dp, work_kind_t kind, fsdp_job_t *job,
                       fsdp_unit_t *unit);

/* A made work item, queued (started at once when the queue is idle). */
void dp_enqueue(fsdp_dataplane_t *dp, fsdp_dataplane_work_t *w);

/* recorder.c */

/* The job's flight recorder, made once (trace.ops of the data plane). */
void dp_recorder_make(const fsdp_dataplane_t *dp, fsdp_job_t *job);

/* Records a rank's operation as it is answered (code: 0 or the error it hears), and a work
 * item of a unit as it ends. */
void dp_record_op(const fsdp_dataplane_op_t *op, int code);
void dp_record_work(const fsdp_dataplane_work_t *w, int code);

/* runs.c: the moves between the shards' space and the unsharded buffers, by the unit's
 * layout. */

/* The host's masters, cast into the elements of the unsharded copy (param_dtype) that its
 * shards hold. */
int dp_cast_masters(const fsdp_backend_t *b, const fsdp_job_t *job, const fsdp_unit_t *u,
                    void *unsharded, fsdp_status_t *st);

/* Elements [begin, end) of the shards' space, between a staged copy (laid out as the
 * shards) and the unsharded copy: into the stage when to_stage, else out of it. */
int dp_copy_staged(const fsdp_backend_t *b, const fsdp_unit_t *u, char *stage, char *unsharded,
                   uint64_t begin, uint64_t end, bool to_stage, fsdp_status_t *st);

/* Elements [begin, end) of the shards' space from the local ranks' full gradients, summed
 * (fsdp_backend_reduce: pre_scale, then post_scale) into or onto dst, which holds element
 * begin first; padding is written zero, or left when accumulating. */
int dp_reduce_runs(const fsdp_backend_t *b, const fsdp_job_t *job, const fsdp_unit_t *u,
                   float *dst, bool accumulate, float post_scale, uint64_t begin, uint64_t end,
                   fsdp_status_t *st);

/* Elements [begin, end) of the arena's host sum (fsdp_host_sum_range), from the local
 * ranks' full gradients; padding zero. */
int dp_host_sum_runs(const fsdp_job_t *job, const fsdp_unit_t *u, uint64_t begin,
                     uint64_t end);

/* Whether the unit's collectives across hosts move a staged copy: the backend's memory is
 * not the host's, or the unsharded copy is not laid out as the shards (PER_PARAM), which
 * the all-gather fills. */
static inline bool stages_unit(const fsdp_job_t *job, const fsdp_unit_t *u) {
  return stages_rings(job) || !fsdp_unit_layout_is_flat(&u->layout);
}

/* staged.c */

/* Where the backend stages the rings: a staging buffer that goes is no longer registered
 * with the transport (fsdp_staging_take's forget; arg: the data plane). */
void dp_forget_staging(void *arg, const void *base, size_t bytes);

/* A staging buffer of `bytes` for a collective across hosts, from the job's staging. */
int dp_take_stage(fsdp_dataplane_t *dp, fsdp_job_t *job, size_t bytes,
                  fsdp_staging_buffer_t **ret, fsdp_status_t *st);

/* WORK_STAGE_SUM: the host sum of what the first ring moves (the whole unit for a
 * reduce-scatter among the shard group, else this host's region, all that the all-reduce
 * among replicas moves), made on the device as fsdp_host_sum_range makes it on the host,
 * then staged. A host that is its own shard group then adds the deferred sum to it, or
 * keeps it as the deferred sum when it defers, as produce_host_sum and WORK_DEFER do. */
int dp_stage_host_sum(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                      fsdp_status_t *st);

/* WORK_UNSTAGE_GATHER: the other hosts' regions of the staged copy into the unsharded
 * buffer. */
int dp_unstage_gather(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                      fsdp_status_t *st);

/* WORK_UNSTAGE_SUM: this host's region of the staged result back into the arena's host sum,
 * then divided by the postdivide factor into (or onto) the gradient shards there, as
 * finalize_grads does on the host. */
int dp_unstage_sum(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                   fsdp_status_t *st);

/* rings.c */

/* Starts the unit's ring of `kind` among the hosts, or ends its collective saying why. */
void dp_start_ring(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                   fsdp_ring_kind_t kind);

/* Clipping a unit that spans hosts: its shard group's parts of the norm are summed among
 * them (each group holds every shard once, and replicas hold the same gradient shards), each
 * part rounded to fp32 and added in fp32 in the ring's order: member 1's, plus member 2's,
 * ..., plus member 0's, which every member then receives. */
/* A newer run of the job began (job->flight->generation): the rings of its older runs end
 * (ABORTED, saying so), those running cancelled, those waiting for the cluster at once, and
 * those that would start later when they would, so that a host whose run was lost with a
 * host is free for the new one (a snapshot for a host that recovers waits for none of them). */
void dp_supersede_rings(fsdp_dataplane_t *dp, fsdp_job_t *job);

void dp_start_norm_ring(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                        double part);

/* A reduce across hosts borrows a host sum from the job's pool for as long as its rings run,
 * waiting (under the collective deadline) while max_inflight are lent: a running reduce
 * always ends, so the wait does too. */
void dp_start_reduce_rings(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u);

/* unshard.c */

/* Every Unshard waiting for the gather that just ended gets the copy; one that asked
 * another step than a prefetch's is run again now. */
void dp_wake_unshards(fsdp_job_t *job, fsdp_unit_t *u);

/* The gather of a collection every rank joined: into the masters (nothing to do), a copy
 * of the unit's own, or one from the job's pool, which may have to wait for one. */
void dp_start_gather(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u);

/* reduce.c */

/* Takes the unit's reduce out of the job's held reduces, if it is there. */
void dp_unhold_reduce(fsdp_job_t *job, fsdp_unit_t *u);

/* Tells the holder, once, that no reduce of the job runs any more: from then on every
 * reduce of the job waits, whatever its step. */
void dp_tell_if_quiet(fsdp_job_t *job);

/* The unit's part of the step's squared norm is known (its whole shard group's): it waits
 * for the other units' and steps with them. */
void dp_norm_known(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u, double norm_sq);

/* The unit's optimizer step, after its reduce wrote the gradient shards; the reduce ends
 * with it. A step the unit took already (a restarted run repeating it) is not taken again.
 * With clipping, the step waits for the norm of the whole gradient: this unit's part is
 * summed first. */
void dp_start_step(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u);

/* schedule.c */

/* Which gather a request joins: the step's, or, for the backward of a unit resharded after
 * its forward, the step's second (every host runs the same gathers, whichever of its ranks
 * still held the forward's copy). In order: step, then the second after the first. */
uint64_t dp_gather_round(uint64_t step, bool again);

/* The forward order as local rank 0 runs it: its forward Unshards of a step, recorded, and
 * taken when the step is over (its next step's first) if they differ from the order. */
void dp_record_order(fsdp_job_t *job, fsdp_unit_t *unit, uint64_t step);

/* The schedule's prefetch after rank's Unshard of unit for step was answered: the next units
 * in forward order, or the previous ones with gradients in backward. */
void dp_prefetch_after(fsdp_dataplane_t *dp, fsdp_job_t *job, const fsdp_unit_t *unit,
                       uint64_t step, const prefetch_cause_t *cause);

/* Whether a forward Unshard follows the given order: within a step, each rank asks for the
 * order's units one after the other (asking one again, or a unit outside the order, is
 * free). Fails op otherwise, naming the unit asked for and the one expected. */
bool dp_in_order(fsdp_job_t *job, const fsdp_unit_t *unit, fsdp_dataplane_op_t *op);

#endif
