/* Unit buffers and the unshard path of the host backend. */
#include "dataplane.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

typedef enum waiter_kind { WAIT_REGISTER, WAIT_UNSHARD, WAIT_REDUCE } waiter_kind_t;

struct fsdp_waiter {
  fsdp_rpc_call_t *call;
  fsdp_unit_t *unit;
  uint32_t rank;
  waiter_kind_t kind;
  fsdp_waiter_t *prev, *next;
};

typedef enum work_kind { WORK_PREFAULT, WORK_GATHER, WORK_REDUCE } work_kind_t;

struct fsdp_dataplane_work {
  work_kind_t kind;
  fsdp_job_t *job;
  fsdp_unit_t *unit;
  /* WORK_PREFAULT: the blocks' lengths, read on the loop: the block lists are the loop's. */
  size_t rw_bytes, shared_bytes;
  int result;
  fsdp_dataplane_work_t *next;
};

static const char *const work_names[] = {"preparing its buffers", "the gather",
                                         "the reduce-scatter"};

/* The proto's element types, as the kernels name them. */
static fsdp_dtype_t kernel_dtype(Fsdp__V1__DType dtype) {
  switch (dtype) {
  case FSDP__V1__DTYPE__DTYPE_BF16:
    return FSDP_DTYPE_BF16;
  case FSDP__V1__DTYPE__DTYPE_FP16:
    return FSDP_DTYPE_FP16;
  default:
    return FSDP_DTYPE_FP32;
  }
}

/* Collections and their waiters. */

static fsdp_collection_t *collection_of(fsdp_unit_t *u, waiter_kind_t kind) {
  return kind == WAIT_UNSHARD ? &u->gather : &u->reduce;
}

static void collection_reset(fsdp_collection_t *c) {
  *c = (fsdp_collection_t){0};
}

static void waiter_unlink(fsdp_waiter_t *w) {
  if (w->prev)
    w->prev->next = w->next;
  else
    w->unit->waiters = w->next;
  if (w->next)
    w->next->prev = w->prev;
}

static bool rank_waits(const fsdp_unit_t *u, uint32_t rank, waiter_kind_t kind) {
  for (const fsdp_waiter_t *w = u->waiters; w; w = w->next)
    if (w->rank == rank && w->kind == kind)
      return true;
  return false;
}

/* A parked call's client gave up (its deadline, or it went away): unless the collection
 * already runs, the rank no longer counts in it, so that it is not gathered or reduced for
 * a rank that no longer waits (and asks again). */
static void on_waiter_cancel(fsdp_rpc_call_t *call, void *data) {
  (void)call;
  fsdp_waiter_t *w = data;
  fsdp_unit_t *u = w->unit;
  waiter_unlink(w);
  if (w->kind != WAIT_REGISTER) {
    fsdp_collection_t *c = collection_of(u, w->kind);
    if (!c->running && fsdp_rank_set_has(&c->submitted, w->rank) && !rank_waits(u, w->rank, w->kind)) {
      fsdp_rank_set_put(&c->submitted, w->rank, false);
      c->count--;
    }
  }
  free(w);
}

static void park(fsdp_rpc_call_t *call, fsdp_unit_t *unit, uint32_t rank, waiter_kind_t kind) {
  fsdp_waiter_t *w = calloc(1, sizeof *w);
  if (!w) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "out of memory parking a call");
    return;
  }
  *w = (fsdp_waiter_t){.call = call, .unit = unit, .rank = rank, .kind = kind};
  w->next = unit->waiters;
  if (unit->waiters)
    unit->waiters->prev = w;
  unit->waiters = w;
  fsdp_rpc_call_on_cancel(call, on_waiter_cancel, w);
}

