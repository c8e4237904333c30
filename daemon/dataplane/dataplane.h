/* The data path: a registered unit's buffers in its job's arena, and the
 * operations on them. It knows no RPC: the service layer (daemon/services/trainer_service.c,
 * fastpath.c) hands it an operation with a completion callback, and builds the reply when it
 * is called back.
 *
 * Operations. Each takes the rank that asks (fsdp_dataplane_rank_t), caller-owned storage
 * for it (fsdp_dataplane_op_t) and a done callback, which is called exactly once with the
 * result (st->code 0, or an fsdp error and its message), unless the caller cancels the
 * operation first (fsdp_dataplane_cancel). An answer known at once (a refusal, a copy already
 * there) calls back before the operation's function returns; otherwise the operation waits
 * in the unit (its storage linked there) until its collective or its buffers' preparation
 * ends, and the storage must stay valid until then.
 *
 * Blocking work (pre-faulting new buffers, the casts of an unshard) runs on libuv's thread
 * pool, one item at a time in arrival order, spread over the kernels' worker pool; the
 * operations that wait for it are called back when it is done. Work never runs on the loop
 * thread, and a unit's memory is never freed while the daemon runs, so a work item's
 * pointers stay valid until its completion runs on the loop.
 *
 * Memory, as FSDP holds it: a unit's fp32 master and gradient shards are its own for the
 * job's life; its unsharded copy and the full-gradient buffers are lent from the job's
 * bounded pools (daemon/store/pool.h, job->max_inflight each) only while the unit is in
 * flight, so that memory grows with the units in flight, not with the model.
 *
 * Unshard is a collective of the job's local ranks, like FSDP's all-gather: a rank asking
 * for step s says its master shards are final for s (and lets go of any older copy it
 * held). Once every local rank has asked for s, one gather (the fp32 master shards cast into
 * the copy in param_dtype) runs and answers them all, lending each the copy until it
 * reshards. The copy of a unit that reshards after forward comes from the job's pool of
 * copies, and a gather that finds the pool's buffers all lent waits for one; any other
 * unit's copy is a block of its own. The copy goes back when its last holder lets go, so
 * FULL_SHARD's backward gathers again. An Unshard of s while the copy of s is there is
 * answered at once; an older step is refused. When the param dtype is fp32 and this host
 * holds every shard, the masters themselves are the copy: nothing is gathered or held.
 * An Unshard for the backward also lends the rank a full-gradient buffer from its own pool
 * (waiting while the rank holds max_inflight of them), until the unit's reduce ends.
 *
 * Prefetch (the job's schedule): once every local rank asked a gather of step s, all their
 * masters are final for s, so the daemon gathers ahead on their behalf, as if each had
 * asked: when a rank's forward Unshard of unit i (of step s) is answered, the next
 * forward_prefetch units in the forward order; when its backward's is, the
 * backward_prefetch units before i that have gradients (FSDP's BACKWARD_PRE), each its
 * backward's gather. A unit is gathered ahead only when nothing is collected or gathered
 * for it and no rank holds its copy; the ranks' own Unshards then find the copy there (or
 * wait for its gather), and a rank that asks another step than a prefetch's waits for it to
 * end and is served then.
 *
 * Across hosts, the cast of a gather is followed by an all-gather among the hosts; a reduce
 * is rings among the hosts (see rings.c) that do its local work chunk by chunk on the
 * thread pool while the transfers run: the pre-reduction of the L gradients into a host
 * sum, the post-reduction of this host's region into the gradient shards.
 *
 * A collective names one step; a rank asking for another step than the others aborts it
 * for all (the rendezvous that decides it is collectives/local.h's). Ranks that do not ask within the deadline of the first (store.collective_timeout)
 * are named in the ABORTED every waiter gets (fsdp_dataplane_expire), and so is a rank whose
 * session ends (fsdp_dataplane_release_session), whose lent buffers go back then. A wait for
 * a pool buffer has the same deadline.
 *
 * Loop thread only, except inside work items. */
#ifndef FSDP_DATAPLANE_H
#define FSDP_DATAPLANE_H

#include <stdbool.h>

#include <uv.h>

