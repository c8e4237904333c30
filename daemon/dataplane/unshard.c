/* Unshard and Reshard: the gather of a step once every local rank asked (or the schedule
 * asked for them), and the copy lent to the ranks until they let go. */
#include "daemon/dataplane/internal.h"

#include <stddef.h>

#include "collectives/local.h"

static void on_copy_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st);
static void redo_unshard(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_dataplane_op_t *op);

void dp_wake_unshards(fsdp_job_t *job, fsdp_unit_t *u) {
  fsdp_dataplane_op_t *redo = NULL;
  for (fsdp_dataplane_op_t *w = u->flight->waiters, *next; w; w = next) {
    next = w->next;
    if (w->kind != WAIT_UNSHARD)
      continue;
    dp_op_unlink(w);
    if (w->redo) {
      w->next = redo;
      redo = w;
    } else {
      dp_lend(job, u, w);
    }
  }
  for (fsdp_dataplane_op_t *w = redo, *next; w; w = next) {
    next = w->next;
    redo_unshard(u->flight->copy_waiter.data, job, w);
  }
}

void dp_start_gather(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u) {
  fsdp_job_flight_t *jf = job->flight;
  if (jf->resume_pending || jf->resuming) {
    u->flight->gather_after_resume = true;
    if (jf->resume_pending) { /* the first gather starts the load */
      jf->resume_pending = false;
      jf->resuming = true;
      dp->hooks.resume(dp->hooks.ctx, job);
    }
    return;
  }
  u->flight->copy_waiter.data = dp;
  if (u->copy_in_masters) {
    dp_finish_collective(job, u, WAIT_UNSHARD, NULL);
    return;
  }
  uint64_t offset = 0;
  fsdp_status_t st = FSDP_STATUS_INIT;
  int r;
  u->flight->copy_pooled = u->flight->reshard_after_forward;
  if (u->flight->copy_pooled) {
    r = fsdp_pool_take(&job->copies, copy_bytes(u), &u->flight->copy_waiter, on_copy_ready, &offset,
                       &st);
    if (r == 1)
      return; /* on_copy_ready goes on */
  } else {
    r = dp_alloc_pages(job->shared_arena, copy_bytes(u), &offset, &st);
  }
  if (r < 0)
    fsdp_status_set(&st, r, "unit '%s' step %llu: no unsharded copy: %s", u->spec->unit,
                    (unsigned long long)u->flight->gather.step, st.message);
  on_copy_ready(&u->flight->copy_waiter, offset, &st);
}

static void on_copy_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st) {
  fsdp_unit_t *u =
      ((fsdp_unit_flight_t *)((char *)waiter - offsetof(fsdp_unit_flight_t, copy_waiter)))->unit;
  fsdp_job_t *job = u->job;
  if (st->code < 0) {
    dp_finish_collective(job, u, WAIT_UNSHARD, st);
    return;
  }
  u->flight->has_copy = true;
  u->flight->copy_offset = offset;
  if (stages_unit(job, u) && u->plan.shard_ring.members > 1) {
    fsdp_status_t staged;
    if (dp_take_stage(waiter->data, job, copy_bytes(u), &u->flight->gather_stage, &staged) < 0) {
      fsdp_status_set(&staged, staged.code, "unit '%s' step %llu: no staged copy: %s",
                      u->spec->unit, (unsigned long long)u->flight->gather.step, staged.message);
      dp_finish_collective(job, u, WAIT_UNSHARD, &staged);
      return;
    }
  }
  int r = dp_queue(waiter->data, WORK_GATHER, job, u);
  if (r < 0)
    dp_abort_collection(job, u, WAIT_UNSHARD, r, "cannot queue the gather");
}

int fsdp_dataplane_reshard(fsdp_job_t *job, fsdp_unit_t *unit, const fsdp_dataplane_rank_t *who,
                           fsdp_status_t *st) {
  int r = dp_check_ready(unit, st);
  if (r < 0)
    return r;
  dp_let_go(job, unit, who->local_rank);
  return 0;
}