static void reply_registered(fsdp_rpc_call_t *call, const fsdp_unit_t *u, uint32_t rank) {
  Fsdp__V1__RegisterUnitReply reply = FSDP__V1__REGISTER_UNIT_REPLY__INIT;
  reply.numel = u->layout.numel;
  reply.padded_numel = u->layout.padded_numel;
  reply.shard_numel = u->layout.shard_numel;
  reply.n_param_offsets = u->layout.n_params;
  reply.param_offsets = u->layout.offsets;
  reply.unsharded_offset = u->unsharded_offset;
  reply.master_offset = u->master_offset;
  reply.grad_offset = u->grad_offset;
  reply.full_grad_offset = u->full_grad_offset + rank * u->full_grad_stride;
  reply.shard = u->layout.shards == 1 ? 0 : rank;
  reply.gathered_step = u->gathered ? u->gathered_step : 0;
  reply.reduced_step = u->reduced_step;
  fsdp_rpc_call_reply(call, &reply.base);
}

static void reply_unit_op(fsdp_rpc_call_t *call) {
  Fsdp__V1__UnitOpReply reply = FSDP__V1__UNIT_OP_REPLY__INIT;
  fsdp_rpc_call_reply(call, &reply.base);
}

/* Answers every waiter of `kind`: with the result, or with the unit's error once it
 * failed. */
static void wake(fsdp_unit_t *u, waiter_kind_t kind) {
  for (fsdp_waiter_t *w = u->waiters, *next; w; w = next) {
    next = w->next;
    if (w->kind != kind)
      continue;
    waiter_unlink(w);
    fsdp_rpc_call_on_cancel(w->call, NULL, NULL);
    if (u->state == FSDP_UNIT_FAILED)
      fsdp_rpc_call_fail(w->call, u->error.code, "%s: %s", fsdp_rpc_call_method(w->call),
                         u->error.message);
    else if (kind == WAIT_REGISTER)
      reply_registered(w->call, u, w->rank);
    else
      reply_unit_op(w->call);
    free(w);
  }
}

/* Ends the collection of `kind` being gathered: every waiter gets err and the message. */
static void abort_collection(fsdp_unit_t *u, waiter_kind_t kind, int err, const char *message) {
  for (fsdp_waiter_t *w = u->waiters, *next; w; w = next) {
    next = w->next;
    if (w->kind != kind)
      continue;
    waiter_unlink(w);
    fsdp_rpc_call_on_cancel(w->call, NULL, NULL);
    fsdp_rpc_call_fail(w->call, err, "%s: %s", fsdp_rpc_call_method(w->call), message);
    free(w);
  }
  collection_reset(collection_of(u, kind));
}

/* What a collection's ranks are asked for, in messages. */
static const char *collection_verb(waiter_kind_t kind) {
  return kind == WAIT_UNSHARD ? "unshard" : "reduce-scatter";
}

/* Parks the call as rank's part of the unit's collection of `kind` for `step` and returns
 * whether it completed the collection (every local rank has asked). A rank asking for
 * another step than the one being collected aborts the collection for everyone: nobody
 * could complete it. */
static bool collect(fsdp_unit_t *u, waiter_kind_t kind, fsdp_rpc_call_t *call,
                    const fsdp_job_t *job, const fsdp_session_t *session, uint64_t step,
                    uint64_t deadline_ms) {
  uint32_t rank = session->local_rank;
  fsdp_collection_t *c = collection_of(u, kind);
  fsdp_rank_set_t died = {0};
  for (uint32_t r = 0; r < job->local_world_size; r++)
    if (session->serial < job->gone_before_serial[r])
      fsdp_rank_set_put(&died, r, true);
  char gone[128];
  fsdp_rank_set_format(&died, true, job->local_world_size, gone, sizeof gone);
  if (gone[0]) {
    char message[FSDP_STATUS_MESSAGE_MAX];
    snprintf(message, sizeof message,
             "unit '%s' step %llu: local rank(s) %s of job '%s' ended their session and have "
             "not attached again; the %s cannot complete without them",
             u->spec->unit, (unsigned long long)step, gone, job->name, collection_verb(kind));
    abort_collection(u, kind, FSDP_E_ABORTED, message);
    fsdp_rpc_call_fail(call, FSDP_E_ABORTED, "%s: %s", fsdp_rpc_call_method(call), message);
    return false;
  }
  if (c->count == 0) {
    c->step = step;
    c->deadline_ms = deadline_ms;
  } else if (step != c->step) {
    char message[FSDP_STATUS_MESSAGE_MAX];
    snprintf(message, sizeof message,
             "unit '%s': local rank %u asked to %s step %llu while the other ranks asked for "
             "step %llu",
             u->spec->unit, rank, collection_verb(kind), (unsigned long long)step,
             (unsigned long long)c->step);
    abort_collection(u, kind, FSDP_E_FAILED_PRECONDITION, message);
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION, "%s: %s", fsdp_rpc_call_method(call),
                       message);
    return false;
  }
  fsdp_rank_set_put(&c->submitted, rank, true);
  c->count++;
  park(call, u, rank, kind);
  return c->count == job->local_world_size;
}

