/* Operations waiting in their units: parked, answered, and the local ranks' collections
 * they join (collectives/local.h decides), with their aborts; and the ends that come without
 * the collective: a deadline passed (the housekeeping's), a session ended. */
#include "daemon/dataplane/internal.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "collectives/local.h"
#include "common/clock.h"
#include "common/log.h"
#include "daemon/dataplane/optimizer.h"

void dp_op_init(fsdp_dataplane_op_t *op, fsdp_unit_t *unit, const fsdp_dataplane_rank_t *who,
                waiter_kind_t kind, fsdp_dataplane_done_fn done, void *data) {
  *op = (fsdp_dataplane_op_t){.unit = unit, .who = *who, .kind = kind, .done = done,
                              .data = data, .submit_ns = fsdp_clock_now_ns()};
  fsdp_list_init(&op->grad_waiter.link);
}

void dp_op_ok(fsdp_dataplane_op_t *op) {
  fsdp_status_t st = FSDP_STATUS_INIT;
  dp_record_op(op, 0);
  op->done(op->data, &st);
}

__attribute__((format(printf, 3, 4))) void dp_op_fail(fsdp_dataplane_op_t *op, int err,
                                                     const char *fmt, ...) {
  fsdp_status_t st;
  va_list ap;
  va_start(ap, fmt);
  fsdp_status_setv(&st, err, fmt, ap);
  va_end(ap);
  dp_record_op(op, err);
  op->done(op->data, &st);
}

void dp_op_unlink(fsdp_dataplane_op_t *op) {
  if (op->prev)
    op->prev->next = op->next;
  else
    op->unit->flight->waiters = op->next;
  if (op->next)
    op->next->prev = op->prev;
}

static bool rank_waits(const fsdp_unit_t *u, uint32_t rank, waiter_kind_t kind) {
  for (const fsdp_dataplane_op_t *w = u->flight->waiters; w; w = w->next)
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
  dp_op_unlink(op);
  if (op->kind != WAIT_REGISTER && !rank_waits(u, rank, (waiter_kind_t)op->kind))
    fsdp_collection_withdraw(collection_of(u, (waiter_kind_t)op->kind), rank);
}

void dp_park(fsdp_dataplane_op_t *op) {
  fsdp_unit_t *unit = op->unit;
  op->prev = NULL;
  op->next = unit->flight->waiters;
  if (unit->flight->waiters)
    unit->flight->waiters->prev = op;
  unit->flight->waiters = op;
}

void dp_wake(fsdp_unit_t *u, waiter_kind_t kind) {
  for (fsdp_dataplane_op_t *w = u->flight->waiters, *next; w; w = next) {
    next = w->next;
    if (w->kind != (int)kind)
      continue;
    dp_op_unlink(w);
    if (u->flight->state == FSDP_UNIT_FAILED)
      dp_op_fail(w, u->flight->error.code, "%s", u->flight->error.message);
    else
      dp_op_ok(w);
  }
}

void dp_abort_collection(fsdp_job_t *job, fsdp_unit_t *u, waiter_kind_t kind, int err,
                         const char *message) {
  fsdp_collection_t *c = collection_of(u, kind);
  for (fsdp_dataplane_op_t *w = u->flight->waiters, *next; w; w = next) {
    next = w->next;
    if (w->kind != (int)kind)
      continue;
    dp_op_unlink(w);
    dp_op_fail(w, err, "%s", message);
  }
  if (kind == WAIT_REDUCE) {
    dp_give_back_grads(job, u, &c->submitted);
    fsdp_pool_cancel(&u->flight->sum_waiter);
    dp_give_back_sum(job, u);
    if (c->running && u->flight->has_deferred) { /* its hooks may have left it half added */
      log_warning("unit '%s': the gradients whose all-reduce among replicas was deferred are "
                  "dropped: the reduce of step %llu failed",
                  u->spec->unit, (unsigned long long)c->step);
      dp_drop_deferred(job, u);
    }
  } else if (c->running) {
    /* The stage first: giving the copy back may start a waiting gather, which takes one. */
    dp_give_back_gather_stage(u);
    fsdp_pool_cancel(&u->flight->copy_waiter);
    dp_give_back_copy(job, u);
  }
  if (kind == WAIT_UNSHARD)
    u->flight->gather_ahead = false;
  fsdp_collection_reset(c);
  if (kind == WAIT_REDUCE) {
    dp_unhold_reduce(job, u);
    dp_tell_if_quiet(job);
  }
}

