/* Unit buffers and the operations of the host backend, on one host and across hosts. */
#include "daemon/dataplane/dataplane.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "collectives/local.h"
#include "collectives/ring.h"
#include "common/clock.h"
#include "common/log.h"
#include "daemon/dataplane/optimizer.h"
#include "proto/host/formats.h"

typedef enum waiter_kind { WAIT_REGISTER, WAIT_UNSHARD, WAIT_REDUCE } waiter_kind_t;

/* Work on the thread pool. A gather casts this host's master shards into the unsharded
 * buffer, then (across hosts) an all-gather fills in the other hosts' regions. A reduce on
 * one host writes the gradient shards in one pass; across hosts the same work is done by
 * the rings' hooks, chunk by chunk, as the transfers go (see "Rings among hosts"), but for
 * a reduce that defers its all-reduce when the host is its own shard group: no ring runs,
 * and one pass adds the host sum to the deferred sum. A backend that stages the rings adds
 * the copies to and from its host buffers around them (see "Staged rings"). Another
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
  uint64_t run_ns; /* how long run_work took */
  fsdp_status_t error; /* what the backend said of a failure, when it said something */
  fsdp_dataplane_work_t *next;
};



static const char *const work_names[] = {"preparing its buffers", "the gather",
                                         "the reduce-scatter", "the deferred reduce",
                                         "the optimizer step", "the gradient's norm",
                                         "the host sum's staging",
                                         "the gathered copy's return from staging",
                                         "the sum's return from staging",
                                         "another module's work"};

/* A unit's element types, as the kernels name them. */
static fsdp_dtype_t kernel_dtype(fsdp_unit_dtype_t dtype) {
  switch (dtype) {
  case FSDP_UNIT_DTYPE_BF16:
    return FSDP_DTYPE_BF16;
  case FSDP_UNIT_DTYPE_FP16:
    return FSDP_DTYPE_FP16;
  default:
    return FSDP_DTYPE_FP32;
  }
}

/* Collections and their waiters. */

static fsdp_collection_t *collection_of(fsdp_unit_t *u, waiter_kind_t kind) {
  return kind == WAIT_UNSHARD ? &u->gather : &u->reduce;
}

static void op_init(fsdp_dataplane_op_t *op, fsdp_unit_t *unit, const fsdp_dataplane_rank_t *who,
                    waiter_kind_t kind, fsdp_dataplane_done_fn done, void *data) {
  *op = (fsdp_dataplane_op_t){.unit = unit, .who = *who, .kind = kind, .done = done,
                              .data = data};
  fsdp_list_init(&op->grad_waiter.link);
}

/* Calls the operation back, with OK or with err (< 0) and the message. The caller may reuse
 * its storage from then on, so nothing touches op after. */
static void op_ok(fsdp_dataplane_op_t *op) {
  fsdp_status_t st = FSDP_STATUS_INIT;
  op->done(op->data, &st);
}

__attribute__((format(printf, 3, 4))) static void op_fail(fsdp_dataplane_op_t *op, int err,
                                                         const char *fmt, ...) {
  fsdp_status_t st;
  va_list ap;
  va_start(ap, fmt);
  fsdp_status_setv(&st, err, fmt, ap);
  va_end(ap);
  op->done(op->data, &st);
}

static void op_unlink(fsdp_dataplane_op_t *op) {
  if (op->prev)
    op->prev->next = op->next;
  else
    op->unit->waiters = op->next;
  if (op->next)
    op->next->prev = op->prev;
}

static bool rank_waits(const fsdp_unit_t *u, uint32_t rank, waiter_kind_t kind) {
  for (const fsdp_dataplane_op_t *w = u->waiters; w; w = w->next)
    if (w->who.local_rank == rank && w->kind == (int)kind)
      return true;
  return false;
}

void fsdp_dataplane_cancel(fsdp_dataplane_op_t *op) {
  if (!fsdp_list_empty(&op->grad_waiter.link)) { /* waiting for its gradient buffer */
    fsdp_pool_cancel(&op->grad_waiter);
    return;
  }
  fsdp_unit_t *u = op->unit;
  uint32_t rank = op->who.local_rank;
  op_unlink(op);
  if (op->kind != WAIT_REGISTER && !rank_waits(u, rank, (waiter_kind_t)op->kind))
    fsdp_collection_withdraw(collection_of(u, (waiter_kind_t)op->kind), rank);
}

/* The operation waits in its unit until it is called back or cancelled. */
static void park(fsdp_dataplane_op_t *op) {
  fsdp_unit_t *unit = op->unit;
  op->prev = NULL;
  op->next = unit->waiters;
  if (unit->waiters)
    unit->waiters->prev = op;
  unit->waiters = op;
}

void fsdp_dataplane_buffers(const fsdp_unit_t *u, uint32_t rank,
                            fsdp_dataplane_buffers_t *ret_buffers) {
  *ret_buffers = (fsdp_dataplane_buffers_t){
      .master_offset = u->master_offset,
      .grad_offset = u->grad_offset,
      .shard = u->plan.first_shard + (u->plan.local_shards == 1 ? 0 : rank),
      .replica = fsdp_unit_plan_replica(&u->plan, rank),
      .host_first_shard = u->plan.first_shard,
      .host_shards = u->plan.local_shards,
      .gathered_step = u->gathered_step,
      .reduced_step = u->reduced_step,
  };
}

/* Calls back every waiter of `kind`: with the result, or with the unit's error once it
 * failed. */
static void wake(fsdp_unit_t *u, waiter_kind_t kind) {
  for (fsdp_dataplane_op_t *w = u->waiters, *next; w; w = next) {
    next = w->next;
    if (w->kind != (int)kind)
      continue;
    op_unlink(w);
    if (u->state == FSDP_UNIT_FAILED)
      op_fail(w, u->error.code, "%s", u->error.message);
    else
      op_ok(w);
  }
}

static void give_back_grads(fsdp_job_t *job, fsdp_unit_t *u, const fsdp_rank_set_t *ranks);
static void give_back_copy(fsdp_job_t *job, fsdp_unit_t *u);

static void drop_deferred(fsdp_job_t *job, fsdp_unit_t *u) {
  if (!u->has_deferred)
    return;
  u->has_deferred = false;
  u->n_deferred = 0;
  if (u->deferred_stage) {
    fsdp_staging_give(u->deferred_stage);
    u->deferred_stage = NULL;
  } else {
    fsdp_arena_release(job->arena, u->deferred_offset);
  }
}

static void give_back_sum(fsdp_job_t *job, fsdp_unit_t *u) {
  fsdp_staging_give(u->sum_stage);
  u->sum_stage = NULL;
  if (!u->has_sum)
    return;
  u->has_sum = false;
  fsdp_pool_give(&job->sums, u->sum_offset);
}

static void give_back_gather_stage(fsdp_unit_t *u) {
  fsdp_staging_give(u->gather_stage);
  u->gather_stage = NULL;
}

/* Reduces held for a snapshot (fsdp_dataplane_hold_reduces). */

static void unhold_reduce(fsdp_job_t *job, fsdp_unit_t *u) {
  if (!u->reduce_held)
    return;
  u->reduce_held = false;
  for (fsdp_unit_t **p = &job->held_reduces; *p; p = &(*p)->held_next)
    if (*p == u) {
      *p = u->held_next;
      break;
    }
}

/* Whether a reduce of the job runs (one held waits, and does not). */
static bool reducing(const fsdp_job_t *job) {
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (u->reduce.running && !u->reduce_held)
      return true;
  return false;
}

/* Tells the holder, once, that no reduce of the job runs any more: from then on every
 * reduce of the job waits, whatever its step. */
static void tell_if_quiet(fsdp_job_t *job) {
  void (*quiet)(void *arg) = job->reduces_quiet;
  if (!quiet || reducing(job))
    return;
  job->reduces_quiet = NULL;
  quiet(job->reduces_quiet_arg);
}

/* Ends the collection of `kind`: every waiter gets err and the message. What it held goes
 * back: the gradient buffers of the ranks that submitted to a reduce, and the copy a gather
 * was writing. */
static void abort_collection(fsdp_job_t *job, fsdp_unit_t *u, waiter_kind_t kind, int err,
                             const char *message) {
  fsdp_collection_t *c = collection_of(u, kind);
  for (fsdp_dataplane_op_t *w = u->waiters, *next; w; w = next) {
    next = w->next;
    if (w->kind != (int)kind)
      continue;
    op_unlink(w);
    op_fail(w, err, "%s", message);
  }
  if (kind == WAIT_REDUCE) {
    give_back_grads(job, u, &c->submitted);
    fsdp_pool_cancel(&u->sum_waiter);
    give_back_sum(job, u);
    if (c->running && u->has_deferred) { /* its hooks may have left it half added */
      log_warning("unit '%s': the gradients whose all-reduce among replicas was deferred are "
                  "dropped: the reduce of step %llu failed",
                  u->spec->unit, (unsigned long long)c->step);
      drop_deferred(job, u);
    }
  } else if (c->running) {
    /* The stage first: giving the copy back may start a waiting gather, which takes one. */
    give_back_gather_stage(u);
    fsdp_pool_cancel(&u->copy_waiter);
    give_back_copy(job, u);
  }
  if (kind == WAIT_UNSHARD)
    u->gather_ahead = false;
  fsdp_collection_reset(c);
  if (kind == WAIT_REDUCE) {
    unhold_reduce(job, u);
    tell_if_quiet(job);
  }
}

/* How a message names a step's second gather, the one for its backward. */
static const char *again_text(bool again) {
  return again ? " (its backward)" : "";
}

/* What a collection's ranks are asked for, in messages. */
static const char *collection_verb(waiter_kind_t kind) {
  return kind == WAIT_UNSHARD ? "unshard" : "reduce-scatter";
}

/* Parks op as its rank's part of the unit's collection of `kind` for `step`; returns
 * whether it completed the collection (every local rank has asked: it runs now), or -1 when
 * op was answered instead. A rank asking for another step than the one being collected
 * aborts the collection for everyone: nobody could complete it. */
static int collect(fsdp_unit_t *u, waiter_kind_t kind, fsdp_dataplane_op_t *op,
                   fsdp_job_t *job, uint64_t step, bool regather, uint64_t deadline_ms) {
  const fsdp_dataplane_rank_t *who = &op->who;
  uint32_t rank = who->local_rank;
  fsdp_collection_t *c = collection_of(u, kind);
  fsdp_rank_set_t died = {0};
  for (uint32_t r = 0; r < job->local_world_size; r++)
    if (who->serial < job->gone_before_serial[r])
      fsdp_rank_set_put(&died, r, true);
  fsdp_collection_request_t rq = {.rank = rank, .step = step, .regather = regather,
                                  .generation = who->generation, .deadline_ms = deadline_ms};
  char message[FSDP_STATUS_MESSAGE_MAX];
  int err;
  switch (fsdp_collection_join(c, job->local_world_size, &rq, &died)) {
  case FSDP_COLLECTION_JOINED:
    park(op);
    return 0;
  case FSDP_COLLECTION_COMPLETE:
    park(op);
    return 1;
  case FSDP_COLLECTION_RANKS_GONE: {
    char gone[128];
    fsdp_rank_set_format(&died, true, job->local_world_size, gone, sizeof gone);
    snprintf(message, sizeof message,
             "unit '%s' step %llu: local rank(s) %s of job '%s' ended their session and have "
             "not attached again; the %s cannot complete without them",
             u->spec->unit, (unsigned long long)step, gone, job->name, collection_verb(kind));
    err = FSDP_E_ABORTED;
    break;
  }
  case FSDP_COLLECTION_OTHER_GENERATION:
    snprintf(message, sizeof message,
             "unit '%s' step %llu: local rank %u attached with generation %llu while the other "
             "ranks attached with generation %llu: ranks of two runs of job '%s' cannot %s "
             "together",
             u->spec->unit, (unsigned long long)step, rank, (unsigned long long)who->generation,
             (unsigned long long)c->generation, job->name, collection_verb(kind));
    err = FSDP_E_FAILED_PRECONDITION;
    break;
  default: /* FSDP_COLLECTION_OTHER_STEP */
    snprintf(message, sizeof message,
             "unit '%s': local rank %u asked to %s step %llu%s while the other ranks asked for "
             "step %llu%s",
             u->spec->unit, rank, collection_verb(kind), (unsigned long long)step,
             again_text(regather), (unsigned long long)c->step, again_text(c->regather));
    err = FSDP_E_FAILED_PRECONDITION;
    break;
  }
  abort_collection(job, u, kind, err, message);
  op_fail(op, err, "%s", message);
  return -1;
}