#include "collectives/local.h"
#include "collectives/rank_set.h"
#include "common/status.h"
#include "daemon/backend/backend.h"
#include "daemon/backend/cuda_backend.h"
#include "daemon/cluster/fabric.h"
#include "daemon/cluster/peers.h"
#include "daemon/metrics/exposition.h"
#include "daemon/store/store.h"
#include "kernels/workers.h"

typedef struct fsdp_dataplane_work fsdp_dataplane_work_t;

/* What the data plane does with a job (fsdp_job_t.flight): the schedule it runs, where the
 * job's steps stand, the reduces a checkpoint's snapshot holds, and which ranks went. */
/* One operation in a job's flight recorder: a rank's Unshard or reduce, from its arrival
 * (submit) through the collective's start (every local rank there) to its answer, or a
 * piece of the daemon's own work on a unit, from its queueing through its run. Times are
 * CLOCK_MONOTONIC (common/clock.h), one clock for the host's processes. */
typedef enum fsdp_record_kind {
  FSDP_RECORD_GATHER = 1, /* a rank's Unshard */
  FSDP_RECORD_REDUCE = 2, /* a rank's ReduceScatter or AllReduce (a step alone too) */
  FSDP_RECORD_WORK = 3,   /* the daemon's work: `work` says which */
} fsdp_record_kind_t;

typedef struct fsdp_op_record {
  uint64_t submit_ns, start_ns, end_ns; /* start 0: it never started */
  uint64_t step;
  uint64_t bytes; /* a gather's copy, a reduce's gradient: of one rank */
  uint32_t unit_id;
  int32_t code;  /* 0, or the fsdp error the rank heard */
  uint16_t rank; /* the local rank; FSDP_RECORD_WORK: none */
  uint8_t kind;  /* fsdp_record_kind_t */
  uint8_t work;  /* FSDP_RECORD_WORK: what (fsdp_dataplane_work_name) */
} fsdp_op_record_t;

/* The last `capacity` records of a job (trace.ops), a ring: total were made. */
typedef struct fsdp_recorder {
  fsdp_op_record_t *records;
  uint32_t capacity;
  uint64_t total;
} fsdp_recorder_t;

typedef struct fsdp_job_flight {
  /* The newest run (a session's generation) whose ranks registered a unit of the job. */
  uint64_t generation;
  /* The schedule the daemon runs (SetSchedule; see "Prefetch" above). The
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
  /* While a save's snapshot copies the job's state beside the work queue
   * (fsdp_dataplane_hold_reduces): reduces wait in held_reduces, but while
   * reduces_quiet(reduces_quiet_arg) waits for the running ones' end, those of steps up to
   * hold_after_step still start. */
  bool reduces_held;
  uint64_t hold_after_step;
  fsdp_unit_t *held_reduces;
  void (*reduces_quiet)(void *arg);
  void *reduces_quiet_arg;
  /* For each rank whose session ended and that has not attached again: the serial of the
   * first session attached after, 0 otherwise. A session older than that (it was there when
   * the rank went) fails a collective that needs the rank at once: the rank died under it.
   * A newer session (a restarted trainer) waits for the rank like for any rank not there
   * yet. */
  uint64_t gone_before_serial[FSDP_LOCAL_WORLD_MAX];
  unsigned order_capacity; /* of order and recorded: at least the job's units */
  bool resume_looked; /* the hooks' job_starts was called for its first unit */
  /* job_starts looks for what the job resumes from, beside the queue: its registrations
   * wait until fsdp_dataplane_looked. */
  bool looking;
  /* checkpoint.resume: the job's gathers wait for the load of the checkpoint it resumes
   * from, pending until its first gather starts the load (the hooks' resume), then running
   * until fsdp_dataplane_resumed; resume_step is that checkpoint's step (0: unknown), which
   * its units report as reduced. */
  bool resume_pending, resuming;
  uint64_t resume_step;
  /* A collective under way for longer than health.stall_after, as the last check found
   * (fsdp_dataplane_check_stalls), and what it waits for. */
  bool stalled;
  char stall[256];
  fsdp_recorder_t recorder; /* made at the first unit's registration; none with trace.ops 0 */
} fsdp_job_flight_t;

