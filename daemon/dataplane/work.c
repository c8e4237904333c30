/* The work queue: one item at a time on libuv's thread pool, and what follows each stage
 * of a collective that succeeded (the next work item, a ring, or the collective's end). */
#include "daemon/dataplane/internal.h"

#include <stdlib.h>

#include "collectives/local.h"
#include "collectives/ring.h"
#include "common/clock.h"
#include "common/log.h"
#include "daemon/dataplane/optimizer.h"

static void start_next(fsdp_dataplane_t *dp);

/* Each kind of work (work_kind_t's order): its name in traces, and in messages. */
static const struct {
  const char *name, *phrase;
} works[] = {
    {"prefault", "preparing its buffers"},
    {"gather", "the gather"},
    {"reduce", "the reduce-scatter"},
    {"deferred reduce", "the deferred reduce"},
    {"optimizer step", "the optimizer step"},
    {"norm", "the gradient's norm"},
    {"stage sum", "the host sum's staging"},
    {"unstage gather", "the gathered copy's return from staging"},
    {"unstage sum", "the sum's return from staging"},
    {"call", "another module's work"},
};
_Static_assert(sizeof works / sizeof works[0] == WORK_CALL + 1, "a name for every work kind");

const char *fsdp_dataplane_work_name(unsigned work) {
  return work <= WORK_CALL ? works[work].name : "?";
}

static void run_work(uv_work_t *req) {
  fsdp_dataplane_t *dp = req->data;
  fsdp_dataplane_work_t *w = dp->head;
  if (w->kind == WORK_CALL) {
    w->call_run(w->call_arg);
    return;
  }
  fsdp_unit_t *u = w->unit;
  char *base = fsdp_arena_base(w->job->arena);
  uint64_t first = host_first(u), n = host_numel(u);
  uint64_t start_ns = w->start_ns = fsdp_clock_now_ns();
  switch (w->kind) {
  case WORK_PREFAULT:
    w->result = fsdp_arena_prefault_range(w->job->arena, u->buffers_offset, w->bytes);
    break;
  case WORK_GATHER: {
    /* This host's shards: its region of the fp32 masters cast into param_dtype. */
    char *unsharded = (char *)fsdp_arena_base(w->job->shared_arena) + u->flight->copy_offset;
    w->result = dp_cast_masters(&dp->backend, w->job, u, unsharded, &w->error);
    if (w->result == 0 && u->flight->gather_stage &&
        (w->result = fsdp_staging_make(&w->job->staging, u->flight->gather_stage, &w->error)) == 0)
      w->result = dp_copy_staged(&dp->backend, u, u->flight->gather_stage->base, unsharded, first,
                                 first + n, true, &w->error);
    break;
  }
  case WORK_REDUCE:
    /* One host: the gradient shards lie side by side, so one reduce over the shards' whole
     * space writes every rank's shard. */
    w->result = dp_reduce_runs(&dp->backend, w->job, u, (float *)(void *)(base + u->grad_offset),
                               u->flight->reduce_accumulate, u->post_scale, 0,
                               u->layout.padded_numel, &w->error);
    break;
  case WORK_OPTIMIZE:
    w->result = fsdp_optimizer_run(&w->plan, &dp->backend, &w->error);
    break;
  case WORK_NORM:
    w->result = fsdp_optimizer_grad_norm_sq(w->job, u, &dp->backend, &w->norm_sq, &w->error);
    break;
  case WORK_DEFER:
    w->result = dp_host_sum_runs(w->job, u, first, first + n);
    if (w->result == 0)
      w->result = dp_keep_deferred(w->job, u, first, first + n);
    break;
  case WORK_STAGE_SUM:
    w->result = dp_stage_host_sum(dp, w->job, u, &w->error);
    break;
  case WORK_UNSTAGE_GATHER:
    w->result = dp_unstage_gather(dp, w->job, u, &w->error);
    break;
  case WORK_UNSTAGE_SUM:
    w->result = dp_unstage_sum(dp, w->job, u, &w->error);
    break;
  case WORK_CALL: /* not a unit's: run above */
    break;
  }
  w->run_ns = fsdp_clock_now_ns() - start_ns;
}