/* The gradient factors of PyTorch FSDP: divide by `pre` before the sum and by `post` after,
 * pre * post being the data-parallel size (here the local world size) by default. */
static void reduce_scales(const fsdp_unit_t *u, unsigned world, float *ret_pre, float *ret_post) {
  double pre = u->spec->gradient_predivide_factor, post = u->spec->gradient_postdivide_factor;
  if (pre == 0)
    pre = post == 0 ? 1 : world / post;
  if (post == 0)
    post = world / pre;
  *ret_pre = (float)(1 / pre);
  *ret_post = (float)(1 / post);
}

/* The work queue: one item at a time on libuv's thread pool. */

static void start_next(fsdp_dataplane_t *dp);

static void run_work(uv_work_t *req) {
  fsdp_dataplane_t *dp = req->data;
  fsdp_dataplane_work_t *w = dp->head;
  fsdp_unit_t *u = w->unit;
  char *base = fsdp_arena_base(w->job->arena);
  switch (w->kind) {
  case WORK_PREFAULT:
    w->result = fsdp_arena_prefault_range(w->job->arena, u->buffers_offset, w->rw_bytes);
    if (w->result == 0)
      w->result =
          fsdp_arena_prefault_range(w->job->shared_arena, u->unsharded_offset, w->shared_bytes);
    break;
  case WORK_GATHER:
    /* One host: every shard is local, so the all-gather is the cast of the whole flat
     * buffer from the fp32 masters into param_dtype. */
    w->result = fsdp_cast_parallel(dp->workers,
                                   (char *)fsdp_arena_base(w->job->shared_arena) +
                                       u->unsharded_offset,
                                   kernel_dtype(fsdp_unit_spec_param_dtype(u->spec)),
                                   base + u->master_offset, FSDP_DTYPE_FP32,
                                   u->layout.padded_numel);
    break;
  case WORK_REDUCE: {
    /* One host: the gradient shards lie side by side, so one reduce over the whole flat
     * buffer writes every rank's shard (the host-level pre-reduction is the whole job). */
    unsigned world = w->job->local_world_size;
    const void *srcs[FSDP_LOCAL_WORLD_MAX];
    for (unsigned r = 0; r < world; r++)
      srcs[r] = base + u->full_grad_offset + r * u->full_grad_stride;
    float pre, post;
    reduce_scales(u, world, &pre, &post);
    w->result = fsdp_reduce_parallel(dp->workers, (float *)(base + u->grad_offset),
                                     u->reduce_accumulate, srcs, world,
                                     kernel_dtype(fsdp_unit_spec_param_dtype(u->spec)),
                                     kernel_dtype(fsdp_unit_spec_reduce_dtype(u->spec)), pre, post,
                                     u->layout.padded_numel);
    break;
  }
  }
}