/* This host's region of the flat buffer, in elements. */
static uint64_t host_first(const fsdp_unit_t *u) {
  return (uint64_t)u->plan.first_shard * u->layout.shard_numel;
}

static uint64_t host_numel(const fsdp_unit_t *u) {
  return (uint64_t)u->plan.local_shards * u->layout.shard_numel;
}

static fsdp_dtype_t param_dtype(const fsdp_unit_t *u) {
  return kernel_dtype(fsdp_unit_spec_param_dtype(u->spec));
}

static fsdp_dtype_t reduce_dtype(const fsdp_unit_t *u) {
  return kernel_dtype(fsdp_unit_spec_reduce_dtype(u->spec));
}

static size_t round64(size_t n) {
  return (n + 63) / 64 * 64;
}

/* Across hosts, the host sum lent to a reduce: the fp32 buffer the pre-reduction writes
 * first, then the sum in reduce_dtype (what the rings move) when that is narrower. */
static size_t host_sum_fp32_bytes(const fsdp_unit_t *u) {
  return round64((size_t)u->layout.padded_numel * 4);
}

static size_t host_sum_bytes(const fsdp_unit_t *u) {
  size_t reduce_size = fsdp_dtype_size(reduce_dtype(u));
  return host_sum_fp32_bytes(u) +
         (reduce_size == 4 ? 0 : round64((size_t)u->layout.padded_numel * reduce_size));
}

static float *host_sum_fp32(const fsdp_job_t *job, const fsdp_unit_t *u) {
  return (float *)(void *)((char *)fsdp_arena_base(job->arena) + u->sum_offset);
}

/* The host sum in reduce_dtype, in the arena. */
static char *arena_host_sum(const fsdp_job_t *job, const fsdp_unit_t *u) {
  bool fp32 = reduce_dtype(u) == FSDP_DTYPE_FP32;
  return (char *)host_sum_fp32(job, u) + (fp32 ? 0 : host_sum_fp32_bytes(u));
}

/* The host sum the rings move: its staged copy, where the backend stages the rings. */
static void *host_sum(const fsdp_job_t *job, const fsdp_unit_t *u) {
  return u->sum_stage ? u->sum_stage->base : arena_host_sum(job, u);
}

/* The local ranks' lent full gradients, in local rank order. */
static void full_grads(const fsdp_job_t *job, const fsdp_unit_t *u,
                       const void *srcs[FSDP_LOCAL_WORLD_MAX]) {
  const char *base = fsdp_arena_base(job->arena);
  for (unsigned r = 0; r < job->local_world_size; r++)
    srcs[r] = base + u->full_grad_offsets[r];
}

/* HYBRID_SHARD's deferred sum (fsdp_unit_t says when): this host's region in reduce_dtype. */
static char *deferred_sum(const fsdp_job_t *job, const fsdp_unit_t *u) {
  return u->deferred_stage ? u->deferred_stage->base
                           : (char *)fsdp_arena_base(job->arena) + u->deferred_offset;
}

/* Elements [begin, end) of the unit, from the host sum into the deferred sum: copied by the
 * first deferred reduce, added by the next ones (as FSDP2 adds its partial reduce output). */
static int keep_deferred(const fsdp_job_t *job, const fsdp_unit_t *u, uint64_t begin,
                         uint64_t end) {
  fsdp_dtype_t type = reduce_dtype(u);
  size_t size = fsdp_dtype_size(type);
  char *kept = deferred_sum(job, u) + (begin - host_first(u)) * size;
  const char *sum = (const char *)host_sum(job, u) + begin * size;
  return u->n_deferred == 0 ? fsdp_cast(kept, type, sum, type, end - begin)
                            : fsdp_add(kept, sum, type, end - begin);
}

/* Elements [begin, end) of the deferred sum, added to the host sum before its all-reduce. */
static int add_deferred(const fsdp_job_t *job, const fsdp_unit_t *u, uint64_t begin,
                        uint64_t end) {
  fsdp_dtype_t type = reduce_dtype(u);
  size_t size = fsdp_dtype_size(type);
  return fsdp_add((char *)host_sum(job, u) + begin * size,
                  deferred_sum(job, u) + (begin - host_first(u)) * size, type, end - begin);
}

/* Staged rings.
 *
 * Where the backend's memory is not the host's (a GPU's), the rings among hosts move host
 * buffers of the job's staging (daemon/store/staging.h) and the work around them copies to
 * and from the backend's memory, whole regions at once on the work queue, while the rings'
 * hooks that add on the host keep working there. A gather casts its region on the device
 * and copies it out (WORK_GATHER); the all-gather fills the other regions of the staged
 * copy, which WORK_UNSTAGE_GATHER copies in. A reduce makes the host sum on the device and
 * copies out what the first ring sends (WORK_STAGE_SUM); the rings reduce it on the host
 * (the host's kernels give the device's bits), the deferred sum of HYBRID_SHARD's
 * accumulation staying in host memory throughout; WORK_UNSTAGE_SUM copies this host's
 * region of the result in and writes the gradient shards from it on the device. The
 * additions are the one-host path's, in the same order, so the bits are too. */

static bool stages_rings(const fsdp_job_t *job) {
  return job->backend && job->backend->stages_rings;
}

static void forget_staging(void *arg, const void *base, size_t bytes) {
  fsdp_dataplane_t *dp = arg;
  if (dp->fabric)
    fsdp_fabric_forget_memory(dp->fabric, base, bytes);
}

static int take_stage(fsdp_dataplane_t *dp, fsdp_job_t *job, size_t bytes,
                      fsdp_staging_buffer_t **ret, fsdp_status_t *st) {
  return fsdp_staging_take(&job->staging, bytes, forget_staging, dp, ret, st);
}

/* The local ranks' full gradients from element `first` on. */
static void full_grads_from(const fsdp_job_t *job, const fsdp_unit_t *u, uint64_t first,
                            const void *srcs[FSDP_LOCAL_WORLD_MAX]) {
  full_grads(job, u, srcs);
  for (unsigned r = 0; r < job->local_world_size; r++)
    srcs[r] = (const char *)srcs[r] + first * fsdp_dtype_size(param_dtype(u));
}

/* WORK_STAGE_SUM: the host sum of what the first ring moves (the whole unit for a
 * reduce-scatter among the shard group, else this host's region, all that the all-reduce
 * among replicas moves), made on the device as fsdp_host_sum_range makes it on the host,
 * then staged. A host that is its own shard group then adds the deferred sum to it, or
 * keeps it as the deferred sum when it defers, as produce_host_sum and WORK_DEFER do. */
static int stage_host_sum(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                          fsdp_status_t *st) {
  bool whole = u->plan.shard_ring.members > 1;
  uint64_t begin = whole ? 0 : host_first(u);
  uint64_t n = whole ? u->layout.padded_numel : host_numel(u);
  fsdp_dtype_t type = reduce_dtype(u);
  size_t size = fsdp_dtype_size(type);
  const void *srcs[FSDP_LOCAL_WORLD_MAX];
  full_grads_from(job, u, begin, srcs);
  float *sum_fp32 = host_sum_fp32(job, u) + begin;
  char *sum = arena_host_sum(job, u) + begin * size;
  /* The reduce's staging buffers get their memory here, off the loop: the sum's, and the
   * deferred sum's, which this reduce's rings or keep_deferred below use first. */
  int r = fsdp_staging_make(&job->staging, u->sum_stage, st);
  if (r == 0 && u->deferred_stage)
    r = fsdp_staging_make(&job->staging, u->deferred_stage, st);
  if (r < 0)
    return r;
  r = fsdp_backend_reduce(&dp->backend, sum_fp32, false, srcs, job->local_world_size,
                          param_dtype(u), type, u->pre_scale, 1.0f, n, st);
  if (r == 0 && type != FSDP_DTYPE_FP32)
    r = fsdp_backend_cast(&dp->backend, sum, type, sum_fp32, FSDP_DTYPE_FP32, n, st);
  if (r == 0)
    r = fsdp_backend_copy(&dp->backend, (char *)host_sum(job, u) + begin * size, sum, n * size,
                          st);
  if (r < 0 || whole)
    return r;
  if (u->reduce_defer)
    return keep_deferred(job, u, begin, begin + n);
  return u->has_deferred ? add_deferred(job, u, begin, begin + n) : 0;
}

/* WORK_UNSTAGE_GATHER: the other hosts' regions of the staged copy into the unsharded
 * buffer. */
static int unstage_gather(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                          fsdp_status_t *st) {
  size_t size = fsdp_dtype_size(param_dtype(u));
  char *unsharded = (char *)fsdp_arena_base(job->shared_arena) + u->copy_offset;
  const char *staged = u->gather_stage->base;
  size_t mine = host_first(u) * size, mine_end = mine + host_numel(u) * size;
  int r = fsdp_backend_copy(&dp->backend, unsharded, staged, mine, st);
  return r < 0 ? r
               : fsdp_backend_copy(&dp->backend, unsharded + mine_end, staged + mine_end,
                                   u->layout.padded_numel * size - mine_end, st);
}

/* WORK_UNSTAGE_SUM: this host's region of the staged result back into the arena's host sum,
 * then divided by the postdivide factor into (or onto) the gradient shards there, as
 * finalize_grads does on the host. */
static int unstage_sum(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                       fsdp_status_t *st) {
  fsdp_dtype_t type = reduce_dtype(u);
  size_t size = fsdp_dtype_size(type);
  uint64_t first = host_first(u), n = host_numel(u);
  char *sum = arena_host_sum(job, u) + first * size;
  int r = fsdp_backend_copy(&dp->backend, sum, (const char *)host_sum(job, u) + first * size,
                            n * size, st);
  float *grads = (float *)(void *)((char *)fsdp_arena_base(job->arena) + u->grad_offset);
  const void *src = sum;
  return r < 0 ? r
               : fsdp_backend_reduce(&dp->backend, grads, u->reduce_accumulate, &src, 1, type,
                                     type, 1.0f, u->post_scale, n, st);
}

/* The work queue: one item at a time on libuv's thread pool. */

static void start_next(fsdp_dataplane_t *dp);

