/* The schedule the daemon runs for a job (SetSchedule): the forward order, given or
 * recorded, the prefetch that gathers ahead on the ranks' behalf, and the pools' in-flight
 * cap. */
#include "daemon/dataplane/internal.h"

#include <string.h>

#include "collectives/local.h"
#include "common/clock.h"

static void use_order(fsdp_job_t *job, fsdp_unit_t *const *units, unsigned n);

uint64_t dp_gather_round(uint64_t step, bool again) {
  return 2 * step + again;
}

void dp_record_order(fsdp_job_t *job, fsdp_unit_t *unit, uint64_t step) {
  if (job->flight->order_given)
    return;
  if (step != job->flight->recording_step) {
    bool same = job->flight->n_recorded == job->flight->n_order &&
                memcmp(job->flight->recorded, job->flight->order, job->flight->n_order * sizeof *job->flight->order) == 0;
    if (job->flight->recording_step && !same && job->flight->n_recorded)
      use_order(job, job->flight->recorded, job->flight->n_recorded);
    job->flight->recording_step = step;
    job->flight->n_recorded = 0;
  }
  for (unsigned i = 0; i < job->flight->n_recorded; i++)
    if (job->flight->recorded[i] == unit)
      return; /* a unit run twice in a step keeps its first place */
  job->flight->recorded[job->flight->n_recorded++] = unit;
}

static void use_order(fsdp_job_t *job, fsdp_unit_t *const *units, unsigned n) {
  for (unsigned i = 0; i < job->flight->n_order; i++)
    job->flight->order[i]->flight->order_index = -1;
  memmove(job->flight->order, units, n * sizeof *units); /* units may be job->recorded */
  job->flight->n_order = n;
  for (unsigned i = 0; i < n; i++)
    job->flight->order[i]->flight->order_index = (int)i;
}

void fsdp_dataplane_set_order(fsdp_job_t *job, fsdp_unit_t *const *units, unsigned n) {
  use_order(job, units, n);
  job->flight->order_given = n > 0;
  memset(job->flight->forward_step, 0, sizeof job->flight->forward_step); /* each rank starts the order anew */
  job->flight->recording_step = 0; /* recording starts afresh */
  job->flight->n_recorded = 0;
}

/* Gathers v for step (its backward's gather with again) on behalf of every local rank,
 * unless something is collected, gathered or held for it already. */
static void gather_ahead(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *v, uint64_t step,
                         bool again, const prefetch_cause_t *cause) {
  fsdp_collection_t *c = &v->flight->gather;
  if (v->flight->state != FSDP_UNIT_READY || c->running || c->count > 0 ||
      !fsdp_rank_set_empty(&v->flight->holders) ||
      (v->flight->gathered &&
       dp_gather_round(v->flight->gathered_step, v->flight->gathered_again) >= dp_gather_round(step, again)))
    return;
  dp_give_back_copy(job, v); /* an older copy nobody holds */
  fsdp_rank_set_t none = {0};
  for (uint32_t r = 0; r < job->local_world_size; r++) {
    fsdp_collection_request_t rq = {.rank = r, .step = step, .regather = again,
                                    .generation = cause->generation,
                                    .deadline_ms = cause->deadline_ms,
                                    .now_ms = uv_now(dp->loop)};
    fsdp_collection_join(c, job->local_world_size, &rq, &none);
  }
  v->flight->gather_started_ns = fsdp_clock_now_ns();
  v->flight->gather_ahead = true;
  dp_start_gather(dp, job, v);
}

void dp_prefetch_after(fsdp_dataplane_t *dp, fsdp_job_t *job, const fsdp_unit_t *unit,
                       uint64_t step, const prefetch_cause_t *cause) {
  unsigned depth = cause->backward ? job->flight->backward_prefetch : job->flight->forward_prefetch;
  if (!depth || unit->flight->order_index < 0 || step > job->flight->masters_final_step)
    return;
  int dir = cause->backward ? -1 : 1;
  for (int i = unit->flight->order_index + dir; depth && i >= 0 && i < (int)job->flight->n_order; i += dir) {
    fsdp_unit_t *v = job->flight->order[i];
    if (cause->backward && !v->trainable)
      continue;
    gather_ahead(dp, job, v, step, cause->backward && v->flight->reshard_after_forward, cause);
    depth--;
  }
}

bool dp_in_order(fsdp_job_t *job, const fsdp_unit_t *unit, fsdp_dataplane_op_t *op) {
  uint32_t rank = op->who.local_rank;
  if (!job->flight->order_given || unit->flight->order_index < 0)
    return true;
  if (op->step != job->flight->forward_step[rank]) {
    job->flight->forward_step[rank] = op->step;
    job->flight->forward_next[rank] = 0;
  }
  unsigned at = (unsigned)unit->flight->order_index, next = job->flight->forward_next[rank];
  if (at + 1 == next)
    return true; /* the unit it asked for last, again */
  if (at != next) {
    dp_op_fail(op, FSDP_E_FAILED_PRECONDITION,
               "unit '%s': local rank %u asked for it in the forward of step %llu, but the "
               "forward order (SetSchedule) has %s%s%s next",
               unit->spec->unit, rank, (unsigned long long)op->step,
               next < job->flight->n_order ? "'" : "", next < job->flight->n_order ? job->flight->order[next]->spec->unit
                                                                    : "no unit",
               next < job->flight->n_order ? "'" : "");
    return false;
  }
  job->flight->forward_next[rank] = next + 1;
  return true;
}

void fsdp_dataplane_set_max_inflight(fsdp_job_t *job, unsigned max_inflight) {
  job->max_inflight = max_inflight;
  fsdp_pool_set_capacity(&job->copies, max_inflight);
  fsdp_pool_set_capacity(&job->sums, max_inflight);
  for (uint32_t r = 0; r < job->local_world_size; r++)
    fsdp_pool_set_capacity(&job->grad_pools[r], max_inflight);
}