static void work_done(uv_work_t *req, int status) {
  fsdp_dataplane_t *dp = req->data;
  fsdp_dataplane_work_t *w = dp->head;
  dp->head = w->next;
  if (!dp->head)
    dp->tail = NULL;
  fsdp_unit_t *u = w->unit;
  int r = status < 0 ? status : w->result;
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
  } else {
    waiter_kind_t kind = w->kind == WORK_GATHER ? WAIT_UNSHARD : WAIT_REDUCE;
    fsdp_collection_t *c = collection_of(u, kind);
    if (r < 0) {
      char message[FSDP_STATUS_MESSAGE_MAX];
      snprintf(message, sizeof message, "unit '%s' step %llu: %s failed: %s", u->spec->unit,
               (unsigned long long)c->step, work_names[w->kind], fsdp_strerror(r));
      log_error("%s", message);
      abort_collection(u, kind, FSDP_E_INTERNAL, message);
    } else {
      if (kind == WAIT_UNSHARD) {
        u->gathered = true;
        u->gathered_step = c->step;
      } else {
        u->reduced_step = c->step;
      }
      wake(u, kind);
      collection_reset(c);
    }
  }
  free(w);
  dp->busy = false;
  start_next(dp);
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

static int queue(fsdp_dataplane_t *dp, work_kind_t kind, fsdp_job_t *job, fsdp_unit_t *unit) {
  fsdp_dataplane_work_t *w = calloc(1, sizeof *w);
  if (!w)
    return -ENOMEM;
  *w = (fsdp_dataplane_work_t){.kind = kind, .job = job, .unit = unit};
  if (kind == WORK_PREFAULT) {
    w->rw_bytes = fsdp_arena_block_size(job->arena, unit->buffers_offset);
    w->shared_bytes = fsdp_arena_block_size(job->shared_arena, unit->unsharded_offset);
  }
  if (dp->tail)
    dp->tail->next = w;
  else
    dp->head = w;
  dp->tail = w;
  start_next(dp);
  return 0;
}

/* Operations. */

static size_t round64(size_t n) {
  return (n + 63) / 64 * 64;
}

/* Takes the unit's buffers: the unsharded one from the shared (read-only to trainers)
 * arena, and from the arena one block with the master shards, the gradient shards and one
 * full-gradient buffer per local rank. */
static int allocate(fsdp_job_t *job, fsdp_unit_t *u, size_t memory_free, fsdp_status_t *st) {
  size_t padded = (size_t)u->layout.padded_numel;
  size_t param_size = fsdp_dtype_size(kernel_dtype(fsdp_unit_spec_param_dtype(u->spec)));
  size_t unsharded = round64(padded * param_size), fp32 = round64(padded * 4);
  size_t total = 2 * fp32 + (size_t)job->local_world_size * unsharded;
  if (total + unsharded > memory_free)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED,
                           "job '%s' unit '%s': need %zu bytes, %zu free under memory.limit "
                           "(all jobs together)",
                           job->name, u->spec->unit, total + unsharded, memory_free);
  uint64_t base, shared;
  int r = fsdp_arena_alloc(job->arena, total, 0, &base, st);
  if (r < 0)
    return r;
  if ((r = fsdp_arena_alloc(job->shared_arena, unsharded, 0, &shared, st)) < 0) {
    fsdp_arena_release(job->arena, base);
    return r;
  }
  u->unsharded_offset = shared;
  u->buffers_offset = u->master_offset = base;
  u->grad_offset = u->master_offset + fp32;
  u->full_grad_offset = u->grad_offset + fp32;
  u->full_grad_stride = unsharded;
  return 0;
}

void fsdp_dataplane_register(fsdp_dataplane_t *dp, fsdp_rpc_call_t *call, fsdp_job_t *job,
                             fsdp_unit_t *unit, const fsdp_session_t *session,
                             size_t arena_capacity, size_t memory_free) {
  fsdp_status_t st;
  switch (unit->state) {
  case FSDP_UNIT_NEW:
    if (fsdp_store_job_arena(job, arena_capacity, &st) < 0 ||
        allocate(job, unit, memory_free, &st) < 0) {
      fsdp_rpc_call_fail(call, st.code, "%s: %s", fsdp_rpc_call_method(call), st.message);
      return;
    }
    int r = queue(dp, WORK_PREFAULT, job, unit);
    if (r < 0) {
      fsdp_arena_release(job->arena, unit->buffers_offset);
      fsdp_arena_release(job->shared_arena, unit->unsharded_offset);
      fsdp_rpc_call_fail(call, r, "%s: cannot queue the buffers' preparation",
                         fsdp_rpc_call_method(call));
      return;
    }
    unit->state = FSDP_UNIT_ALLOCATING;
    park(call, unit, session->local_rank, WAIT_REGISTER);
    return;
  case FSDP_UNIT_ALLOCATING:
    park(call, unit, session->local_rank, WAIT_REGISTER);
    return;
  case FSDP_UNIT_FAILED:
    fsdp_rpc_call_fail(call, unit->error.code, "%s: %s", fsdp_rpc_call_method(call),
                       unit->error.message);
    return;
  default:
    reply_registered(call, unit, session->local_rank);
  }
}

