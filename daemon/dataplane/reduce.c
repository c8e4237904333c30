/* ReduceScatter: a unit's reduce once every local rank submitted, here or across hosts;
 * the optimizer step that follows it (clipping waits for the step's global norm); and the
 * hold a checkpoint's snapshot puts on a job's reduces. */
#include "daemon/dataplane/internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "collectives/local.h"
#include "common/log.h"
#include "daemon/dataplane/optimizer.h"

static void step_if_every_norm(fsdp_dataplane_t *dp, fsdp_job_t *job, uint64_t step);
static void queue_step(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u, bool clip,
                       float clip_coef);

void dp_unhold_reduce(fsdp_job_t *job, fsdp_unit_t *u) {
  if (!u->flight->reduce_held)
    return;
  u->flight->reduce_held = false;
  for (fsdp_unit_t **p = &job->flight->held_reduces; *p; p = &(*p)->flight->held_next)
    if (*p == u) {
      *p = u->flight->held_next;
      break;
    }
}

/* Whether a reduce of the job runs (one held waits, and does not). */
static bool reducing(const fsdp_job_t *job) {
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (u->flight->reduce.running && !u->flight->reduce_held)
      return true;
  return false;
}

void dp_tell_if_quiet(fsdp_job_t *job) {
  void (*quiet)(void *arg) = job->flight->reduces_quiet;
  if (!quiet || reducing(job))
    return;
  job->flight->reduces_quiet = NULL;
  quiet(job->flight->reduces_quiet_arg);
}

void dp_norm_known(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u, double norm_sq) {
  u->flight->norm_sq = norm_sq;
  u->flight->awaiting_norm = true;
  u->flight->norm_deadline_ms = uv_now(dp->loop) + dp->collective_timeout_ms;
  step_if_every_norm(dp, job, u->flight->reduce.step);
}

void dp_start_step(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u) {
  uint64_t step = u->flight->reduce.step;
  if (step <= u->flight->stepped_step) {
    log_info("unit '%s' step %llu: its optimizer step was taken already", u->spec->unit,
             (unsigned long long)step);
    dp_finish_collective(job, u, WAIT_REDUCE, NULL);
    return;
  }
  if (fsdp_optimizer_max_grad_norm(job) > 0) {
    int r = dp_queue(dp, WORK_NORM, job, u);
    if (r < 0)
      dp_abort_collection(job, u, WAIT_REDUCE, r, "cannot queue the gradient's norm");
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
    if (!u->flight->awaiting_norm || u->flight->reduce.step != step)
      return; /* its reduce of the step has not written its gradient yet */
    total += u->flight->norm_sq;
  }
  float norm = (float)sqrt(total);
  float coef = 1.0f / (norm + (float)1e-6) * (float)fsdp_optimizer_max_grad_norm(job);
  if (coef > 1.0f)
    coef = 1.0f;
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    if (!fsdp_optimizer_steps_unit(job, u))
      continue;
    u->flight->awaiting_norm = false;
    queue_step(dp, job, u, true, coef);
  }
}

static void queue_step(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u, bool clip,
                       float clip_coef) {
  uint64_t step = u->flight->reduce.step;
  fsdp_status_t st;
  fsdp_dataplane_work_t *w = calloc(1, sizeof *w);
  if (!w) {
    dp_abort_collection(job, u, WAIT_REDUCE, FSDP_E_RESOURCE_EXHAUSTED,
                        "out of memory for the optimizer step");
    return;
  }
  *w = (fsdp_dataplane_work_t){.kind = WORK_OPTIMIZE, .job = job, .unit = u};
  if (fsdp_optimizer_plan(job, u, &w->plan, &st) < 0) {
    free(w);
    fsdp_status_t failed;
    fsdp_status_set(&failed, st.code, "unit '%s' step %llu: %s", u->spec->unit,
                    (unsigned long long)step, st.message);
    dp_finish_collective(job, u, WAIT_REDUCE, &failed);
    return;
  }
  w->plan.clip = clip;
  w->plan.clip_coef = clip_coef;
  u->flight->stepped_step = step;
  dp_enqueue(dp, w);
}

/* Every local rank asked the unit's reduce: its rings among hosts, or its work here; or,
 * for a step alone, the step. */
static void start_reduce(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit) {
  if (unit->flight->reduce_step_only) {
    dp_start_step(dp, job, unit);
    return;
  }
  if (fsdp_unit_plan_spans_hosts(&unit->plan)) {
    dp_start_reduce_rings(dp, job, unit);
    return;
  }
  int r = dp_queue(dp, WORK_REDUCE, job, unit);
  if (r < 0)
    dp_abort_collection(job, unit, WAIT_REDUCE, r, "cannot queue the reduce-scatter");
}

/* What a rank's reduce must be to be collected: a gradient buffer to submit (a step alone
 * submits none, and may hold none), flags that go together, the job's optimizer when a
 * step is asked for. Fails op otherwise. */