static void run_work(uv_work_t *req) {
  fsdp_dataplane_t *dp = req->data;
  fsdp_dataplane_work_t *w = dp->head;
  if (w->kind == WORK_CALL) {
    w->call_run(w->call_arg);
    return;
  }
  fsdp_unit_t *u = w->unit;
  char *base = fsdp_arena_base(w->job->arena);
  unsigned world = w->job->local_world_size;
  const void *srcs[FSDP_LOCAL_WORLD_MAX];
  full_grads(w->job, u, srcs);
  uint64_t first = host_first(u), n = host_numel(u);
  uint64_t start_ns = fsdp_clock_now_ns();
  switch (w->kind) {
  case WORK_PREFAULT:
    w->result = fsdp_arena_prefault_range(w->job->arena, u->buffers_offset, w->bytes);
    break;
  case WORK_GATHER: {
    /* This host's shards: its region of the fp32 masters cast into param_dtype. */
    fsdp_dtype_t pt = param_dtype(u);
    char *unsharded = (char *)fsdp_arena_base(w->job->shared_arena) + u->copy_offset;
    size_t at = first * fsdp_dtype_size(pt), bytes = n * fsdp_dtype_size(pt);
    w->result = fsdp_backend_cast(&dp->backend, unsharded + at, pt, base + u->master_offset,
                                  FSDP_DTYPE_FP32, n, &w->error);
    if (w->result == 0 && u->gather_stage &&
        (w->result = fsdp_staging_make(&w->job->staging, u->gather_stage, &w->error)) == 0)
      w->result = fsdp_backend_copy(&dp->backend, (char *)u->gather_stage->base + at,
                                    unsharded + at, bytes, &w->error);
    break;
  }
  case WORK_REDUCE:
    /* One host: the gradient shards lie side by side, so one reduce over the whole flat
     * buffer writes every rank's shard. */
    w->result = fsdp_backend_reduce(&dp->backend, (float *)(void *)(base + u->grad_offset),
                                    u->reduce_accumulate, srcs, world, param_dtype(u),
                                    reduce_dtype(u), u->pre_scale, u->post_scale,
                                    u->layout.padded_numel, &w->error);
    break;
  case WORK_OPTIMIZE:
    w->result = fsdp_optimizer_run(&w->plan, &dp->backend, &w->error);
    break;
  case WORK_NORM:
    w->result = fsdp_optimizer_grad_norm_sq(w->job, u, &dp->backend, &w->norm_sq, &w->error);
    break;
  case WORK_DEFER:
    w->result = fsdp_host_sum_range(host_sum(w->job, u), host_sum_fp32(w->job, u), srcs, world,
                                    param_dtype(u), reduce_dtype(u), u->pre_scale, first,
                                    first + n);
    if (w->result == 0)
      w->result = keep_deferred(w->job, u, first, first + n);
    break;
  case WORK_STAGE_SUM:
    w->result = stage_host_sum(dp, w->job, u, &w->error);
    break;
  case WORK_UNSTAGE_GATHER:
    w->result = unstage_gather(dp, w->job, u, &w->error);
    break;
  case WORK_UNSTAGE_SUM:
    w->result = unstage_sum(dp, w->job, u, &w->error);
    break;
  case WORK_CALL: /* not a unit's: run above */
    break;
  }
  w->run_ns = fsdp_clock_now_ns() - start_ns;
}

static void wake_unshards(fsdp_job_t *job, fsdp_unit_t *u);

/* A collective of `kind` ended for the local ranks (st: NULL or OK when it succeeded):
 * every waiter hears the result. A gather lends its copy to every rank that asked; a
 * reduce gives the ranks' gradient buffers back. */
static void finish_collective(fsdp_job_t *job, fsdp_unit_t *u, waiter_kind_t kind,
                              const fsdp_status_t *st) {
  fsdp_collection_t *c = collection_of(u, kind);
  if (st && st->code < 0) {
    log_error("%s", st->message);
    abort_collection(job, u, kind, st->code, st->message);
    return;
  }
  fsdp_dataplane_reached_step(job, c->step);
  if (kind == WAIT_UNSHARD) {
    give_back_gather_stage(u);
    u->gathered = true;
    u->gathered_step = c->step;
    u->gathered_again = c->regather;
    u->holders = c->submitted;
    u->gather_ahead = false;
    fsdp_collection_reset(c);
    if (fsdp_rank_set_empty(&u->holders)) { /* every rank it was for is gone */
      give_back_copy(job, u);
      return;
    }
    wake_unshards(job, u);
    return;
  }
  u->reduced_step = c->step;
  if (u->reduce_defer)
    u->n_deferred++;
  else
    drop_deferred(job, u); /* the all-reduce took it */
  give_back_grads(job, u, &c->submitted);
  give_back_sum(job, u);
  wake(u, kind);
  fsdp_collection_reset(c);
  tell_if_quiet(job);
}

static int queue(fsdp_dataplane_t *dp, work_kind_t kind, fsdp_job_t *job, fsdp_unit_t *unit);
static void queue_or_abort(fsdp_dataplane_t *dp, work_kind_t kind, fsdp_job_t *job,
                           fsdp_unit_t *unit);
static void start_ring(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                       fsdp_ring_kind_t kind);
static void start_step(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u);
static void step_if_every_norm(fsdp_dataplane_t *dp, fsdp_job_t *job, uint64_t step);
static void start_norm_ring(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                            double part);

/* The unit's part of the step's squared norm is known (its whole shard group's): it waits
 * for the other units' and steps with them. */
static void norm_known(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u, double norm_sq) {
  u->norm_sq = norm_sq;
  u->awaiting_norm = true;
  u->norm_deadline_ms = uv_now(dp->loop) + dp->collective_timeout_ms;
  step_if_every_norm(dp, job, u->reduce.step);
}

/* What follows a stage of a collective that succeeded: a work item (done_work) or a ring
 * (done_ring); the other is -1. This host's cast is followed by the all-gather among the
 * shard group, a reduce-scatter among the shard group by the all-reduce among the replicas,
 * if any and not deferred; a reduce that steps the optimizer by its step; every other stage
 * ends its collective. */
static void next_stage(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u, int done_work,
                       int done_ring) {
  /* Staged rings: the staged copy's or sum's way back follows the last ring. */
  bool wrote_grads = done_ring == FSDP_RING_ALL_REDUCE ||
                     (done_ring == FSDP_RING_REDUCE_SCATTER && u->plan.replica_ring.members == 1);
  if (done_work == WORK_GATHER && u->plan.shard_ring.members > 1)
    start_ring(dp, job, u, FSDP_RING_ALL_GATHER);
  else if (done_ring == FSDP_RING_ALL_GATHER && u->gather_stage)
    queue_or_abort(dp, WORK_UNSTAGE_GATHER, job, u);
  else if (done_work == WORK_GATHER || done_ring == FSDP_RING_ALL_GATHER ||
           done_work == WORK_UNSTAGE_GATHER)
    finish_collective(job, u, WAIT_UNSHARD, NULL);
  else if (done_work == WORK_STAGE_SUM && u->plan.shard_ring.members > 1)
    start_ring(dp, job, u, FSDP_RING_REDUCE_SCATTER);
  else if ((done_work == WORK_STAGE_SUM && !u->reduce_defer) ||
           (done_ring == FSDP_RING_REDUCE_SCATTER && u->plan.replica_ring.members > 1 &&
            !u->reduce_defer))
    start_ring(dp, job, u, FSDP_RING_ALL_REDUCE);
  else if (wrote_grads && u->sum_stage)
    queue_or_abort(dp, WORK_UNSTAGE_SUM, job, u);
  else if (done_work != WORK_OPTIMIZE && u->reduce_step) {
    /* The sum is written: its pool buffer goes back before the step, which with clipping
     * waits for every other unit's reduce, and those may need it. */
    give_back_sum(job, u);
    start_step(dp, job, u);
  }
  else
    finish_collective(job, u, WAIT_REDUCE, NULL);
}

static void work_done(uv_work_t *req, int status) {
  fsdp_dataplane_t *dp = req->data;
  fsdp_dataplane_work_t *w = dp->head;
  dp->head = w->next;
  if (!dp->head)
    dp->tail = NULL;
  fsdp_unit_t *u = w->unit;
  int r = status < 0 ? status : w->result;
  if (w->kind == WORK_CALL) {
    w->call_ran(w->call_arg, status);
    free(w);
    dp->busy = false;
    start_next(dp);
    return;
  }
  if (w->kind == WORK_GATHER)
    u->last_gather_us = w->run_ns / 1000;
  else if (w->kind == WORK_REDUCE)
    u->last_reduce_us = w->run_ns / 1000;
  if (w->kind == WORK_PREFAULT) {
    if (r < 0) {
      fsdp_status_set(&u->error, r, "unit '%s': %s failed: %s", u->spec->unit,
                      work_names[w->kind], fsdp_strerror(r));
      log_error("%s", u->error.message);
      u->state = FSDP_UNIT_FAILED;
    } else {
      u->state = FSDP_UNIT_READY;
    }
    wake(u, WAIT_REGISTER);
  } else if (r < 0) {
    waiter_kind_t kind =
        w->kind == WORK_GATHER || w->kind == WORK_UNSTAGE_GATHER ? WAIT_UNSHARD : WAIT_REDUCE;
    if (w->kind == WORK_OPTIMIZE) /* which elements it stepped is unknown: start again */
      log_error("unit '%s': its masters and optimizer state may be half stepped",
                u->spec->unit);
    fsdp_status_t st;
    fsdp_status_set(&st, FSDP_E_INTERNAL, "job '%s' unit '%s' step %llu: %s failed: %s",
                    w->job->name, u->spec->unit,
                    (unsigned long long)collection_of(u, kind)->step, work_names[w->kind],
                    w->error.code < 0 ? w->error.message : fsdp_strerror(r));
    finish_collective(w->job, u, kind, &st);
  } else if (w->kind == WORK_NORM) {
    if (u->plan.shard_ring.members > 1)
      start_norm_ring(dp, w->job, u, w->norm_sq);
    else
      norm_known(dp, w->job, u, w->norm_sq);
  } else {
    next_stage(dp, w->job, u, (int)w->kind, -1);
  }
  if (w->kind == WORK_OPTIMIZE && w->plan.step)
    fsdp_optimizer_stepped(w->job, u, w->plan.step);
  fsdp_optimizer_plan_cleanup(&w->plan);
  free(w);
  dp->busy = false;
  start_next(dp);
}

/* Rings among hosts.
 *
 * A reduce's local work rides on its rings' hooks, chunk by chunk, so it overlaps the
 * transfers: the first ring (the reduce-scatter among the shard group, or the all-reduce
 * among replicas when the group is this host alone) produces each chunk of the host sum
 * from the local ranks' full gradients (the host-level pre-reduction: one contribution per
 * host leaves it); the last ring finalizes each chunk of this host's region into its
 * ranks' gradient shards (the post-reduction). A gather casts its region first and then
 * starts its ring: the cast is a copy at memory speed, and feeding it through the hooks
 * cost more in round trips to the thread pool than it hid (docs/PERFORMANCE.md). */

typedef struct ring_run {
  fsdp_dataplane_t *dp;
  fsdp_job_t *job;
  fsdp_unit_t *unit;
  fsdp_ring_kind_t kind;
  /* The all-reduce among the shard group of the unit's part of the gradient's squared norm
   * (clipping): one fp32 element per member, this host's part in the first, summed there.
   * Not registered with UCX: a few bytes, and the run's own. */
  bool norm;
  float norm_parts[FSDP_RING_MAX];
  uint64_t first_elem;   /* the unit's element at the start of the ring's buffer */
  uint64_t region_numel; /* elements per region of the ring */
  size_t elem_size;      /* of the ring's dtype */
  void *scratch;         /* a sum's staging buffer, from the pool */
  struct ring_run *next; /* while waiting for the cluster */
} ring_run_t;

/* The unit's element at the start of a ring chunk. */
static uint64_t chunk_elem(const ring_run_t *run, unsigned region, size_t offset) {
  return run->first_elem + region * run->region_numel + offset / run->elem_size;
}

/* On a pool thread: a chunk of the host sum, from the local ranks' full gradients (in fp32,
 * then in reduce_dtype when that is narrower), divided by the predivide factor. */
static int produce_host_sum(void *arg, unsigned region, size_t offset, size_t bytes) {
  ring_run_t *run = arg;
  const fsdp_unit_t *u = run->unit;
  uint64_t e = chunk_elem(run, region, offset);
  size_t n = bytes / run->elem_size;
  const void *srcs[FSDP_LOCAL_WORLD_MAX];
  full_grads(run->job, u, srcs);
  int r = fsdp_host_sum_range(host_sum(run->job, u), host_sum_fp32(run->job, u), srcs,
                              run->job->local_world_size, param_dtype(u), reduce_dtype(u),
                              u->pre_scale, e, e + n);
  /* The all-reduce among replicas of a host that is its own shard group: the host sum is
   * the group's, and the deferred one joins it here. */
  if (r == 0 && run->kind == FSDP_RING_ALL_REDUCE && u->has_deferred)
    r = add_deferred(run->job, u, e, e + n);
  return r;
}

/* On a pool thread: a final chunk of this host's region of the shard group's sum, kept
 * (a deferred reduce) or joined by the deferred sum before the all-reduce among replicas. */