/* Whether the unit's buffers are there to work on; fails the call otherwise. */
static bool ready(fsdp_rpc_call_t *call, const fsdp_unit_t *unit) {
  switch (unit->state) {
  case FSDP_UNIT_FAILED:
    fsdp_rpc_call_fail(call, unit->error.code, "%s: %s", fsdp_rpc_call_method(call),
                       unit->error.message);
    return false;
  case FSDP_UNIT_NEW:
  case FSDP_UNIT_ALLOCATING:
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION,
                       "%s: unit '%s' has no buffers yet: its RegisterUnit has not succeeded",
                       fsdp_rpc_call_method(call), unit->spec->unit);
    return false;
  default:
    return true;
  }
}

void fsdp_dataplane_unshard(fsdp_dataplane_t *dp, fsdp_rpc_call_t *call, fsdp_job_t *job,
                            fsdp_unit_t *unit, const fsdp_session_t *session,
                            const Fsdp__V1__UnitOpRequest *rq, uint64_t deadline_ms) {
  uint32_t rank = session->local_rank;
  const char *method = fsdp_rpc_call_method(call);
  if (!ready(call, unit))
    return;
  if (unit->gathered && rq->step == unit->gathered_step) {
    reply_unit_op(call); /* the fast path: this step's copy is there */
    return;
  }
  if (unit->gathered && rq->step < unit->gathered_step) {
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION,
                       "%s: unit '%s': local rank %u asked for step %llu, but the unsharded "
                       "copy already holds step %llu",
                       method, unit->spec->unit, rank, (unsigned long long)rq->step,
                       (unsigned long long)unit->gathered_step);
    return;
  }
  fsdp_collection_t *c = &unit->gather;
  if (fsdp_rank_set_has(&c->submitted, rank) && rq->step == c->step) {
    park(call, unit, rank, WAIT_UNSHARD); /* a second call of the rank shares its request */
    return;
  }
  if (c->running) {
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION,
                       "%s: unit '%s': local rank %u asked for step %llu while step %llu is "
                       "being gathered",
                       method, unit->spec->unit, rank, (unsigned long long)rq->step,
                       (unsigned long long)c->step);
    return;
  }
  if (!collect(unit, WAIT_UNSHARD, call, job, session, rq->step, deadline_ms))
    return;
  int r = queue(dp, WORK_GATHER, job, unit);
  if (r < 0) {
    abort_collection(unit, WAIT_UNSHARD, r, "cannot queue the gather");
    return;
  }
  unit->gathered = false; /* the buffer is overwritten from now on */
  c->running = true;
}

void fsdp_dataplane_reshard(fsdp_rpc_call_t *call, const fsdp_unit_t *unit) {
  if (!ready(call, unit))
    return;
  reply_unit_op(call);
}