/* An operation waiting on a unit: its storage, the caller's (below). */
typedef struct fsdp_dataplane_op fsdp_dataplane_op_t;

/* Where a unit's buffers are. */
typedef enum fsdp_unit_state {
  FSDP_UNIT_NEW,        /* registered, no buffers yet */
  FSDP_UNIT_ALLOCATING, /* buffers taken from the arena, being pre-faulted */
  FSDP_UNIT_READY,      /* buffers ready for unshards and reductions */
  FSDP_UNIT_FAILED,     /* buffers could not be made ready; see `error` */
} fsdp_unit_state_t;

/* What the data plane is doing with a unit (fsdp_unit_t.flight): its buffers' preparation,
 * the copy and the gradient buffers it lends, its collectives and what they hold. The store
 * keeps what the unit is: its spec, plan, layout and persistent buffers. */
typedef struct fsdp_unit_flight {
  fsdp_unit_t *unit; /* whose */
  int order_index;        /* its place in the job's forward order, -1 outside it */
  fsdp_unit_state_t state;
  fsdp_status_t error;        /* why FAILED */
  /* The unsharded copy, lent to the ranks in `holders`, unless the masters are the copy
   * (fsdp_unit_t.copy_in_masters). While has_copy, the copy is at copy_offset of the shared arena: from the job's pool (copy_pooled) when it
   * was gathered for a unit that reshards after forward, else a block of its own; it holds
   * `gathered_step` once `gathered` (`gathered_again`: the step's second gather, for the
   * backward; `gathered_generation`: the run whose ranks asked for it), and goes back when the
   * last holder lets go. */
  bool reshard_after_forward; /* the schedule's (SetSchedule), or the strategy's default */
  bool copy_pooled;
  bool has_copy;
  uint64_t copy_offset;
  fsdp_pool_waiter_t copy_waiter; /* a gather waiting for a pool buffer; data: the data plane */
  fsdp_rank_set_t holders;
  bool gathered;
  bool gathered_again;
  uint64_t gathered_step;
  uint64_t gathered_generation;
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
   * A reduce that fails while using the block drops it. The block belongs to the run
   * (generation) whose reduces made it: another run's first reduce drops it. */
  bool reduce_defer;
  bool reduce_step; /* the running reduce steps the masters after (step_optimizer) */
  bool reduce_step_only; /* ... and reduces nothing before (step_only) */
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
  uint64_t reduces; /* reduces of gradients that completed (a step alone is none) */
  uint64_t replica_all_reduces; /* all-reduces among replicas run, for fsdpctl unit */
  /* What the data plane's own work of the last gather (this host's cast) and the last
   * one-host reduce took, in microseconds, kernels and their completion: for fsdpctl unit;
   * and all of them, for the metrics. */
  uint64_t last_gather_us, last_reduce_us;
  uint64_t gather_started_ns, reduce_started_ns; /* when the last collective of each began */
  fsdp_histogram_t gather_work, reduce_work;
  fsdp_histogram_t gather_queue, reduce_queue; /* their wait in the queue before they ran */
  uint64_t ring_sent_bytes; /* what its rings sent to the next host over UCX */
  uint64_t gathers; /* gathers that completed */
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
} fsdp_unit_flight_t;

typedef struct ring_run ring_run_t;

/* What the jobs' checkpoints (daemon/checkpoints/checkpoints.h), which the data plane does not
 * know, hear of it, on the loop with ctx. Each may be NULL, but resume must be set with
 * job_starts, the one that makes a job resume. */
typedef struct fsdp_dataplane_hooks {
  void *ctx;
  /* A job's first unit (unit) registers: returns whether it looks for what to resume from,
   * which then ends with fsdp_dataplane_looked, never inside this call; the job's
   * registrations wait. */
  bool (*job_starts)(void *ctx, fsdp_job_t *job, const fsdp_unit_t *unit);
  /* The first gather of a job that resumes: the resume's load starts, and the job's gathers
   * wait for fsdp_dataplane_resumed. */
  void (*resume)(void *ctx, fsdp_job_t *job);
  /* Every local rank asked the forward's gather of step + 1: their masters are final for
   * step, and stay so until its reduces (fsdp_dataplane_hold_reduces holds them). */
  void (*step_boundary)(void *ctx, fsdp_job_t *job, uint64_t step);
} fsdp_dataplane_hooks_t;