static int keep_group_sum(void *arg, unsigned region, size_t offset, size_t bytes) {
  ring_run_t *run = arg;
  uint64_t e = chunk_elem(run, region, offset);
  return keep_deferred(run->job, run->unit, e, e + bytes / run->elem_size);
}

static int add_to_group_sum(void *arg, unsigned region, size_t offset, size_t bytes) {
  ring_run_t *run = arg;
  uint64_t e = chunk_elem(run, region, offset);
  return add_deferred(run->job, run->unit, e, e + bytes / run->elem_size);
}

/* On a pool thread: a final chunk of this host's region of the sum, divided by the
 * postdivide factor into (or onto, when accumulating) the ranks' fp32 gradient shards. */
static int finalize_grads(void *arg, unsigned region, size_t offset, size_t bytes) {
  ring_run_t *run = arg;
  const fsdp_unit_t *u = run->unit;
  uint64_t e = chunk_elem(run, region, offset);
  float *grads = (float *)(void *)((char *)fsdp_arena_base(run->job->arena) + u->grad_offset);
  const void *sum = (const char *)host_sum(run->job, u) + e * run->elem_size;
  return fsdp_reduce(grads + (e - host_first(u)), u->reduce_accumulate, &sum, 1,
                     reduce_dtype(u), reduce_dtype(u), 1.0f, u->post_scale,
                     bytes / run->elem_size);
}

/* Rings move 1 MiB chunks, 8 in flight; a sum stages what it receives in a buffer of that
 * size. The buffers are kept for the next ring once faulted in: no collective faults fresh
 * pages. */
#define RING_CHUNK ((size_t)1 << 20)
#define RING_WINDOW 8u
#define RING_SCRATCH (RING_CHUNK * RING_WINDOW)

static void *take_scratch(fsdp_dataplane_t *dp) {
  void *s = dp->free_scratch;
  if (s) {
    memcpy(&dp->free_scratch, s, sizeof(void *));
    return s;
  }
  if (posix_memalign(&s, 4096, RING_SCRATCH) != 0)
    return NULL;
  memset(s, 0, RING_SCRATCH);
  return s;
}

static void give_back_scratch(fsdp_dataplane_t *dp, void *s) {
  if (!s)
    return;
  memcpy(s, &dp->free_scratch, sizeof(void *));
  dp->free_scratch = s;
}

/* The same on every host, different for every collective that may run at once: the job,
 * its run (generation), the unit, the step (and whether this is its second gather) and the
 * ring. A failed ring can leave messages
 * unmatched at a host (UCX matches tags worker-wide, whoever sent them); the run keeps them
 * from the rings of the job's next run, which redoes the same steps. */
static uint32_t ring_op_id(const ring_run_t *run, const fsdp_collection_t *c) {
  const fsdp_job_t *job = run->job;
  const fsdp_unit_t *u = run->unit;
  uint32_t op_kind = run->norm                                            ? FSDP_OP_KIND_NORM
                     : run->kind == FSDP_RING_ALL_GATHER && c->regather ? FSDP_OP_KIND_REGATHER
                                                                        : (uint32_t)run->kind;
  return fsdp_op_id(job->name, u->spec->unit, c->step, c->generation, op_kind);
}

static waiter_kind_t ring_waiter_kind(fsdp_ring_kind_t kind) {
  return kind == FSDP_RING_ALL_GATHER ? WAIT_UNSHARD : WAIT_REDUCE;
}

static void on_ring_done(fsdp_ring_t *ring, const fsdp_status_t *status, void *arg) {
  (void)ring;
  ring_run_t *run = arg;
  fsdp_unit_t *u = run->unit;
  give_back_scratch(run->dp, run->scratch);
  if (status->code < 0) {
    fsdp_status_t st;
    fsdp_status_set(&st, status->code, "job '%s' unit '%s' step %llu: %s", run->job->name,
                    u->spec->unit,
                    (unsigned long long)collection_of(u, ring_waiter_kind(run->kind))->step,
                    status->message);
    finish_collective(run->job, u, ring_waiter_kind(run->kind), &st);
  } else if (run->norm) {
    norm_known(run->dp, run->job, u, run->norm_parts[0]);
  } else {
    if (run->kind == FSDP_RING_ALL_REDUCE)
      u->replica_all_reduces++;
    next_stage(run->dp, run->job, u, -1, (int)run->kind);
  }
  free(run);
}

static void on_cluster_ready(void *data, int status, const char *why);

/* The arena's bytes, for forgetting what was registered in it. */
static size_t arena_capacity(const fsdp_arena_t *arena) {
  fsdp_arena_stats_t stats;
  fsdp_arena_get_stats(arena, &stats);
  return stats.capacity;
}

/* Starts a ring of the unit's collective once the hosts it needs are connected; while the
 * cluster is still joining, it waits for it (at most peer.join_timeout after start). */
static void start_run(ring_run_t *run) {
  fsdp_dataplane_t *dp = run->dp;
  fsdp_unit_t *u = run->unit;
  waiter_kind_t wkind = ring_waiter_kind(run->kind);
  uint64_t step = collection_of(u, wkind)->step;
  const fsdp_host_ring_t *hosts = run->kind == FSDP_RING_ALL_REDUCE && !run->norm
                                       ? &u->plan.replica_ring
                                       : &u->plan.shard_ring;
  fsdp_ucx_peer_t *peers[FSDP_RING_MAX] = {0};
  fsdp_status_t st;
  for (unsigned i = 0; i < hosts->members; i++) {
    const char *why = "the data plane is not running";
    unsigned host = fsdp_host_ring_host(hosts, i);
    if (i == hosts->self || (dp->fabric && (peers[i] = fsdp_fabric_peer(dp->fabric, host, &why))))
      continue;
    if (dp->peers && !fsdp_peers_ready(dp->peers)) {
      run->next = dp->cluster_waiting;
      dp->cluster_waiting = run;
      if (!dp->waiting_for_cluster) {
        dp->waiting_for_cluster = true;
        fsdp_peers_when_ready(dp->peers, &dp->cluster_waiter, on_cluster_ready, dp);
      }
      return;
    }
    fsdp_status_set(&st, FSDP_E_UNAVAILABLE,
                    "job '%s' unit '%s' step %llu: the %s needs host %u: %s", run->job->name,
                    u->spec->unit, (unsigned long long)step, fsdp_ring_kind_name(run->kind),
                    host, why);
    finish_collective(run->job, u, wkind, &st);
    free(run);
    return;
  }
  bool gather = run->kind == FSDP_RING_ALL_GATHER;
  fsdp_dtype_t dtype = gather ? param_dtype(u) : reduce_dtype(u);
  run->elem_size = fsdp_dtype_size(dtype);
  run->region_numel = host_numel(u);
  if (run->kind == FSDP_RING_ALL_REDUCE) { /* this host's region, among its replicas */
    run->first_elem = host_first(u);
    run->region_numel /= hosts->members;
  }
  /* The unit's buffer the rings move (its unsharded copy or its host sum) is registered
   * with UCX once, on its first ring, and stays so until its job goes; only that, since
   * registering pins memory on RDMA transports, and an arena is mostly not in use. */
  fsdp_staging_buffer_t *stage = gather ? u->gather_stage : u->sum_stage;
  char *whole = stage ? stage->base
                : gather ? (char *)fsdp_arena_base(run->job->shared_arena) + u->copy_offset
                         : host_sum(run->job, u);
  const fsdp_ucx_mem_t *whole_mem = NULL;
  if (run->norm) {
    dtype = FSDP_DTYPE_FP32;
    run->elem_size = sizeof run->norm_parts[0];
    run->first_elem = 0;
    run->region_numel = 1;
    whole = (char *)run->norm_parts;
  } else {
    /* A staging buffer is registered whole: one registration whatever unit it serves. */
    whole_mem = fsdp_fabric_memory(dp->fabric, whole,
                                   stage ? stage->bytes : u->layout.padded_numel * run->elem_size);
  }
  char *buf = whole + run->first_elem * run->elem_size;
  /* The reduce's first ring makes the host sum, its last one writes the gradient shards; a
   * reduce-scatter followed by an all-reduce keeps its result for a later one, or adds what
   * was kept, when the all-reduce is deferred. */
  bool first_of_reduce = run->kind == FSDP_RING_REDUCE_SCATTER || u->plan.shard_ring.members == 1;
  bool last_of_reduce = run->kind == FSDP_RING_ALL_REDUCE || u->plan.replica_ring.members == 1;
  int (*finalize)(void *, unsigned, size_t, size_t) =
      gather || run->norm ? NULL
      : last_of_reduce    ? (stage ? NULL : finalize_grads) /* else WORK_UNSTAGE_SUM */
      : u->reduce_defer   ? keep_group_sum
      : u->has_deferred   ? add_to_group_sum
                          : NULL;
  if (!gather && !(run->scratch = take_scratch(dp))) {
    fsdp_status_set(&st, FSDP_E_RESOURCE_EXHAUSTED,
                    "job '%s' unit '%s' step %llu: out of memory for the %s's staging buffer",
                    run->job->name, u->spec->unit, (unsigned long long)step,
                    fsdp_ring_kind_name(run->kind));
    finish_collective(run->job, u, wkind, &st);
    free(run);
    return;
  }
  fsdp_ring_args_t args = {
      .kind = run->kind,
      .n = hosts->members,
      .self = hosts->self,
      .peers = peers,
      .buf = buf,
      .region_bytes = run->region_numel * run->elem_size,
      .dtype = dtype,
      .op_id = ring_op_id(run, collection_of(u, wkind)),
      .deadline_ms = uv_now(dp->loop) + dp->collective_timeout_ms,
      .chunk_bytes = RING_CHUNK,
      .window = RING_WINDOW,
      .scratch = run->scratch,
      .scratch_bytes = run->scratch ? RING_SCRATCH : 0,
      .buf_mem = whole_mem,
      .scratch_mem = run->scratch ? fsdp_fabric_memory(dp->fabric, run->scratch, RING_SCRATCH)
                                  : NULL,
      .produce = !gather && !run->norm && first_of_reduce && !stage ? produce_host_sum : NULL,
      .finalize = finalize,
      .hook_arg = run,
  };
  fsdp_ring_t *ring;
  if (fsdp_ring_start(fsdp_fabric_ucx(dp->fabric), &args, on_ring_done, run, &ring, &st) < 0) {
    give_back_scratch(dp, run->scratch);
    finish_collective(run->job, u, wkind, &st);
    free(run);
  }
}

/* A run like `proto`, started. */
static void launch_run(const ring_run_t *proto) {
  ring_run_t *run = malloc(sizeof *run);
  if (!run) {
    abort_collection(proto->job, proto->unit, ring_waiter_kind(proto->kind),
                     FSDP_E_RESOURCE_EXHAUSTED, "out of memory starting a collective among hosts");
    return;
  }
  *run = *proto;
  start_run(run);
}

static void start_ring(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                       fsdp_ring_kind_t kind) {
  launch_run(&(ring_run_t){.dp = dp, .job = job, .unit = u, .kind = kind});
}

/* Clipping a unit that spans hosts: its shard group's parts of the norm are summed among
 * them (each group holds every shard once, and replicas hold the same gradient shards), each
 * part rounded to fp32 and added in fp32 in the ring's order: member 1's, plus member 2's,
 * ..., plus member 0's, which every member then receives. */
static void start_norm_ring(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                            double part) {
  launch_run(&(ring_run_t){.dp = dp, .job = job, .unit = u, .kind = FSDP_RING_ALL_REDUCE,
                           .norm = true, .norm_parts = {(float)part}});
}