void fsdp_dataplane_reduce(fsdp_dataplane_t *dp, fsdp_rpc_call_t *call, fsdp_job_t *job,
                           fsdp_unit_t *unit, const fsdp_session_t *session,
                           const Fsdp__V1__UnitOpRequest *rq, uint64_t deadline_ms) {
  uint32_t rank = session->local_rank;
  const char *method = fsdp_rpc_call_method(call);
  if (!ready(call, unit))
    return;
  fsdp_collection_t *c = &unit->reduce;
  if (c->running || fsdp_rank_set_has(&c->submitted, rank)) {
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION,
                       "%s: unit '%s' step %llu: local rank %u already submitted its gradient",
                       method, unit->spec->unit, (unsigned long long)c->step, rank);
    return;
  }
  if (c->count == 0) {
    unit->reduce_accumulate = rq->accumulate;
  } else if (rq->step == c->step && rq->accumulate != unit->reduce_accumulate) {
    char message[FSDP_STATUS_MESSAGE_MAX];
    snprintf(message, sizeof message,
             "unit '%s' step %llu: local rank %u submitted with accumulate %s while the other "
             "ranks submitted with accumulate %s",
             unit->spec->unit, (unsigned long long)rq->step, rank,
             rq->accumulate ? "true" : "false", unit->reduce_accumulate ? "true" : "false");
    abort_collection(unit, WAIT_REDUCE, FSDP_E_FAILED_PRECONDITION, message);
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION, "%s: %s", method, message);
    return;
  }
  if (!collect(unit, WAIT_REDUCE, call, job, session, rq->step, deadline_ms))
    return;
  int r = queue(dp, WORK_REDUCE, job, unit);
  if (r < 0) {
    abort_collection(unit, WAIT_REDUCE, r, "cannot queue the reduce-scatter");
    return;
  }
  c->running = true;
}

static bool collecting(const fsdp_collection_t *c) {
  return c->count > 0 && !c->running;
}

static const waiter_kind_t collective_kinds[] = {WAIT_UNSHARD, WAIT_REDUCE};

void fsdp_dataplane_expire(fsdp_store_t *store, uint64_t now_ms) {
  for (fsdp_job_t *job = store->jobs; job; job = job->next) {
    for (fsdp_unit_t *u = job->units; u; u = u->next) {
      for (size_t k = 0; k < sizeof collective_kinds / sizeof collective_kinds[0]; k++) {
        waiter_kind_t kind = collective_kinds[k];
        const fsdp_collection_t *c = collection_of(u, kind);
        if (!collecting(c) || now_ms < c->deadline_ms)
          continue;
        char missing[128], message[FSDP_STATUS_MESSAGE_MAX];
        fsdp_rank_set_format(&c->submitted, false, job->local_world_size, missing,
                             sizeof missing);
        snprintf(message, sizeof message,
                 "unit '%s' step %llu: local rank(s) %s of job '%s' did not ask to %s in time "
                 "(store.collective_timeout)",
                 u->spec->unit, (unsigned long long)c->step, missing, job->name,
                 collection_verb(kind));
        log_warning("%s", message);
        abort_collection(u, kind, FSDP_E_ABORTED, message);
      }
    }
  }
}

void fsdp_dataplane_release_rank(fsdp_job_t *job, uint32_t rank, const char *why,
                                 uint64_t next_serial) {
  job->gone_before_serial[rank] = next_serial;
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    /* The others would wait for a rank that is gone: tell them now, naming it. */
    for (size_t k = 0; k < sizeof collective_kinds / sizeof collective_kinds[0]; k++) {
      waiter_kind_t kind = collective_kinds[k];
      const fsdp_collection_t *c = collection_of(u, kind);
      if (!collecting(c))
        continue;
      char message[FSDP_STATUS_MESSAGE_MAX];
      snprintf(message, sizeof message,
               "unit '%s' step %llu: local rank %u of job '%s' is gone (%s) before its %s",
               u->spec->unit, (unsigned long long)c->step, rank, job->name, why,
               collection_verb(kind));
      abort_collection(u, kind, FSDP_E_ABORTED, message);
    }
  }
}

bool fsdp_dataplane_uses_job(const fsdp_dataplane_t *dp, const fsdp_job_t *job) {
  for (const fsdp_dataplane_work_t *w = dp->head; w; w = w->next)
    if (w->job == job)
      return true;
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (u->waiters)
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
  return 0;
}

void fsdp_dataplane_cleanup(fsdp_dataplane_t *dp) {
  fsdp_workers_free(dp->workers);
  dp->workers = NULL;
}