const char *dp_again_text(bool again) {
  return again ? " (its backward)" : "";
}

/* What a collection's ranks are asked for, in messages. */
static const char *collection_verb(waiter_kind_t kind) {
  return kind == WAIT_UNSHARD ? "unshard" : "reduce-scatter";
}

int dp_collect(fsdp_unit_t *u, waiter_kind_t kind, fsdp_dataplane_op_t *op,
               fsdp_job_t *job, uint64_t step, bool regather, uint64_t deadline_ms,
               uint64_t now_ms) {
  const fsdp_dataplane_rank_t *who = &op->who;
  uint32_t rank = who->local_rank;
  fsdp_collection_t *c = collection_of(u, kind);
  fsdp_rank_set_t died = {0};
  for (uint32_t r = 0; r < job->local_world_size; r++)
    if (who->serial < job->flight->gone_before_serial[r])
      fsdp_rank_set_put(&died, r, true);
  fsdp_collection_request_t rq = {.rank = rank, .step = step, .regather = regather,
                                  .generation = who->generation, .deadline_ms = deadline_ms,
                                  .now_ms = now_ms};
  char message[FSDP_STATUS_MESSAGE_MAX];
  int err;
  switch (fsdp_collection_join(c, job->local_world_size, &rq, &died)) {
  case FSDP_COLLECTION_JOINED:
    dp_park(op);
    return 0;
  case FSDP_COLLECTION_COMPLETE:
    *(kind == WAIT_UNSHARD ? &u->flight->gather_started_ns : &u->flight->reduce_started_ns) =
        fsdp_clock_now_ns();
    dp_park(op);
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
             dp_again_text(regather), (unsigned long long)c->step, dp_again_text(c->regather));
    err = FSDP_E_FAILED_PRECONDITION;
    break;
  }
  dp_abort_collection(job, u, kind, err, message);
  dp_op_fail(op, err, "%s", message);
  return -1;
}

void dp_finish_collective(fsdp_job_t *job, fsdp_unit_t *u, waiter_kind_t kind,
                          const fsdp_status_t *st) {
  fsdp_collection_t *c = collection_of(u, kind);
  if (st && st->code < 0) {
    log_error("%s", st->message);
    dp_abort_collection(job, u, kind, st->code, st->message);
    return;
  }
  fsdp_dataplane_reached_step(job, c->step);
  if (kind == WAIT_UNSHARD) {
    dp_give_back_gather_stage(u);
    u->flight->gathers++;
    u->flight->gathered = true;
    u->flight->gathered_step = c->step;
    u->flight->gathered_again = c->regather;
    u->flight->gathered_generation = c->generation;
    u->flight->holders = c->submitted;
    u->flight->gather_ahead = false;
    fsdp_collection_reset(c);
    if (fsdp_rank_set_empty(&u->flight->holders)) { /* every rank it was for is gone */
      dp_give_back_copy(job, u);
      return;
    }
    dp_wake_unshards(job, u);
    return;
  }
  if (!u->flight->reduce_step_only) {
    u->flight->reduced_step = c->step;
    u->flight->reduces++;
  }
  if (u->flight->reduce_defer)
    u->flight->n_deferred++;
  else
    dp_drop_deferred(job, u); /* the all-reduce took it */
  dp_give_back_grads(job, u, &c->submitted);
  dp_give_back_sum(job, u);
  dp_wake(u, kind);
  fsdp_collection_reset(c);
  dp_tell_if_quiet(job);
}