static void on_cluster_ready(void *data, int status, const char *why) {
  fsdp_dataplane_t *dp = data;
  ring_run_t *runs = dp->cluster_waiting;
  dp->cluster_waiting = NULL;
  dp->waiting_for_cluster = false;
  while (runs) {
    ring_run_t *run = runs;
    runs = run->next;
    if (status == 0) {
      start_run(run);
      continue;
    }
    fsdp_unit_t *u = run->unit;
    waiter_kind_t kind = ring_waiter_kind(run->kind);
    fsdp_status_t st;
    fsdp_status_set(&st, status, "job '%s' unit '%s' step %llu: the hosts did not all join: %s",
                    run->job->name, u->spec->unit,
                    (unsigned long long)collection_of(u, kind)->step, why);
    finish_collective(run->job, u, kind, &st);
    free(run);
  }
}

static void start_next(fsdp_dataplane_t *dp) {
  if (dp->busy || !dp->head)
    return;
  dp->busy = true;
  dp->req.data = dp;
  int r = uv_queue_work(dp->loop, &dp->req, run_work, work_done);
  if (r < 0)
    work_done(&dp->req, r); /* fails the item and moves on */
}


static void enqueue(fsdp_dataplane_t *dp, fsdp_dataplane_work_t *w);

static int queue(fsdp_dataplane_t *dp, work_kind_t kind, fsdp_job_t *job, fsdp_unit_t *unit) {
  fsdp_dataplane_work_t *w = calloc(1, sizeof *w);
  if (!w)
    return -ENOMEM;
  *w = (fsdp_dataplane_work_t){.kind = kind, .job = job, .unit = unit};
  if (kind == WORK_PREFAULT)
    w->bytes = fsdp_arena_block_size(job->arena, unit->buffers_offset);
  enqueue(dp, w);
  return 0;
}

/* A stage of a running collective, queued, or the collective aborted. */
static void queue_or_abort(fsdp_dataplane_t *dp, work_kind_t kind, fsdp_job_t *job,
                           fsdp_unit_t *unit) {
  int r = queue(dp, kind, job, unit);
  if (r < 0)
    abort_collection(job, unit, kind == WORK_UNSTAGE_GATHER ? WAIT_UNSHARD : WAIT_REDUCE, r,
                     "cannot queue the collective's next stage");
}

static void queue_step(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u, bool clip,
                       float clip_coef);

/* The unit's optimizer step, after its reduce wrote the gradient shards; the reduce ends
 * with it. A step the unit took already (a restarted run repeating it) is not taken again.
 * With clipping, the step waits for the norm of the whole gradient: this unit's part is
 * summed first. */
static void start_step(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u) {
  uint64_t step = u->reduce.step;
  if (step <= u->stepped_step) {
    log_info("unit '%s' step %llu: its optimizer step was taken already", u->spec->unit,
             (unsigned long long)step);
    finish_collective(job, u, WAIT_REDUCE, NULL);
    return;
  }
  if (fsdp_optimizer_max_grad_norm(job) > 0) {
    int r = queue(dp, WORK_NORM, job, u);
    if (r < 0)
      abort_collection(job, u, WAIT_REDUCE, r, "cannot queue the gradient's norm");
    return;
  }
  queue_step(dp, job, u, false, 1.0f);
}

/* Once the reduce of the step of every unit the optimizer steps wrote its gradient shards
 * and summed its part of the norm: the clip coefficient, and every unit's step with it. The
 * parts are added in the units' order of registration, the same on every run. The
 * coefficient is torch 2.13's clip_grad_norm_'s arithmetic on its fp32 total_norm tensor,
 * so that equal norms clip to equal bits: max_norm / (total_norm + 1e-6) is the fp32 sum
 * with the fp32 rounding of 1e-6, its reciprocal (Tensor.__rtruediv__) times max_norm in
 * fp32, then clamp(max=1.0), which keeps a NaN. A direct division differs from it in the
 * last bit for a tenth of norms when max_norm is no power of two. */
static void step_if_every_norm(fsdp_dataplane_t *dp, fsdp_job_t *job, uint64_t step) {
  double total = 0;
  for (const fsdp_unit_t *u = job->units; u; u = u->next) {
    if (!fsdp_optimizer_steps_unit(job, u))
      continue;
    if (!u->awaiting_norm || u->reduce.step != step)
      return; /* its reduce of the step has not written its gradient yet */
    total += u->norm_sq;
  }
  float norm = (float)sqrt(total);
  float coef = 1.0f / (norm + (float)1e-6) * (float)fsdp_optimizer_max_grad_norm(job);
  if (coef > 1.0f)
    coef = 1.0f;
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    if (!fsdp_optimizer_steps_unit(job, u))
      continue;
    u->awaiting_norm = false;
    queue_step(dp, job, u, true, coef);
  }
}

static void queue_step(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u, bool clip,
                       float clip_coef) {
  uint64_t step = u->reduce.step;
  fsdp_status_t st;
  fsdp_dataplane_work_t *w = calloc(1, sizeof *w);
  if (!w) {
    abort_collection(job, u, WAIT_REDUCE, FSDP_E_RESOURCE_EXHAUSTED,
                     "out of memory for the optimizer step");
    return;
  }
  *w = (fsdp_dataplane_work_t){.kind = WORK_OPTIMIZE, .job = job, .unit = u};
  if (fsdp_optimizer_plan(job, u, &w->plan, &st) < 0) {
    free(w);
    fsdp_status_t failed;
    fsdp_status_set(&failed, st.code, "unit '%s' step %llu: %s", u->spec->unit,
                    (unsigned long long)step, st.message);
    finish_collective(job, u, WAIT_REDUCE, &failed);
    return;
  }
  w->plan.clip = clip;
  w->plan.clip_coef = clip_coef;
  u->stepped_step = step;
  enqueue(dp, w);
}

static void enqueue(fsdp_dataplane_t *dp, fsdp_dataplane_work_t *w) {
  if (dp->tail)
    dp->tail->next = w;
  else
    dp->head = w;
  dp->tail = w;
  start_next(dp);
}

int fsdp_dataplane_queue_call(fsdp_dataplane_t *dp, fsdp_job_t *job, void (*run)(void *arg),
                              void (*ran)(void *arg, int status), void *arg, fsdp_status_t *st) {
  fsdp_dataplane_work_t *w = calloc(1, sizeof *w);
  if (!w)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for a work item");
  *w = (fsdp_dataplane_work_t){
      .kind = WORK_CALL, .job = job, .call_run = run, .call_ran = ran, .call_arg = arg};
  enqueue(dp, w);
  return 0;
}

/* Operations. */

/* Takes the unit's persistent buffers from the arena, in one block: this host's master
 * shards and gradient shards. The block starts on a page, so that a trainer can map the
 * masters as the unit's copy. */
static int allocate(fsdp_job_t *job, fsdp_unit_t *u, fsdp_status_t *st) {
  size_t padded = (size_t)u->layout.padded_numel;
  size_t host_fp32 = round64((size_t)host_numel(u) * 4);
  fsdp_arena_stats_t stats;
  fsdp_arena_get_stats(job->arena, &stats);
  uint64_t base;
  int r = fsdp_arena_alloc(job->arena, 2 * host_fp32, stats.page_size, &base, st);
  if (r < 0)
    return r;
  u->buffers_offset = u->master_offset = base;
  u->grad_offset = u->master_offset + host_fp32;
  u->copy_in_masters = param_dtype(u) == FSDP_DTYPE_FP32 && host_numel(u) == padded;
  return 0;
}

void fsdp_dataplane_register(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit,
                             const fsdp_dataplane_rank_t *who, fsdp_dataplane_op_t *op,
                             fsdp_dataplane_done_fn done, void *data) {
  op_init(op, unit, who, WAIT_REGISTER, done, data);
  fsdp_status_t st;
  switch (unit->state) {
  case FSDP_UNIT_NEW:
    if (!job->resume_looked && dp->hooks.job_starts)
      dp->hooks.job_starts(dp->hooks.ctx, job);
    job->resume_looked = true;
    if (job->resume_from && !unit->spec->scratch)
      unit->reduced_step = job->resume_step; /* its trainers go on after it */
    if (allocate(job, unit, &st) < 0) {
      op_fail(op, st.code, "%s", st.message);
      return;
    }
    int r = queue(dp, WORK_PREFAULT, job, unit);
    if (r < 0) {
      fsdp_arena_release(job->arena, unit->buffers_offset);
      op_fail(op, r, "cannot queue the buffers' preparation");
      return;
    }
    unit->state = FSDP_UNIT_ALLOCATING;
    park(op);
    return;
  case FSDP_UNIT_ALLOCATING:
    park(op);
    return;
  case FSDP_UNIT_FAILED:
    op_fail(op, unit->error.code, "%s", unit->error.message);
    return;
  default:
    op_ok(op);
  }
}

/* Whether the unit's buffers are there to work on; st says why not. */
static int check_ready(const fsdp_unit_t *unit, fsdp_status_t *st) {
  switch (unit->state) {
  case FSDP_UNIT_FAILED:
    return fsdp_status_set(st, unit->error.code, "%s", unit->error.message);
  case FSDP_UNIT_NEW:
  case FSDP_UNIT_ALLOCATING:
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "unit '%s' has no buffers yet: its RegisterUnit has not succeeded",
                           unit->spec->unit);
  default:
    return 0;
  }
}

/* Whether the unit's buffers are there to work on; fails op otherwise. */
static bool ready(fsdp_dataplane_op_t *op) {
  fsdp_status_t st;
  if (check_ready(op->unit, &st) == 0)
    return true;
  op->done(op->data, &st);
  return false;
}

/* Lending. */

static size_t copy_bytes(const fsdp_unit_t *u) {
  return (size_t)u->layout.padded_numel * fsdp_dtype_size(param_dtype(u));
}

/* The unit's copy goes back: to the pool (which may lend it to a gather waiting there at
 * once), or to the arena. */
static void give_back_copy(fsdp_job_t *job, fsdp_unit_t *u) {
  if (!u->has_copy)
    return;
  u->has_copy = false;
  u->gathered = false;
  if (u->copy_pooled)
    fsdp_pool_give(&job->copies, u->copy_offset);
  else
    fsdp_arena_release(job->shared_arena, u->copy_offset);
}

/* rank lets go of the unit's copy; the last holder's letting go gives it back. */
static void let_go(fsdp_job_t *job, fsdp_unit_t *u, uint32_t rank) {
  if (fsdp_rank_set_put(&u->holders, rank, false) && fsdp_rank_set_empty(&u->holders))
    give_back_copy(job, u);
}

/* A block of whole pages, which a trainer can map alone. */
static int alloc_pages(fsdp_arena_t *arena, size_t bytes, uint64_t *ret_offset,
                       fsdp_status_t *st) {
  fsdp_arena_stats_t stats;
  fsdp_arena_get_stats(arena, &stats);
  return fsdp_arena_alloc(arena, bytes, stats.page_size, ret_offset, st);
}

static void give_back_grads(fsdp_job_t *job, fsdp_unit_t *u, const fsdp_rank_set_t *ranks) {
  for (uint32_t r = 0; r < job->local_world_size; r++) {
    if (!fsdp_rank_set_has(ranks, r) || !fsdp_rank_set_put(&u->grads_lent, r, false))
      continue;
    if (u->grads_pooled)
      fsdp_pool_give(&job->grad_pools[r], u->full_grad_offsets[r]);
    else
      fsdp_arena_release(job->arena, u->full_grad_offsets[r]);
  }
}

/* Answers an Unshard whose rank now holds the copy, with what it lends. */
static void answer_unshard(fsdp_unit_t *u, fsdp_dataplane_op_t *op) {
  uint32_t rank = op->who.local_rank;
  op->lent.unsharded_in_masters = u->copy_in_masters;
  op->lent.unsharded_offset = u->copy_in_masters ? u->master_offset : u->copy_offset;
  if (fsdp_rank_set_has(&u->grads_lent, rank)) {
    op->lent.full_grad_offset = u->full_grad_offsets[rank];
    op->lent.full_grad_bytes = copy_bytes(u);
  }
  op_ok(op);
}

static void on_grad_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st);