void dp_next_stage(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u, int done_work,
                   int done_ring) {
  /* Staged rings: the staged copy's or sum's way back follows the last ring. */
  bool wrote_grads = done_ring == FSDP_RING_ALL_REDUCE ||
                     (done_ring == FSDP_RING_REDUCE_SCATTER && u->plan.replica_ring.members == 1);
  if (done_work == WORK_GATHER && u->plan.shard_ring.members > 1)
    dp_start_ring(dp, job, u, FSDP_RING_ALL_GATHER);
  else if (done_ring == FSDP_RING_ALL_GATHER && u->flight->gather_stage)
    dp_queue_or_abort(dp, WORK_UNSTAGE_GATHER, job, u);
  else if (done_work == WORK_GATHER || done_ring == FSDP_RING_ALL_GATHER ||
           done_work == WORK_UNSTAGE_GATHER)
    dp_finish_collective(job, u, WAIT_UNSHARD, NULL);
  else if (done_work == WORK_STAGE_SUM && u->plan.shard_ring.members > 1)
    dp_start_ring(dp, job, u, FSDP_RING_REDUCE_SCATTER);
  else if ((done_work == WORK_STAGE_SUM && !u->flight->reduce_defer) ||
           (done_ring == FSDP_RING_REDUCE_SCATTER && u->plan.replica_ring.members > 1 &&
            !u->flight->reduce_defer))
    dp_start_ring(dp, job, u, FSDP_RING_ALL_REDUCE);
  else if (wrote_grads && u->flight->sum_stage)
    dp_queue_or_abort(dp, WORK_UNSTAGE_SUM, job, u);
  else if (done_work != WORK_OPTIMIZE && u->flight->reduce_step) {
    /* The sum is written: its pool buffer goes back before the step, which with clipping
     * waits for every other unit's reduce, and those may need it. */
    dp_give_back_sum(job, u);
    dp_start_step(dp, job, u);
  }
  else
    dp_finish_collective(job, u, WAIT_REDUCE, NULL);
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
  dp_record_work(w, r);
  /* The queue's wait of work that ran (a cancelled one never started). */
  bool ran = r >= 0 && w->start_ns >= w->queued_ns && w->start_ns;
  double queued_s = ran ? (double)(w->start_ns - w->queued_ns) * 1e-9 : 0;
  if (w->kind == WORK_GATHER) {
    u->flight->last_gather_us = w->run_ns / 1000;
    fsdp_histogram_observe(&u->flight->gather_work, (double)w->run_ns * 1e-9);
    if (ran)
      fsdp_histogram_observe(&u->flight->gather_queue, queued_s);
  } else if (w->kind == WORK_REDUCE) {
    u->flight->last_reduce_us = w->run_ns / 1000;
    fsdp_histogram_observe(&u->flight->reduce_work, (double)w->run_ns * 1e-9);
    if (ran)
      fsdp_histogram_observe(&u->flight->reduce_queue, queued_s);
  }
  if (w->kind == WORK_PREFAULT) {
    if (r < 0) {
      fsdp_status_set(&u->flight->error, r, "unit '%s': %s failed: %s", u->spec->unit,
                      works[w->kind].phrase, fsdp_strerror(r));
      log_error("%s", u->flight->error.message);
      u->flight->state = FSDP_UNIT_FAILED;
    } else {
      u->flight->state = FSDP_UNIT_READY;
    }
    if (!w->job->flight->looking) /* else the look's end answers them */
      dp_wake(u, WAIT_REGISTER);
  } else if (r < 0) {
    waiter_kind_t kind =
        w->kind == WORK_GATHER || w->kind == WORK_UNSTAGE_GATHER ? WAIT_UNSHARD : WAIT_REDUCE;
    if (w->kind == WORK_OPTIMIZE) /* which elements it stepped is unknown: start again */
      log_error("unit '%s': its masters and optimizer state may be half stepped",
                u->spec->unit);
    fsdp_status_t st;
    fsdp_status_set(&st, FSDP_E_INTERNAL, "job '%s' unit '%s' step %llu: %s failed: %s",
                    w->job->name, u->spec->unit,
                    (unsigned long long)collection_of(u, kind)->step, works[w->kind].phrase,
                    w->error.code < 0 ? w->error.message : fsdp_strerror(r));
    dp_finish_collective(w->job, u, kind, &st);
  } else if (w->kind == WORK_NORM) {
    if (u->plan.shard_ring.members > 1)
      dp_start_norm_ring(dp, w->job, u, w->norm_sq);
    else
      dp_norm_known(dp, w->job, u, w->norm_sq);
  } else {
    dp_next_stage(dp, w->job, u, (int)w->kind, -1);
  }
  if (w->kind == WORK_OPTIMIZE && w->plan.step)
    fsdp_optimizer_stepped(w->job, u, w->plan.step);
  fsdp_optimizer_plan_cleanup(&w->plan);
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

int dp_queue(fsdp_dataplane_t *dp, work_kind_t kind, fsdp_job_t *job, fsdp_unit_t *unit) {
  fsdp_dataplane_work_t *w = calloc(1, sizeof *w);
  if (!w)
    return -ENOMEM;
  *w = (fsdp_dataplane_work_t){.kind = kind, .job = job, .unit = unit};
  if (kind == WORK_PREFAULT)
    w->bytes = fsdp_arena_block_size(job->arena, unit->buffers_offset);
  dp_enqueue(dp, w);
  return 0;
}

void dp_queue_or_abort(fsdp_dataplane_t *dp, work_kind_t kind, fsdp_job_t *job,
                       fsdp_unit_t *unit) {
  int r = dp_queue(dp, kind, job, unit);
  if (r < 0)
    dp_abort_collection(job, unit, kind == WORK_UNSTAGE_GATHER ? WAIT_UNSHARD : WAIT_REDUCE, r,
                        "cannot queue the collective's next stage");
}

void dp_enqueue(fsdp_dataplane_t *dp, fsdp_dataplane_work_t *w) {
  w->queued_ns = fsdp_clock_now_ns();
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
  dp_enqueue(dp, w);
  return 0;
}

bool fsdp_dataplane_uses_job(const fsdp_dataplane_t *dp, const fsdp_job_t *job) {
  for (const fsdp_dataplane_work_t *w = dp->head; w; w = w->next)
    if (w->job == job)
      return true;
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (u->flight->waiters || u->flight->gather.running || u->flight->reduce.running)
      return true;
  for (uint32_t r = 0; r < job->local_world_size; r++)
    if (!fsdp_list_empty(&job->grad_pools[r].waiters))
      return true;
  return false;
}