typedef struct fsdp_dataplane {
  uv_loop_t *loop;
  fsdp_workers_t *workers;
  fsdp_backend_t backend; /* what the gathers and reduces run on: the host, or a GPU */
  uv_work_t req;
  fsdp_dataplane_work_t *head, *tail; /* head is running while busy */
  bool busy;
  /* Across hosts (fsdp_dataplane_set_cluster): the peers, the connections to them, and the
   * rings waiting for the cluster to be joined. */
  fsdp_peers_t *peers;
  fsdp_fabric_t *fabric;
  uint64_t collective_timeout_ms; /* each ring's deadline after it starts */
  ring_run_t *cluster_waiting;
  ring_run_t *running_rings; /* rings started and not yet ended, every job's */
  fsdp_peers_waiter_t cluster_waiter;
  bool waiting_for_cluster;
  void *free_scratch; /* the rings' staging buffers not in use, linked through their start */
  fsdp_dataplane_hooks_t hooks;
  uint32_t trace_ops; /* a new job's flight recorder's length (trace.ops); 0: none */
} fsdp_dataplane_t;

/* Who asks: a local rank, as one of its sessions (daemon/session/sessions.h). */
typedef struct fsdp_dataplane_rank {
  uint32_t local_rank;
  uint64_t session_id; /* whose operations fsdp_dataplane_release_session ends */
  uint64_t serial;     /* the session's: one older than a rank's end finds the rank gone */
  uint64_t generation; /* the job's run: the ranks of one collective all have the same */
} fsdp_dataplane_rank_t;

/* How an operation ended: st->code is 0, or an fsdp error that st->message explains. */
typedef void (*fsdp_dataplane_done_fn)(void *data, const fsdp_status_t *st);

/* What an Unshard that succeeded lends the rank: its copy at unsharded_offset of the shared
 * arena, or of the arena when unsharded_in_masters; with the backward, its full-gradient
 * buffer (full_grad_bytes > 0) at full_grad_offset of the arena. */
typedef struct fsdp_dataplane_lent {
  uint64_t unsharded_offset;
  bool unsharded_in_masters;
  uint64_t full_grad_offset;
  uint64_t full_grad_bytes;
} fsdp_dataplane_lent_t;

/* An operation's storage, the caller's; its fields are the data plane's but `lent`, which
 * the done callback of an Unshard reads. */
struct fsdp_dataplane_op {
  fsdp_unit_t *unit;
  fsdp_dataplane_rank_t who;
  int kind;
  bool backward;        /* an Unshard for the backward: lends a gradient buffer too */
  bool redo;            /* an Unshard waiting for the end of a prefetch of another step */
  uint64_t step;
  uint64_t deadline_ms; /* of a wait for a pool buffer */
  uint64_t submit_ns;   /* when it came (the flight recorder's) */
  fsdp_dataplane_done_fn done;
  void *data;
  fsdp_dataplane_op_t *prev, *next; /* in unit->waiters while it waits */
  fsdp_pool_waiter_t grad_waiter;   /* waiting for its rank's gradient buffer */
  fsdp_dataplane_lent_t lent;
};

/* Where a rank finds a registered unit's persistent buffers (byte offsets in the job's
 * arena), which shards it holds, and where the unit's steps stand (0 before the first). */
typedef struct fsdp_dataplane_buffers {
  uint64_t master_offset;
  uint64_t grad_offset;
  uint32_t shard;            /* the rank's */
  uint32_t replica;          /* fsdp_unit_plan_replica */
  uint32_t host_first_shard;
  uint32_t host_shards;
  uint64_t gathered_step;
  uint64_t reduced_step;
} fsdp_dataplane_buffers_t;

/* threads: the worker pool's size, the calling pool thread included. */
int fsdp_dataplane_init(fsdp_dataplane_t *dp, uv_loop_t *loop, unsigned threads,
                        fsdp_status_t *st);
/* Runs the gathers and reduces of every job on `device` instead of the host (before any
 * job exists; the store's arenas must then be that GPU's memory: dp->backend). Fails naming
 * the GPU. */