int dp_check_ready(const fsdp_unit_t *unit, fsdp_status_t *st) {
  switch (unit->flight->state) {
  case FSDP_UNIT_FAILED:
    return fsdp_status_set(st, unit->flight->error.code, "%s", unit->flight->error.message);
  case FSDP_UNIT_NEW:
  case FSDP_UNIT_ALLOCATING:
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "unit '%s' has no buffers yet: its RegisterUnit has not succeeded",
                           unit->spec->unit);
  default:
    return 0;
  }
}

bool dp_ready(fsdp_dataplane_op_t *op) {
  fsdp_status_t st;
  if (dp_check_ready(op->unit, &st) == 0)
    return true;
  op->done(op->data, &st);
  return false;
}

static const waiter_kind_t collective_kinds[] = {WAIT_UNSHARD, WAIT_REDUCE};

/* "'a' (ranks 0, 1), 'b' (rank 1)": the units whose pooled copies are lent, and to whom. */
static void format_copy_holders(const fsdp_job_t *job, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (const fsdp_unit_t *u = job->units; u && used < size; u = u->next) {
    if (!u->flight->has_copy || !u->flight->copy_pooled)
      continue;
    char ranks[96];
    fsdp_rank_set_format(&u->flight->holders, true, job->local_world_size, ranks, sizeof ranks);
    used += (size_t)snprintf(buf + used, size - used, "%s'%s' (ranks %s)", used ? ", " : "",
                             u->spec->unit, ranks[0] ? ranks : "none");
  }
}

/* "'a', 'b'": the units whose reduces hold host sums. */
static void format_sum_holders(const fsdp_job_t *job, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (const fsdp_unit_t *u = job->units; u && used < size; u = u->next)
    if (u->flight->has_sum)
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
    const fsdp_pool_waiter_t *w = gather ? &u->flight->copy_waiter : &u->flight->sum_waiter;
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
    dp_abort_collection(job, u, kind, FSDP_E_ABORTED, message);
  }
}

/* With clipping, reduces that wrote their gradient and waited past their deadline for the
 * other units' of the step: each hears the first unit that did not come. */
static void expire_norm_waits(fsdp_job_t *job, uint64_t now_ms) {
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    if (!u->flight->awaiting_norm || now_ms < u->flight->norm_deadline_ms)
      continue;
    const fsdp_unit_t *missing = job->units;
    while (missing && (!fsdp_optimizer_steps_unit(job, missing) ||
                       (missing->flight->awaiting_norm && missing->flight->reduce.step == u->flight->reduce.step)))
      missing = missing->next;
    char message[FSDP_STATUS_MESSAGE_MAX];
    snprintf(message, sizeof message,
             "unit '%s' step %llu: clipping by the global norm (max_grad_norm) waited in vain "
             "for unit '%s''s gradient of the step (store.collective_timeout)",
             u->spec->unit, (unsigned long long)u->flight->reduce.step,
             missing ? missing->spec->unit : "?");
    log_warning("%s", message);
    u->flight->awaiting_norm = false;
    dp_abort_collection(job, u, WAIT_REDUCE, FSDP_E_ABORTED, message);
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
      dp_op_fail(op, FSDP_E_ABORTED,
                 "unit '%s' step %llu: local rank %u of job '%s' waited in vain for a "
                 "full-gradient buffer (store.collective_timeout): it holds %u (max_inflight) "
                 "whose reduce has not ended",
                 op->unit->spec->unit, (unsigned long long)op->unit->flight->gathered_step, r, job->name,
                 job->max_inflight);
    }
  }
}