/* Lends op's rank the copy and, for a backward, its gradient buffer; answers op, now or when
 * the buffer comes. A unit resharded after forward takes the buffer from the rank's pool
 * (waiting while the rank holds max_inflight); one that keeps its copy (the root) takes a
 * block of its own, as its copy does: it holds the buffer for the whole backward, so within
 * the cap it would keep every other unit waiting once max_inflight is 1. */
static void lend(fsdp_job_t *job, fsdp_unit_t *u, fsdp_dataplane_op_t *op) {
  uint32_t rank = op->who.local_rank;
  fsdp_rank_set_put(&u->holders, rank, true);
  if (!op->backward || fsdp_rank_set_has(&u->grads_lent, rank)) {
    answer_unshard(u, op);
    return;
  }
  if (fsdp_rank_set_empty(&u->grads_lent))
    u->grads_pooled = u->reshard_after_forward;
  uint64_t offset = 0;
  fsdp_status_t st = FSDP_STATUS_INIT;
  int r;
  if (u->grads_pooled) {
    r = fsdp_pool_take(&job->grad_pools[rank], copy_bytes(u), &op->grad_waiter, on_grad_ready,
                       &offset, &st);
    if (r == 1)
      return; /* on_grad_ready answers it */
  } else {
    r = alloc_pages(job->arena, copy_bytes(u), &offset, &st);
  }
  on_grad_ready(&op->grad_waiter, r == 0 ? offset : 0, &st);
}

static void on_grad_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st) {
  fsdp_dataplane_op_t *op = (fsdp_dataplane_op_t *)((char *)waiter -
                                                    offsetof(fsdp_dataplane_op_t, grad_waiter));
  fsdp_unit_t *u = op->unit;
  if (st->code < 0) {
    op_fail(op, st->code, "unit '%s' step %llu: no full-gradient buffer for local rank %u: %s",
            u->spec->unit, (unsigned long long)u->gathered_step, op->who.local_rank,
            st->message);
    return;
  }
  u->full_grad_offsets[op->who.local_rank] = offset;
  fsdp_rank_set_put(&u->grads_lent, op->who.local_rank, true);
  answer_unshard(u, op);
}

static void redo_unshard(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_dataplane_op_t *op);

/* Every Unshard waiting for the gather that just ended gets the copy; one that asked
 * another step than a prefetch's is run again now. */
static void wake_unshards(fsdp_job_t *job, fsdp_unit_t *u) {
  fsdp_dataplane_op_t *redo = NULL;
  for (fsdp_dataplane_op_t *w = u->waiters, *next; w; w = next) {
    next = w->next;
    if (w->kind != WAIT_UNSHARD)
      continue;
    op_unlink(w);
    if (w->redo) {
      w->next = redo;
      redo = w;
    } else {
      lend(job, u, w);
    }
  }
  for (fsdp_dataplane_op_t *w = redo, *next; w; w = next) {
    next = w->next;
    redo_unshard(u->copy_waiter.data, job, w);
  }
}

/* The gather of a collection every rank joined: into the masters (nothing to do), a copy
 * of the unit's own, or one from the job's pool, which may have to wait for one. */
static void on_copy_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st);


static void start_gather(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u) {
  if (job->resume_from || job->resuming) {
    u->gather_after_resume = true;
    dp->hooks.resume(dp->hooks.ctx, job);
    return;
  }
  u->copy_waiter.data = dp;
  if (u->copy_in_masters) {
    finish_collective(job, u, WAIT_UNSHARD, NULL);
    return;
  }
  uint64_t offset = 0;
  fsdp_status_t st = FSDP_STATUS_INIT;
  int r;
  u->copy_pooled = u->reshard_after_forward;
  if (u->copy_pooled) {
    r = fsdp_pool_take(&job->copies, copy_bytes(u), &u->copy_waiter, on_copy_ready, &offset,
                       &st);
    if (r == 1)
      return; /* on_copy_ready goes on */
  } else {
    r = alloc_pages(job->shared_arena, copy_bytes(u), &offset, &st);
  }
  if (r < 0)
    fsdp_status_set(&st, r, "unit '%s' step %llu: no unsharded copy: %s", u->spec->unit,
                    (unsigned long long)u->gather.step, st.message);
  on_copy_ready(&u->copy_waiter, offset, &st);
}

static void on_copy_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st) {
  fsdp_unit_t *u = (fsdp_unit_t *)((char *)waiter - offsetof(fsdp_unit_t, copy_waiter));
  fsdp_job_t *job = u->job;
  if (st->code < 0) {
    finish_collective(job, u, WAIT_UNSHARD, st);
    return;
  }
  u->has_copy = true;
  u->copy_offset = offset;
  if (stages_rings(job) && u->plan.shard_ring.members > 1) {
    fsdp_status_t staged;
    if (take_stage(waiter->data, job, copy_bytes(u), &u->gather_stage, &staged) < 0) {
      fsdp_status_set(&staged, staged.code, "unit '%s' step %llu: no staged copy: %s",
                      u->spec->unit, (unsigned long long)u->gather.step, staged.message);
      finish_collective(job, u, WAIT_UNSHARD, &staged);
      return;
    }
  }
  int r = queue(waiter->data, WORK_GATHER, job, u);
  if (r < 0)
    abort_collection(job, u, WAIT_UNSHARD, r, "cannot queue the gather");
}

int fsdp_dataplane_reshard(fsdp_job_t *job, fsdp_unit_t *unit, const fsdp_dataplane_rank_t *who,
                           fsdp_status_t *st) {
  int r = check_ready(unit, st);
  if (r < 0)
    return r;
  let_go(job, unit, who->local_rank);
  return 0;
}

/* Which gather a request joins: the step's, or, for the backward of a unit resharded after
 * its forward, the step's second (every host runs the same gathers, whichever of its ranks
 * still held the forward's copy). In order: step, then the second after the first. */
static uint64_t gather_round(uint64_t step, bool again) {
  return 2 * step + again;
}

static void use_order(fsdp_job_t *job, fsdp_unit_t *const *units, unsigned n);

/* The forward order as local rank 0 runs it: its forward Unshards of a step, recorded, and
 * taken when the step is over (its next step's first) if they differ from the order. */
static void record_order(fsdp_job_t *job, fsdp_unit_t *unit, uint64_t step) {
  if (job->order_given)
    return;
  if (step != job->recording_step) {
    bool same = job->n_recorded == job->n_order &&
                memcmp(job->recorded, job->order, job->n_order * sizeof *job->order) == 0;
    if (job->recording_step && !same && job->n_recorded)
      use_order(job, job->recorded, job->n_recorded);
    job->recording_step = step;
    job->n_recorded = 0;
  }
  for (unsigned i = 0; i < job->n_recorded; i++)
    if (job->recorded[i] == unit)
      return; /* a unit run twice in a step keeps its first place */
  job->recorded[job->n_recorded++] = unit;
}

static void use_order(fsdp_job_t *job, fsdp_unit_t *const *units, unsigned n) {
  for (unsigned i = 0; i < job->n_order; i++)
    job->order[i]->order_index = -1;
  memmove(job->order, units, n * sizeof *units); /* units may be job->recorded */
  job->n_order = n;
  for (unsigned i = 0; i < n; i++)
    job->order[i]->order_index = (int)i;
}

void fsdp_dataplane_set_order(fsdp_job_t *job, fsdp_unit_t *const *units, unsigned n) {
  use_order(job, units, n);
  job->order_given = n > 0;
  memset(job->forward_step, 0, sizeof job->forward_step); /* each rank starts the order anew */
  job->recording_step = 0; /* recording starts afresh */
  job->n_recorded = 0;
}

/* What a prefetch keeps of the Unshard that caused it, which may be answered (and its storage
 * reused) before the prefetch starts. */
typedef struct prefetch_cause {
  bool backward;
  uint64_t generation;
  uint64_t deadline_ms;
} prefetch_cause_t;

/* Gathers v for step (its backward's gather with again) on behalf of every local rank,
 * unless something is collected, gathered or held for it already. */
static void gather_ahead(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *v, uint64_t step,
                         bool again, const prefetch_cause_t *cause) {
  fsdp_collection_t *c = &v->gather;
  if (v->state != FSDP_UNIT_READY || c->running || c->count > 0 || !fsdp_rank_set_empty(&v->holders) ||
      (v->gathered &&
       gather_round(v->gathered_step, v->gathered_again) >= gather_round(step, again)))
    return;
  give_back_copy(job, v); /* an older copy nobody holds */
  fsdp_rank_set_t none = {0};
  for (uint32_t r = 0; r < job->local_world_size; r++) {
    fsdp_collection_request_t rq = {.rank = r, .step = step, .regather = again,
                                    .generation = cause->generation,
                                    .deadline_ms = cause->deadline_ms};
    fsdp_collection_join(c, job->local_world_size, &rq, &none);
  }
  v->gather_ahead = true;
  start_gather(dp, job, v);
}

/* The schedule's prefetch after rank's Unshard of unit for step was answered: the next units
 * in forward order, or the previous ones with gradients in backward. */
static void prefetch_after(fsdp_dataplane_t *dp, fsdp_job_t *job, const fsdp_unit_t *unit,
                           uint64_t step, const prefetch_cause_t *cause) {
  unsigned depth = cause->backward ? job->backward_prefetch : job->forward_prefetch;
  if (!depth || unit->order_index < 0 || step > job->masters_final_step)
    return;
  int dir = cause->backward ? -1 : 1;
  for (int i = unit->order_index + dir; depth && i >= 0 && i < (int)job->n_order; i += dir) {
    fsdp_unit_t *v = job->order[i];
    if (cause->backward && !v->trainable)
      continue;
    gather_ahead(dp, job, v, step, cause->backward && v->reshard_after_forward, cause);
    depth--;
  }
}

/* Whether a forward Unshard follows the given order: within a step, each rank asks for the
 * order's units one after the other (asking one again, or a unit outside the order, is
 * free). Fails op otherwise, naming the unit asked for and the one expected. */
static bool in_order(fsdp_job_t *job, const fsdp_unit_t *unit, fsdp_dataplane_op_t *op) {
  uint32_t rank = op->who.local_rank;
  if (!job->order_given || unit->order_index < 0)
    return true;
  if (op->step != job->forward_step[rank]) {
    job->forward_step[rank] = op->step;
    job->forward_next[rank] = 0;
  }
  unsigned at = (unsigned)unit->order_index, next = job->forward_next[rank];
  if (at + 1 == next)
    return true; /* the unit it asked for last, again */
  if (at != next) {
    op_fail(op, FSDP_E_FAILED_PRECONDITION,
            "unit '%s': local rank %u asked for it in the forward of step %llu, but the "
            "forward order (SetSchedule) has %s%s%s next",
            unit->spec->unit, rank, (unsigned long long)op->step,
            next < job->n_order ? "'" : "", next < job->n_order ? job->order[next]->spec->unit
                                                                 : "no unit",
            next < job->n_order ? "'" : "");
    return false;
  }
  job->forward_next[rank] = next + 1;
  return true;
}