int fsdp_dataplane_use_cuda(fsdp_dataplane_t *dp, const fsdp_cuda_module_t *cuda,
                            const fsdp_cuda_device_t *device, fsdp_status_t *st);

/* Sets the store's job_made, job_freed, unit_made and unit_freed hooks: each job and unit
 * the store makes gets its flight (what made it fails RESOURCE_EXHAUSTED, naming it, when
 * there is no memory for it), freed as the store frees it; and rank_back: a rank whose
 * session reached the store no longer counts as gone (fsdp_dataplane_release_session). */
void fsdp_dataplane_hook_store(fsdp_store_hooks_t *hooks);

/* Once the loop has ended: no work is in flight then. NULL-safe. */
void fsdp_dataplane_cleanup(fsdp_dataplane_t *dp);

/* The other hosts: peers (borrowed; one host: no fabric) and the deadline of a collective
 * among hosts once it starts. Again with NULLs when they close. */
void fsdp_dataplane_set_cluster(fsdp_dataplane_t *dp, fsdp_peers_t *peers, fsdp_fabric_t *fabric,
                                uint64_t collective_timeout_ms);

/* A job's state between this host and `host`, for a host that recovers it from a replica
 * (daemon/checkpoints/replicas.c): one message of len bytes of host memory, sent (send) or
 * received into buf, tagged with the job, the step and the incarnation of the daemon that
 * receives it (`receiver`), so that a receive matches that send alone. done runs once, on
 * the loop, never inside the call: st NULL, or why it failed (the host lost, cancelled, a
 * message of another length). Returns 0 with *ret the transfer until done has run, or an
 * error (done never runs): no connection to the host. */
typedef struct fsdp_dataplane_transfer fsdp_dataplane_transfer_t;
typedef void (*fsdp_dataplane_transfer_fn)(void *data, const fsdp_status_t *st);
int fsdp_dataplane_transfer_state(fsdp_dataplane_t *dp, bool send, unsigned host,
                                  const char *job, uint64_t step, uint64_t receiver, void *buf,
                                  size_t len, fsdp_dataplane_transfer_fn done, void *data,
                                  fsdp_dataplane_transfer_t **ret, fsdp_status_t *st);
/* Ends a transfer before its done has run: a receive that no message has matched yet is
 * cancelled (why NULL); otherwise (why: the reason) the connection to its host is failed,
 * which ends every transfer with that host (UCX ends a send, or a receive being filled, no
 * other way; the next use connects again). */
void fsdp_dataplane_transfer_end(fsdp_dataplane_transfer_t *t, const char *why);

/* Registration of a unit the store accepted for who's rank: done once the unit's persistent
 * buffers are ready (fsdp_dataplane_buffers says where). The first registration takes them
 * from the job's arena (reserved against memory.limit as a whole when the job was made) and
 * pre-faults them. */
void fsdp_dataplane_register(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit,
                             const fsdp_dataplane_rank_t *who, fsdp_dataplane_op_t *op,
                             fsdp_dataplane_done_fn done, void *data);

/* Unshard of `unit` for who's rank at `step`, for the backward or the forward; deadline_ms:
 * loop time by which every local rank must have asked, if this operation starts the
 * collective, and by which a wait for a pool buffer ends. op->lent says what it lent. */
void fsdp_dataplane_unshard(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit,
                            const fsdp_dataplane_rank_t *who, uint64_t step, bool backward,
                            uint64_t deadline_ms, fsdp_dataplane_op_t *op,
                            fsdp_dataplane_done_fn done, void *data);

/* What a reduce does with the sum; every local rank must ask the same. */
typedef struct fsdp_dataplane_reduce_how {
  bool accumulate; /* add to the gradient shards instead of writing them */
  /* For a unit with replicas on other hosts (HYBRID_SHARD): keep the shard group's sum for
   * the next reduce without it, which all-reduces it among the replicas with its own (see
   * fsdp_unit_t); for any other unit it changes nothing. */
  bool defer_all_reduce;
  /* Then step the unit's masters with the job's optimizer (daemon/dataplane/optimizer.h);
   * the reduce ends after the step. Not with defer_all_reduce, whose shards wait. */
  bool step_optimizer;
  /* With step_optimizer alone: the step without a reduce (torch's opt.step() after the
   * backwards' reduces wrote the gradient shards); the ranks submit no gradient. */
  bool step_only;
} fsdp_dataplane_reduce_how_t;