static bool check_reduce(const fsdp_unit_t *unit, const fsdp_job_t *job, uint32_t rank,
                         uint64_t step, const fsdp_dataplane_reduce_how_t *how,
                         fsdp_dataplane_op_t *op) {
  const char *name = unit->spec->unit;
  bool lent = fsdp_rank_set_has(&unit->flight->grads_lent, rank);
  if (how->step_only && (!how->step_optimizer || how->accumulate || how->defer_all_reduce)) {
    dp_op_fail(op, FSDP_E_INVALID_ARGUMENT,
               "unit '%s' step %llu: step_only = true goes with step_optimizer = true and "
               "neither accumulate nor defer_all_reduce (here %s, %s, %s)",
               name, (unsigned long long)step, how->step_optimizer ? "true" : "false",
               how->accumulate ? "true" : "false", how->defer_all_reduce ? "true" : "false");
    return false;
  }
  if (how->step_only && lent) {
    dp_op_fail(op, FSDP_E_FAILED_PRECONDITION,
               "unit '%s' step %llu: step_only, but local rank %u holds a full-gradient buffer: "
               "reduce it first",
               name, (unsigned long long)step, rank);
    return false;
  }
  if (how->step_only && unit->flight->has_deferred) {
    dp_op_fail(op, FSDP_E_FAILED_PRECONDITION,
               "unit '%s' step %llu: step_only, but the unit holds gradients whose all-reduce "
               "among replicas was deferred: a reduce without defer_all_reduce writes them",
               name, (unsigned long long)step);
    return false;
  }
  if (!how->step_only && !lent) {
    dp_op_fail(op, FSDP_E_FAILED_PRECONDITION,
               "unit '%s' step %llu: local rank %u holds no full-gradient buffer to reduce: the "
               "Unshard for the unit's backward lends it",
               name, (unsigned long long)step, rank);
    return false;
  }
  if (how->step_optimizer && !fsdp_optimizer_is_set(job)) {
    dp_op_fail(op, FSDP_E_FAILED_PRECONDITION,
               "unit '%s' step %llu: step_optimizer, but job '%s' has no optimizer in the daemon "
               "(SetOptimizer)",
               name, (unsigned long long)step, job->name);
    return false;
  }
  return true;
}

void fsdp_dataplane_reduce(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit,
                           const fsdp_dataplane_rank_t *who, uint64_t step,
                           const fsdp_dataplane_reduce_how_t *how, uint64_t deadline_ms,
                           fsdp_dataplane_op_t *op, fsdp_dataplane_done_fn done, void *data) {
  uint32_t rank = who->local_rank;
  dp_op_init(op, unit, who, WAIT_REDUCE, done, data);
  op->step = step;
  if (!dp_ready(op))
    return;
  fsdp_collection_t *c = &unit->flight->reduce;
  if (c->running || fsdp_rank_set_has(&c->submitted, rank)) {
    dp_op_fail(op, FSDP_E_FAILED_PRECONDITION,
               "unit '%s' step %llu: local rank %u already submitted its gradient",
               unit->spec->unit, (unsigned long long)c->step, rank);
    return;
  }
  if (!check_reduce(unit, job, rank, step, how, op))
    return;
  bool defer = how->defer_all_reduce && unit->plan.replica_ring.members > 1; /* else none */
  bool asked[] = {how->accumulate, defer, how->step_optimizer && !how->defer_all_reduce,
                  how->step_only};
  bool *kept[] = {&unit->flight->reduce_accumulate, &unit->flight->reduce_defer,
                  &unit->flight->reduce_step, &unit->flight->reduce_step_only};
  static const char *const names[] = {"accumulate", "defer_all_reduce", "step_optimizer",
                                      "step_only"};
  enum { FLAGS = sizeof asked / sizeof asked[0] };
  size_t differs = FLAGS;
  for (size_t k = 0; k < FLAGS; k++) {
    if (c->count == 0)
      *kept[k] = asked[k];
    else if (step == c->step && asked[k] != *kept[k] && differs == FLAGS)
      differs = k;
  }
  if (differs < FLAGS) {
    char message[FSDP_STATUS_MESSAGE_MAX];
    snprintf(message, sizeof message,
             "unit '%s' step %llu: local rank %u submitted with %s %s while the other ranks "
             "submitted with %s %s",
             unit->spec->unit, (unsigned long long)step, rank, names[differs],
             asked[differs] ? "true" : "false", names[differs],
             *kept[differs] ? "true" : "false");
    dp_abort_collection(job, unit, WAIT_REDUCE, FSDP_E_FAILED_PRECONDITION, message);
    dp_op_fail(op, FSDP_E_FAILED_PRECONDITION, "%s", message);
    return;
  }
  if (dp_collect(unit, WAIT_REDUCE, op, job, step, false, deadline_ms, uv_now(dp->loop)) <= 0)
    return;
  /* While the hold waits for the running reduces, those of their step may still start. */
  if (job->flight->reduces_held && (!job->flight->reduces_quiet || step > job->flight->hold_after_step)) {
    fsdp_unit_t **tail = &job->flight->held_reduces;
    while (*tail)
      tail = &(*tail)->flight->held_next;
    *tail = unit;
    unit->flight->held_next = NULL;
    unit->flight->reduce_held = true;
    return;
  }
  start_reduce(dp, job, unit);
}

bool fsdp_dataplane_hold_reduces(fsdp_dataplane_t *dp, fsdp_job_t *job, uint64_t after_step,
                                 void (*quiet)(void *arg), void *arg) {
  (void)dp;
  job->flight->reduces_held = true;
  job->flight->hold_after_step = after_step;
  if (!reducing(job))
    return true;
  job->flight->reduces_quiet = quiet;
  job->flight->reduces_quiet_arg = arg;
  return false;
}

void fsdp_dataplane_release_reduces(fsdp_dataplane_t *dp, fsdp_job_t *job) {
  job->flight->reduces_held = false;
  job->flight->reduces_quiet = NULL;
  while (job->flight->held_reduces) {
    fsdp_unit_t *u = job->flight->held_reduces;
    job->flight->held_reduces = u->flight->held_next;
    u->flight->reduce_held = false;
    start_reduce(dp, job, u);
  }
}