static void unshard(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit,
                    fsdp_dataplane_op_t *op) {
  uint32_t rank = op->who.local_rank;
  uint64_t step = op->step;
  bool again = op->backward && unit->flight->reshard_after_forward;
  prefetch_cause_t cause = {.backward = op->backward, .generation = op->who.generation,
                            .deadline_ms = op->deadline_ms};
  fsdp_collection_t *c = &unit->flight->gather;
  if (fsdp_rank_set_has(&c->submitted, rank)) {
    if (step == c->step && again == c->regather) {
      dp_park(op); /* a second operation of the rank shares its request */
      return;
    }
    if (unit->flight->gather_ahead) {
      op->redo = true; /* the prefetch asked for the rank: served once it ends */
      dp_park(op);
      return;
    }
    dp_op_fail(op, FSDP_E_FAILED_PRECONDITION,
               "unit '%s': local rank %u asked for step %llu%s while its request for step %llu%s "
               "waits",
               unit->spec->unit, rank, (unsigned long long)step, dp_again_text(again),
               (unsigned long long)c->step, dp_again_text(c->regather));
    return;
  }
  uint64_t round = dp_gather_round(step, again);
  if (round < dp_gather_round(unit->flight->gathered_step, unit->flight->gathered_again) &&
      fsdp_rank_set_empty(&unit->flight->holders) && !c->running &&
      op->who.generation > unit->flight->gathered_generation) {
    /* A new run repeats the step its predecessor did not finish (a host was lost in it):
     * what that run gathered ahead is not ahead of this one. */
    dp_give_back_copy(job, unit);
    unit->flight->gathered = false;
    unit->flight->gathered_step = 0;
    unit->flight->gathered_again = false;
  }
  uint64_t held = dp_gather_round(unit->flight->gathered_step, unit->flight->gathered_again);
  if (unit->flight->gathered && round == held) {
    dp_lend(job, unit, op); /* the fast path: this step's copy is there */
    dp_prefetch_after(dp, job, unit, step, &cause);
    return;
  }
  if (round < held) {
    dp_op_fail(op, FSDP_E_FAILED_PRECONDITION,
               "unit '%s': local rank %u asked for step %llu%s, but the unsharded copy already "
               "holds step %llu%s",
               unit->spec->unit, rank, (unsigned long long)step, dp_again_text(again),
               (unsigned long long)unit->flight->gathered_step, dp_again_text(unit->flight->gathered_again));
    return;
  }
  if (c->running) {
    dp_op_fail(op, FSDP_E_FAILED_PRECONDITION,
               "unit '%s': local rank %u asked for step %llu%s while step %llu%s is being gathered",
               unit->spec->unit, rank, (unsigned long long)step, dp_again_text(again),
               (unsigned long long)c->step, dp_again_text(c->regather));
    return;
  }
  dp_let_go(job, unit, rank); /* asking for a newer step lets go of the older copy */
  if (dp_collect(unit, WAIT_UNSHARD, op, job, step, again, op->deadline_ms, uv_now(dp->loop)) <=
      0)
    return;
  if (step > job->flight->masters_final_step)
    job->flight->masters_final_step = step; /* every rank asked: their masters are final for it */
  if (!op->backward && dp->hooks.step_boundary)
    dp->hooks.step_boundary(dp->hooks.ctx, job, step - 1);
  dp_start_gather(dp, job, unit);
  dp_prefetch_after(dp, job, unit, step, &cause);
}

static void redo_unshard(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_dataplane_op_t *op) {
  op->redo = false;
  unshard(dp, job, op->unit, op);
}

void fsdp_dataplane_unshard(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit,
                            const fsdp_dataplane_rank_t *who, uint64_t step, bool backward,
                            uint64_t deadline_ms, fsdp_dataplane_op_t *op,
                            fsdp_dataplane_done_fn done, void *data) {
  dp_op_init(op, unit, who, WAIT_UNSHARD, done, data);
  op->backward = backward;
  op->step = step;
  op->deadline_ms = deadline_ms;
  if (!dp_ready(op))
    return;
  if (!backward && !dp_in_order(job, unit, op))
    return;
  if (who->local_rank == 0 && !backward)
    dp_record_order(job, unit, step);
  unshard(dp, job, unit, op);
}