/* ReduceScatter (and AllReduce of a NO_SHARD unit) for who's rank at `step`, as `how` says;
 * deadline_ms as for Unshard. */
void fsdp_dataplane_reduce(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit,
                           const fsdp_dataplane_rank_t *who, uint64_t step,
                           const fsdp_dataplane_reduce_how_t *how, uint64_t deadline_ms,
                           fsdp_dataplane_op_t *op, fsdp_dataplane_done_fn done, void *data);

/* Reshard: who's rank lets go of the unit's copy, which goes back when no rank holds it.
 * Fails (st says why) unless the unit has buffers. */
int fsdp_dataplane_reshard(fsdp_job_t *job, fsdp_unit_t *unit, const fsdp_dataplane_rank_t *who,
                           fsdp_status_t *st);

/* A waiting operation's caller gave up (its client went away, its deadline passed): it is
 * not called back. Unless its collective already runs, its rank no longer counts in it, so
 * that nothing is gathered or reduced for a rank that no longer waits (and asks again). */
void fsdp_dataplane_cancel(fsdp_dataplane_op_t *op);

/* Where rank finds a unit's buffers once its registration is done. */
void fsdp_dataplane_buffers(const fsdp_unit_t *unit, uint32_t rank,
                            fsdp_dataplane_buffers_t *ret_buffers);

/* The job's in-flight cap (SetSchedule): its pools lend at most max_inflight buffers each
 * (in [1, FSDP_POOL_CAPACITY_MAX]); a higher cap serves waiting gathers at once. */
void fsdp_dataplane_set_max_inflight(fsdp_job_t *job, unsigned max_inflight);

/* The job's forward order (SetSchedule): n units, each at most once; n 0 records it again
 * from the steps (local rank 0's forward Unshards of each step, taken from the next step on
 * whenever a step's differs). */
void fsdp_dataplane_set_order(fsdp_job_t *job, fsdp_unit_t *const *units, unsigned n);

/* The job's flight recorder, oldest first: fn(data, record) for each. */
void fsdp_dataplane_each_record(const fsdp_job_t *job,
                                void (*fn)(void *data, const fsdp_op_record_t *record),
                                void *data);

/* What a record of FSDP_RECORD_WORK did ("gather", "reduce", "optimizer step", ...). */
const char *fsdp_dataplane_work_name(unsigned work);

/* Marks each job stalled (job->flight->stalled, its reason in ->stall) whose oldest
 * collective under way began stall_after_ms ago or more, and logs when a job stalls and
 * when it goes on; from the housekeeping timer. */
void fsdp_dataplane_check_stalls(fsdp_store_t *store, uint64_t now_ms, uint64_t stall_after_ms);

/* A collective of a job under way, as fsdp_dataplane_each_wait finds it. */
typedef struct fsdp_dataplane_wait {
  const fsdp_unit_t *unit;
  const char *what; /* "gather", "reduce" */
  uint64_t step;
  uint64_t waited_ms;    /* since its first local rank asked */
  bool running;          /* every local rank asked: the daemon's work runs */
  bool across_hosts;     /* running, its rings among hosts too */
  fsdp_rank_set_t asked; /* the local ranks whose request is in */
} fsdp_dataplane_wait_t;

/* fn(data, wait) for each collective of the job under way (Operator.Why). */
void fsdp_dataplane_each_wait(const fsdp_job_t *job, uint64_t now_ms,
                              void (*fn)(void *data, const fsdp_dataplane_wait_t *wait),
                              void *data);

/* What the job's oldest collective under way waits for, as health's reason says it, in
 * buf; false when none is under way. */
bool fsdp_dataplane_describe_oldest(const fsdp_job_t *job, uint64_t now_ms, char *buf,
                                    size_t size);

/* How long the job's oldest collective under way has been (from its first rank's asking);
 * 0 without one. */
uint64_t fsdp_dataplane_oldest_wait_ms(const fsdp_job_t *job, uint64_t now_ms);