void fsdp_dataplane_expire(fsdp_store_t *store, uint64_t now_ms,
                           fsdp_dataplane_timeout_fn on_timeout, void *data) {
  for (fsdp_job_t *job = store->jobs; job; job = job->next) {
    char note[FSDP_STATUS_MESSAGE_MAX / 2] = "";
    bool noted = false;
    for (fsdp_unit_t *u = job->units; u; u = u->next) {
      for (size_t k = 0; k < sizeof collective_kinds / sizeof collective_kinds[0]; k++) {
        waiter_kind_t kind = collective_kinds[k];
        const fsdp_collection_t *c = collection_of(u, kind);
        fsdp_rank_set_t missing_ranks;
        if (!fsdp_collection_expired(c, job->local_world_size, now_ms, &missing_ranks))
          continue;
        if (!noted && on_timeout)
          on_timeout(data, job, note, sizeof note);
        noted = true;
        char missing[128], message[FSDP_STATUS_MESSAGE_MAX];
        fsdp_rank_set_format(&missing_ranks, true, job->local_world_size, missing,
                             sizeof missing);
        snprintf(message, sizeof message,
                 "unit '%s' step %llu: local rank(s) %s of job '%s' did not ask to %s in time "
                 "(store.collective_timeout)",
                 u->spec->unit, (unsigned long long)c->step, missing, job->name,
                 collection_verb(kind));
        size_t at = strlen(message); /* the note as far as it fits */
        snprintf(message + at, sizeof message - at, "%s", note);
        char step[24];
        snprintf(step, sizeof step, "%llu", (unsigned long long)c->step);
        const fsdp_log_field_t fields[] = {{"JOB", job->name}, {"UNIT", u->spec->unit},
                                           {"STEP", step}, {"RANK", missing},
                                           {"CODE", "ABORTED"}};
        fsdp_log_fields(FSDP_LOG_WARNING, fields, 5, "%s", message);
        dp_abort_collection(job, u, kind, FSDP_E_ABORTED, message);
      }
    }
    expire_pool_waits(job, now_ms);
    expire_norm_waits(job, now_ms);
  }
}

/* An operation of a session that ended, taken from where it waited, ends ABORTED. */
static void fail_for_ended_session(fsdp_dataplane_op_t *op, const fsdp_job_t *job,
                                   const char *why) {
  dp_op_fail(op, FSDP_E_ABORTED,
             "session %016llx (job '%s' local rank %u) ended while the call waited: %s",
             (unsigned long long)op->who.session_id, job->name, op->who.local_rank, why);
}

void fsdp_dataplane_release_session(fsdp_job_t *job, uint32_t rank, uint64_t session_id,
                                    const char *why, uint64_t next_serial) {
  job->flight->gone_before_serial[rank] = next_serial;
  job->flight->forward_step[rank] = 0; /* its successor starts the forward order anew */
  /* Its own operations end first, whatever they wait for (a running collective, a pool
   * buffer): an answer after this would be an answer to a session that no longer exists. */
  fsdp_pool_waiter_t *pw, *tmp;
  fsdp_list_for_each_safe(pw, tmp, &job->grad_pools[rank].waiters, link) {
    fsdp_dataplane_op_t *op =
        (fsdp_dataplane_op_t *)((char *)pw - offsetof(fsdp_dataplane_op_t, grad_waiter));
    if (op->who.session_id != session_id)
      continue;
    fsdp_pool_cancel(pw);
    fail_for_ended_session(op, job, why);
  }
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    for (fsdp_dataplane_op_t *w = u->flight->waiters, *next; w; w = next) {
      next = w->next;
      if (w->who.session_id != session_id)
        continue;
      dp_op_unlink(w);
      fail_for_ended_session(w, job, why);
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
      dp_abort_collection(job, u, kind, FSDP_E_ABORTED, message);
    }
    /* What it was lent comes back, and a running gather will not lend it the copy; a
     * running reduce gives its buffer back when it ends. */
    dp_let_go(job, u, rank);
    if (u->flight->gather.running)
      fsdp_rank_set_put(&u->flight->gather.submitted, rank, false);
    if (!(u->flight->reduce.running && fsdp_rank_set_has(&u->flight->reduce.submitted, rank))) {
      fsdp_rank_set_t just_rank = {0};
      fsdp_rank_set_put(&just_rank, rank, true);
      dp_give_back_grads(job, u, &just_rank);
    }
  }
}