static void unshard(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit,
                    fsdp_dataplane_op_t *op) {
  uint32_t rank = op->who.local_rank;
  uint64_t step = op->step;
  bool again = op->backward && unit->reshard_after_forward;
  prefetch_cause_t cause = {.backward = op->backward, .generation = op->who.generation,
                            .deadline_ms = op->deadline_ms};
  fsdp_collection_t *c = &unit->gather;
  if (fsdp_rank_set_has(&c->submitted, rank)) {
    if (step == c->step && again == c->regather) {
      park(op); /* a second operation of the rank shares its request */
      return;
    }
    if (unit->gather_ahead) {
      op->redo = true; /* the prefetch asked for the rank: served once it ends */
      park(op);
      return;
    }
    op_fail(op, FSDP_E_FAILED_PRECONDITION,
            "unit '%s': local rank %u asked for step %llu%s while its request for step %llu%s "
            "waits",
            unit->spec->unit, rank, (unsigned long long)step, again_text(again),
            (unsigned long long)c->step, again_text(c->regather));
    return;
  }
  uint64_t round = gather_round(step, again);
  uint64_t held = gather_round(unit->gathered_step, unit->gathered_again);
  if (unit->gathered && round == held) {
    lend(job, unit, op); /* the fast path: this step's copy is there */
    prefetch_after(dp, job, unit, step, &cause);
    return;
  }
  if (round < held) {
    op_fail(op, FSDP_E_FAILED_PRECONDITION,
            "unit '%s': local rank %u asked for step %llu%s, but the unsharded copy already "
            "holds step %llu%s",
            unit->spec->unit, rank, (unsigned long long)step, again_text(again),
            (unsigned long long)unit->gathered_step, again_text(unit->gathered_again));
    return;
  }
  if (c->running) {
    op_fail(op, FSDP_E_FAILED_PRECONDITION,
            "unit '%s': local rank %u asked for step %llu%s while step %llu%s is being gathered",
            unit->spec->unit, rank, (unsigned long long)step, again_text(again),
            (unsigned long long)c->step, again_text(c->regather));
    return;
  }
  let_go(job, unit, rank); /* asking for a newer step lets go of the older copy */
  if (collect(unit, WAIT_UNSHARD, op, job, step, again, op->deadline_ms) <= 0)
    return;
  if (step > job->masters_final_step)
    job->masters_final_step = step; /* every rank asked: their masters are final for it */
  if (!op->backward && dp->hooks.step_boundary)
    dp->hooks.step_boundary(dp->hooks.ctx, job, step - 1);
  start_gather(dp, job, unit);
  prefetch_after(dp, job, unit, step, &cause);
}

static void redo_unshard(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_dataplane_op_t *op) {
  op->redo = false;
  unshard(dp, job, op->unit, op);
}

void fsdp_dataplane_unshard(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit,
                            const fsdp_dataplane_rank_t *who, uint64_t step, bool backward,
                            uint64_t deadline_ms, fsdp_dataplane_op_t *op,
                            fsdp_dataplane_done_fn done, void *data) {
  op_init(op, unit, who, WAIT_UNSHARD, done, data);
  op->backward = backward;
  op->step = step;
  op->deadline_ms = deadline_ms;
  if (!ready(op))
    return;
  if (!backward && !in_order(job, unit, op))
    return;
  if (who->local_rank == 0 && !backward)
    record_order(job, unit, step);
  unshard(dp, job, unit, op);
}

/* Before a reduce across hosts runs: a deferred sum of another run is dropped; a reduce
 * that defers makes the block when it is the first, and one that does not writes the
 * gradient shards only if every deferred reduce it takes in asked to accumulate too. */
static int prepare_deferred(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                            fsdp_status_t *st) {
  const fsdp_collection_t *c = &u->reduce;
  if (u->has_deferred && u->deferred_generation != c->generation) {
    log_warning("unit '%s': the gradients of %u reduces of generation %llu that deferred "
                "their all-reduce among replicas are dropped: generation %llu runs now",
                u->spec->unit, u->n_deferred, (unsigned long long)u->deferred_generation,
                (unsigned long long)c->generation);
    drop_deferred(job, u);
  }
  if (!u->reduce_defer) {
    if (u->has_deferred)
      u->reduce_accumulate = u->reduce_accumulate && u->deferred_accumulate;
    return 0;
  }
  if (u->has_deferred) {
    u->deferred_accumulate = u->deferred_accumulate && u->reduce_accumulate;
    return 0;
  }
  size_t bytes = round64((size_t)host_numel(u) * fsdp_dtype_size(reduce_dtype(u)));
  int r = stages_rings(job) ? take_stage(dp, job, bytes, &u->deferred_stage, st)
                            : fsdp_arena_alloc(job->arena, bytes, 64, &u->deferred_offset, st);
  if (r < 0)
    return fsdp_status_set(st, r, "unit '%s' step %llu: no room to keep the gradients whose "
                           "all-reduce among replicas is deferred: %s",
                           u->spec->unit, (unsigned long long)c->step, st->message);
  u->has_deferred = true;
  u->deferred_generation = c->generation;
  u->deferred_accumulate = u->reduce_accumulate;
  return 0;
}

/* A reduce across hosts borrows a host sum from the job's pool for as long as its rings run,
 * waiting (under the collective deadline) while max_inflight are lent: a running reduce
 * always ends, so the wait does too. */
static void on_sum_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st);

static void start_reduce_rings(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u) {
  u->sum_waiter.data = dp;
  uint64_t offset = 0;
  fsdp_status_t st = FSDP_STATUS_INIT;
  int r = fsdp_pool_take(&job->sums, host_sum_bytes(u), &u->sum_waiter, on_sum_ready, &offset,
                         &st);
  if (r == 1)
    return; /* on_sum_ready goes on */
  on_sum_ready(&u->sum_waiter, offset, &st);
}

static void on_sum_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st) {
  fsdp_unit_t *u = (fsdp_unit_t *)((char *)waiter - offsetof(fsdp_unit_t, sum_waiter));
  if (st->code < 0) {
    fsdp_status_t failed;
    fsdp_status_set(&failed, st->code, "unit '%s' step %llu: no host sum: %s", u->spec->unit,
                    (unsigned long long)u->reduce.step, st->message);
    finish_collective(u->job, u, WAIT_REDUCE, &failed);
    return;
  }
  u->has_sum = true;
  u->sum_offset = offset;
  fsdp_status_t deferred;
  if (prepare_deferred(waiter->data, u->job, u, &deferred) < 0) {
    finish_collective(u->job, u, WAIT_REDUCE, &deferred);
    return;
  }
  if (stages_rings(u->job)) {
    size_t bytes = (size_t)u->layout.padded_numel * fsdp_dtype_size(reduce_dtype(u));
    fsdp_status_t staged;
    if (take_stage(waiter->data, u->job, bytes, &u->sum_stage, &staged) < 0) {
      fsdp_status_set(&staged, staged.code, "unit '%s' step %llu: no staged host sum: %s",
                      u->spec->unit, (unsigned long long)u->reduce.step, staged.message);
      finish_collective(u->job, u, WAIT_REDUCE, &staged);
      return;
    }
    queue_or_abort(waiter->data, WORK_STAGE_SUM, u->job, u);
  } else if (u->plan.shard_ring.members > 1) {
    start_ring(waiter->data, u->job, u, FSDP_RING_REDUCE_SCATTER);
  } else if (!u->reduce_defer) {
    start_ring(waiter->data, u->job, u, FSDP_RING_ALL_REDUCE);
  } else {
    int r = queue(waiter->data, WORK_DEFER, u->job, u);
    if (r < 0)
      abort_collection(u->job, u, WAIT_REDUCE, r, "cannot queue the deferred reduce");
  }
}

/* Every local rank asked the unit's reduce: its rings among hosts, or its work here. */
static void start_reduce(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit) {
  if (fsdp_unit_plan_spans_hosts(&unit->plan)) {
    start_reduce_rings(dp, job, unit);
    return;
  }
  int r = queue(dp, WORK_REDUCE, job, unit);
  if (r < 0)
    abort_collection(job, unit, WAIT_REDUCE, r, "cannot queue the reduce-scatter");
}

void fsdp_dataplane_reduce(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit,
                           const fsdp_dataplane_rank_t *who, uint64_t step,
                           const fsdp_dataplane_reduce_how_t *how, uint64_t deadline_ms,
                           fsdp_dataplane_op_t *op, fsdp_dataplane_done_fn done, void *data) {
  uint32_t rank = who->local_rank;
  op_init(op, unit, who, WAIT_REDUCE, done, data);
  if (!ready(op))
    return;
  fsdp_collection_t *c = &unit->reduce;
  if (c->running || fsdp_rank_set_has(&c->submitted, rank)) {
    op_fail(op, FSDP_E_FAILED_PRECONDITION,
            "unit '%s' step %llu: local rank %u already submitted its gradient",
            unit->spec->unit, (unsigned long long)c->step, rank);
    return;
  }
  if (!fsdp_rank_set_has(&unit->grads_lent, rank)) {
    op_fail(op, FSDP_E_FAILED_PRECONDITION,
            "unit '%s' step %llu: local rank %u holds no full-gradient buffer to reduce: the "
            "Unshard for the unit's backward lends it",
            unit->spec->unit, (unsigned long long)step, rank);
    return;
  }
  if (how->step_optimizer && !fsdp_optimizer_is_set(job)) {
    op_fail(op, FSDP_E_FAILED_PRECONDITION,
            "unit '%s' step %llu: step_optimizer, but job '%s' has no optimizer in the daemon "
            "(SetOptimizer)",
            unit->spec->unit, (unsigned long long)step, job->name);
    return;
  }
  bool defer = how->defer_all_reduce && unit->plan.replica_ring.members > 1; /* else none */
  bool asked[3] = {how->accumulate, defer, how->step_optimizer && !how->defer_all_reduce};
  bool *kept[3] = {&unit->reduce_accumulate, &unit->reduce_defer, &unit->reduce_step};
  static const char *const names[3] = {"accumulate", "defer_all_reduce", "step_optimizer"};
  size_t differs = 3;
  for (size_t k = 0; k < 3; k++) {
    if (c->count == 0)
      *kept[k] = asked[k];
    else if (step == c->step && asked[k] != *kept[k] && differs == 3)
      differs = k;
  }
  if (differs < 3) {
    char message[FSDP_STATUS_MESSAGE_MAX];
    snprintf(message, sizeof message,
             "unit '%s' step %llu: local rank %u submitted with %s %s while the other ranks "
             "submitted with %s %s",
             unit->spec->unit, (unsigned long long)step, rank, names[differs],
             asked[differs] ? "true" : "false", names[differs],
             *kept[differs] ? "true" : "false");
    abort_collection(job, unit, WAIT_REDUCE, FSDP_E_FAILED_PRECONDITION, message);
    op_fail(op, FSDP_E_FAILED_PRECONDITION, "%s", message);
    return;
  }
  if (collect(unit, WAIT_REDUCE, op, job, step, false, deadline_ms) <= 0)
    return;
  /* While the hold waits for the running reduces, those of their step may still start. */
  if (job->reduces_held && (!job->reduces_quiet || step > job->hold_after_step)) {
    fsdp_unit_t **tail = &job->held_reduces;
    while (*tail)
      tail = &(*tail)->held_next;
    *tail = unit;
    unit->held_next = NULL;
    unit->reduce_held = true;
    return;
  }
  start_reduce(dp, job, unit);
}

bool fsdp_dataplane_hold_reduces(fsdp_dataplane_t *dp, fsdp_job_t *job, uint64_t after_step,
                                 void (*quiet)(void *arg), void *arg) {
  (void)dp;
  job->reduces_held = true;
  job->hold_after_step = after_step;
  if (!reducing(job))
    return true;
  job->reduces_quiet = quiet;
  job->reduces_quiet_arg = arg;
  return false;
}

void fsdp_dataplane_release_reduces(fsdp_dataplane_t *dp, fsdp_job_t *job) {
  job->reduces_held = false;
  job->reduces_quiet = NULL;
  while (job->held_reduces) {
    fsdp_unit_t *u = job->held_reduces;
    job->held_reduces = u->held_next;
    u->reduce_held = false;
    start_reduce(dp, job, u);
  }
}

static const waiter_kind_t collective_kinds[] = {WAIT_UNSHARD, WAIT_REDUCE};

/* "'a' (ranks 0, 1), 'b' (rank 1)": the units whose pooled copies are lent, and to whom. */
void fsdp_dataplane_set_max_inflight(fsdp_job_t *job, unsigned max_inflight) {
  job->max_inflight = max_inflight;
  fsdp_pool_set_capacity(&job->copies, max_inflight);
  fsdp_pool_set_capacity(&job->sums, max_inflight);
  for (uint32_t r = 0; r < job->local_world_size; r++)
    fsdp_pool_set_capacity(&job->grad_pools[r], max_inflight);
}