/* Called once for a job whose collective timed out, before its ranks are told: it may
 * keep what the job did (its flight record) and add a note to what they hear. */
typedef void (*fsdp_dataplane_timeout_fn)(void *data, const fsdp_job_t *job, char *note,
                                          size_t size);

/* Ends collectives whose deadline passed, each job's first calling on_timeout (NULL: none);
 * from the housekeeping timer. */
void fsdp_dataplane_expire(fsdp_store_t *store, uint64_t now_ms,
                           fsdp_dataplane_timeout_fn on_timeout, void *data);

/* Another module's blocking work on the job, in turn with the casts, reduces and optimizer
 * steps, so that none of the data plane's runs meanwhile: run(arg) on a pool thread, then
 * ran(arg, status) on the loop (status: libuv's, 0 or UV_ECANCELED). Fails only for want of
 * memory. */
int fsdp_dataplane_queue_call(fsdp_dataplane_t *dp, fsdp_job_t *job, void (*run)(void *arg),
                              void (*ran)(void *arg, int status), void *arg, fsdp_status_t *st);

/* Holds the job's reduces while another module copies its masters and optimizer state
 * beside the work queue (a checkpoint's snapshot): a reduce whose ranks have all asked
 * waits, and starts once fsdp_dataplane_release_reduces lets it go, in the order its ranks
 * completed it. Nothing else changes that state (a trainer's optimizer writes the masters
 * only once its reduce ended), so gathers go on meanwhile. Returns whether no reduce of the
 * job runs: then every reduce waits. If one does, reduces of steps up to after_step (the
 * step under way) still start, so that it can end, and quiet(arg) is called on the loop
 * once none runs (from inside the data plane's own calls: it must not end the hold or call
 * back into them); from then on every reduce waits. One holder at a time. */
bool fsdp_dataplane_hold_reduces(fsdp_dataplane_t *dp, fsdp_job_t *job, uint64_t after_step,
                                 void (*quiet)(void *arg), void *arg);
void fsdp_dataplane_release_reduces(fsdp_dataplane_t *dp, fsdp_job_t *job);

/* The job's state is that of `step`: one of its collectives completed it, or a checkpoint of
 * it was loaded. Its trainers go on after it, so job->last_step rises to it. */
void fsdp_dataplane_reached_step(fsdp_job_t *job, uint64_t step);

/* The look job_starts began ended: with resume, the job goes on from a checkpoint of
 * `step` (0: unknown), which its gathers wait for and its units report as reduced. The
 * job's registrations then end. */
void fsdp_dataplane_looked(fsdp_dataplane_t *dp, fsdp_job_t *job, bool resume, uint64_t step);

/* The resume the hooks started ended (st->code 0: the job's state is loaded): the gathers
 * waiting for it start, or, when it failed, the job's units fail naming why. */
void fsdp_dataplane_resumed(fsdp_dataplane_t *dp, fsdp_job_t *job, const fsdp_status_t *st);

/* Whether the job's memory waits for the checkpoint it resumes from (job_starts said so, and
 * fsdp_dataplane_resumed has not come). */
bool fsdp_dataplane_job_resuming(const fsdp_job_t *job);

/* Whether any queued or running work, or any waiting operation, refers to the job. */
bool fsdp_dataplane_uses_job(const fsdp_dataplane_t *dp, const fsdp_job_t *job);

/* Before the job's memory goes (nothing may use it: fsdp_dataplane_uses_job is false):
 * releases its registrations with the transport. */
void fsdp_dataplane_forget_job(fsdp_dataplane_t *dp, const fsdp_job_t *job);

/* A session of `job` (session_id, of local rank `rank`) ended (why: for the messages);
 * next_serial: the serial the next session will get. Its own waiting operations end with
 * ABORTED naming it, even in a collective already running, so that nothing is answered OK
 * for a session that ended. Collectives waiting for its rank end with ABORTED naming it, and
 * so do those that sessions older than its end start until the rank attaches again (its
 * session reaches the store: fsdp_store_job_for). */
void fsdp_dataplane_release_session(fsdp_job_t *job, uint32_t rank, uint64_t session_id,
                                    const char *why, uint64_t next_serial);

#endif