static void format_copy_holders(const fsdp_job_t *job, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (const fsdp_unit_t *u = job->units; u && used < size; u = u->next) {
    if (!u->has_copy || !u->copy_pooled)
      continue;
    char ranks[96];
    fsdp_rank_set_format(&u->holders, true, job->local_world_size, ranks, sizeof ranks);
    used += (size_t)snprintf(buf + used, size - used, "%s'%s' (ranks %s)", used ? ", " : "",
                             u->spec->unit, ranks[0] ? ranks : "none");
  }
}

/* "'a', 'b'": the units whose reduces hold host sums. */
static void format_sum_holders(const fsdp_job_t *job, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (const fsdp_unit_t *u = job->units; u && used < size; u = u->next)
    if (u->has_sum)
      used += (size_t)snprintf(buf + used, size - used, "%s'%s'", used ? ", " : "",
                               u->spec->unit);
}

/* Gathers (their copies) and reduces (their host sums) that waited for a pool buffer past
 * their collection's deadline: every waiter hears which units hold the pool. */
static void expire_buffer_waits(fsdp_job_t *job, uint64_t now_ms, waiter_kind_t kind) {
  bool gather = kind == WAIT_UNSHARD;
  char message[FSDP_STATUS_MESSAGE_MAX], holders[256];
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    const fsdp_collection_t *c = collection_of(u, kind);
    const fsdp_pool_waiter_t *w = gather ? &u->copy_waiter : &u->sum_waiter;
    if (!c->running || fsdp_list_empty(&w->link) || now_ms < c->deadline_ms)
      continue;
    (gather ? format_copy_holders : format_sum_holders)(job, holders, sizeof holders);
    snprintf(message, sizeof message,
             "unit '%s' step %llu: no %s of job '%s' came free in time "
             "(store.collective_timeout): its %u (max_inflight) are held by %s%s",
             u->spec->unit, (unsigned long long)c->step,
             gather ? "unsharded copy" : "host sum", job->name, job->max_inflight,
             gather ? "" : "the reduces of ", holders);
    log_warning("%s", message);
    abort_collection(job, u, kind, FSDP_E_ABORTED, message);
  }
}

/* With clipping, reduces that wrote their gradient and waited past their deadline for the
 * other units' of the step: each hears the first unit that did not come. */
static void expire_norm_waits(fsdp_job_t *job, uint64_t now_ms) {
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    if (!u->awaiting_norm || now_ms < u->norm_deadline_ms)
      continue;
    const fsdp_unit_t *missing = job->units;
    while (missing && (!fsdp_optimizer_steps_unit(job, missing) ||
                       (missing->awaiting_norm && missing->reduce.step == u->reduce.step)))
      missing = missing->next;
    char message[FSDP_STATUS_MESSAGE_MAX];
    snprintf(message, sizeof message,
             "unit '%s' step %llu: clipping by the global norm (max_grad_norm) waited in vain "
             "for unit '%s''s gradient of the step (store.collective_timeout)",
             u->spec->unit, (unsigned long long)u->reduce.step,
             missing ? missing->spec->unit : "?");
    log_warning("%s", message);
    u->awaiting_norm = false;
    abort_collection(job, u, WAIT_REDUCE, FSDP_E_ABORTED, message);
  }
}

/* Gathers, reduces and gradient lends that waited for a pool buffer past their deadline. */
static void expire_pool_waits(fsdp_job_t *job, uint64_t now_ms) {
  expire_buffer_waits(job, now_ms, WAIT_UNSHARD);
  expire_buffer_waits(job, now_ms, WAIT_REDUCE);
  for (uint32_t r = 0; r < job->local_world_size; r++) {
    fsdp_pool_waiter_t *w, *tmp;
    fsdp_list_for_each_safe(w, tmp, &job->grad_pools[r].waiters, link) {
      fsdp_dataplane_op_t *op =
          (fsdp_dataplane_op_t *)((char *)w - offsetof(fsdp_dataplane_op_t, grad_waiter));
      if (now_ms < op->deadline_ms)
        continue;
      fsdp_pool_cancel(w);
      op_fail(op, FSDP_E_ABORTED,
              "unit '%s' step %llu: local rank %u of job '%s' waited in vain for a "
              "full-gradient buffer (store.collective_timeout): it holds %u (max_inflight) "
              "whose reduce has not ended",
              op->unit->spec->unit, (unsigned long long)op->unit->gathered_step, r, job->name,
              job->max_inflight);
    }
  }
}

void fsdp_dataplane_expire(fsdp_store_t *store, uint64_t now_ms) {
  for (fsdp_job_t *job = store->jobs; job; job = job->next) {
    for (fsdp_unit_t *u = job->units; u; u = u->next) {
      for (size_t k = 0; k < sizeof collective_kinds / sizeof collective_kinds[0]; k++) {
        waiter_kind_t kind = collective_kinds[k];
        const fsdp_collection_t *c = collection_of(u, kind);
        fsdp_rank_set_t missing_ranks;
        if (!fsdp_collection_expired(c, job->local_world_size, now_ms, &missing_ranks))
          continue;
        char missing[128], message[FSDP_STATUS_MESSAGE_MAX];
        fsdp_rank_set_format(&missing_ranks, true, job->local_world_size, missing,
                             sizeof missing);
        snprintf(message, sizeof message,
                 "unit '%s' step %llu: local rank(s) %s of job '%s' did not ask to %s in time "
                 "(store.collective_timeout)",
                 u->spec->unit, (unsigned long long)c->step, missing, job->name,
                 collection_verb(kind));
        log_warning("%s", message);
        abort_collection(job, u, kind, FSDP_E_ABORTED, message);
      }
    }
    expire_pool_waits(job, now_ms);
    expire_norm_waits(job, now_ms);
  }
}

void fsdp_dataplane_release_session(fsdp_job_t *job, uint32_t rank, uint64_t session_id,
                                    const char *why, uint64_t next_serial) {
  job->gone_before_serial[rank] = next_serial;
  job->forward_step[rank] = 0; /* its successor starts the forward order anew */
  /* Its own operations end first, whatever they wait for (a running collective, a pool
   * buffer): an answer after this would be an answer to a session that no longer exists. */
  fsdp_pool_waiter_t *pw, *tmp;
  fsdp_list_for_each_safe(pw, tmp, &job->grad_pools[rank].waiters, link) {
    fsdp_dataplane_op_t *op =
        (fsdp_dataplane_op_t *)((char *)pw - offsetof(fsdp_dataplane_op_t, grad_waiter));
    if (op->who.session_id != session_id)
      continue;
    fsdp_pool_cancel(pw);
    op_fail(op, FSDP_E_ABORTED,
            "session %016llx (job '%s' local rank %u) ended while the call waited: %s",
            (unsigned long long)session_id, job->name, rank, why);
  }
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    for (fsdp_dataplane_op_t *w = u->waiters, *next; w; w = next) {
      next = w->next;
      if (w->who.session_id != session_id)
        continue;
      op_unlink(w);
      op_fail(w, FSDP_E_ABORTED,
              "session %016llx (job '%s' local rank %u) ended while the call waited: %s",
              (unsigned long long)session_id, job->name, rank, why);
    }
    /* The others would wait for a rank that is gone: tell them now, naming it. */
    for (size_t k = 0; k < sizeof collective_kinds / sizeof collective_kinds[0]; k++) {
      waiter_kind_t kind = collective_kinds[k];
      const fsdp_collection_t *c = collection_of(u, kind);
      if (!fsdp_collection_is_collecting(c))
        continue;
      char message[FSDP_STATUS_MESSAGE_MAX];
      snprintf(message, sizeof message,
               "unit '%s' step %llu: local rank %u of job '%s' is gone (%s) before its %s",
               u->spec->unit, (unsigned long long)c->step, rank, job->name, why,
               collection_verb(kind));
      abort_collection(job, u, kind, FSDP_E_ABORTED, message);
    }
    /* What it was lent comes back, and a running gather will not lend it the copy; a
     * running reduce gives its buffer back when it ends. */
    let_go(job, u, rank);
    if (u->gather.running)
      fsdp_rank_set_put(&u->gather.submitted, rank, false);
    if (!(u->reduce.running && fsdp_rank_set_has(&u->reduce.submitted, rank))) {
      fsdp_rank_set_t just_rank = {0};
      fsdp_rank_set_put(&just_rank, rank, true);
      give_back_grads(job, u, &just_rank);
    }
  }
}

void fsdp_dataplane_forget_job(fsdp_dataplane_t *dp, const fsdp_job_t *job) {
  const fsdp_arena_t *arenas[] = {job->arena, job->shared_arena};
  for (size_t i = 0; i < 2; i++)
    if (dp->fabric && arenas[i])
      fsdp_fabric_forget_memory(dp->fabric, fsdp_arena_base(arenas[i]),
                                arena_capacity(arenas[i]));
  for (const fsdp_staging_buffer_t *b = job->staging.buffers; b; b = b->next)
    forget_staging(dp, b->base, b->bytes);
}

void fsdp_dataplane_reached_step(fsdp_job_t *job, uint64_t step) {
  if (step > job->last_step)
    job->last_step = step;
}

/* The resume's load ended: the gathers waiting for it start, or, when it failed, the job's
 * units fail naming why (training from the trainers' initial values would be silently
 * wrong). */
void fsdp_dataplane_resumed(fsdp_dataplane_t *dp, fsdp_job_t *job, const fsdp_status_t *st) {
  job->resuming = false;
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    if (st->code < 0) {
      u->state = FSDP_UNIT_FAILED;
      fsdp_status_set(&u->error, st->code,
                      "job '%s' cannot resume (checkpoint.resume = latest): %s", job->name,
                      st->message);
    }
    if (!u->gather_after_resume)
      continue;
    u->gather_after_resume = false;
    if (st->code < 0)
      abort_collection(job, u, WAIT_UNSHARD, u->error.code, u->error.message);
    else
      start_gather(dp, job, u);
  }
}

bool fsdp_dataplane_uses_job(const fsdp_dataplane_t *dp, const fsdp_job_t *job) {
  for (const fsdp_dataplane_work_t *w = dp->head; w; w = w->next)
    if (w->job == job)
      return true;
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (u->waiters || u->gather.running || u->reduce.running)
      return true;
  for (uint32_t r = 0; r < job->local_world_size; r++)
    if (!fsdp_list_empty(&job->grad_pools[r].waiters))
      return true;
  return false;
}

int fsdp_dataplane_init(fsdp_dataplane_t *dp, uv_loop_t *loop, unsigned threads,
                        fsdp_status_t *st) {
  memset(dp, 0, sizeof *dp);
  dp->loop = loop;
  int r = fsdp_workers_new(threads, &dp->workers);
  if (r < 0)
    return fsdp_status_set(st, r, "cannot start %u worker threads: %s", threads,
                           fsdp_strerror(r));
  fsdp_backend_init_host(&dp->backend, dp->workers);
  return 0;
}

int fsdp_dataplane_use_cuda(fsdp_dataplane_t *dp, const fsdp_cuda_module_t *cuda,
                            const fsdp_cuda_device_t *device, fsdp_status_t *st) {
  return fsdp_backend_init_cuda(&dp->backend, cuda, device, st);
}

void fsdp_dataplane_set_cluster(fsdp_dataplane_t *dp, fsdp_peers_t *peers, fsdp_fabric_t *fabric,
                                uint64_t collective_timeout_ms) {
  if (dp->waiting_for_cluster && dp->peers && peers != dp->peers) {
    fsdp_peers_wait_cancel(dp->peers, &dp->cluster_waiter);
    on_cluster_ready(dp, FSDP_E_CANCELLED, "the daemon is stopping");
  }
  dp->peers = peers;
  dp->fabric = fabric;
  dp->collective_timeout_ms = collective_timeout_ms;
}

void fsdp_dataplane_cleanup(fsdp_dataplane_t *dp) {
  if (!dp)
    return;
  while (dp->free_scratch) {
    void *s = dp->free_scratch;
    memcpy(&dp->free_scratch, s, sizeof(void *));
    free(s);
  }
  fsdp_backend_cleanup(&dp->backend);
  fsdp_workers_free(dp->workers);
  dp->workers = NULL;
}
