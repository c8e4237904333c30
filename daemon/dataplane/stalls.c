/* Stalls: a job's collective under way for longer than health.stall_after, found by the
 * housekeeping timer, for health (the job's service turns NOT_SERVING) and the metrics; and
 * each collective under way as Operator.Why lists them. */
#include "daemon/dataplane/internal.h"

#include <stdio.h>

#include "common/log.h"

/* The job's oldest collective under way (NULL: none), and its kind. */
static const fsdp_unit_t *oldest(const fsdp_job_t *job, waiter_kind_t *ret_kind) {
  const fsdp_unit_t *found = NULL;
  uint64_t first = UINT64_MAX;
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    for (int k = 0; k < 2; k++) {
      waiter_kind_t kind = k ? WAIT_REDUCE : WAIT_UNSHARD;
      const fsdp_collection_t *c = collection_of((fsdp_unit_t *)u, kind);
      if (c->count > 0 && c->first_ms < first) {
        first = c->first_ms;
        found = u;
        *ret_kind = kind;
      }
    }
  return found;
}

uint64_t fsdp_dataplane_oldest_wait_ms(const fsdp_job_t *job, uint64_t now_ms) {
  waiter_kind_t kind = WAIT_UNSHARD;
  const fsdp_unit_t *u = oldest(job, &kind);
  if (!u)
    return 0;
  uint64_t first = collection_of((fsdp_unit_t *)u, kind)->first_ms;
  return now_ms > first ? now_ms - first : 0;
}

/* What the job waits for, in the health's reason and the log. */
static void describe(const fsdp_job_t *job, const fsdp_unit_t *u, waiter_kind_t kind,
                     uint64_t age_ms, char *buf, size_t size) {
  const fsdp_collection_t *c = collection_of((fsdp_unit_t *)u, kind);
  const char *what = kind == WAIT_UNSHARD ? "gather" : "reduce";
  if (c->running) {
    snprintf(buf, size, "job '%s' unit '%s' step %llu: its %s has run for %.1f s%s",
             job->name, u->spec->unit, (unsigned long long)c->step, what, age_ms / 1000.0,
             fsdp_unit_plan_spans_hosts(&u->plan) ? " (its rings among hosts wait)" : "");
    return;
  }
  fsdp_rank_set_t missing = {0};
  for (uint32_t r = 0; r < job->local_world_size; r++)
    if (!fsdp_rank_set_has(&c->submitted, r))
      fsdp_rank_set_put(&missing, r, true);
  char ranks[128];
  fsdp_rank_set_format(&missing, true, job->local_world_size, ranks, sizeof ranks);
  snprintf(buf, size, "job '%s' unit '%s' step %llu: its %s has waited %.1f s for local "
           "rank(s) %s",
           job->name, u->spec->unit, (unsigned long long)c->step, what, age_ms / 1000.0, ranks);
}

void fsdp_dataplane_each_wait(const fsdp_job_t *job, uint64_t now_ms,
                              void (*fn)(void *data, const fsdp_dataplane_wait_t *wait),
                              void *data) {
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    for (int k = 0; k < 2; k++) {
      waiter_kind_t kind = k ? WAIT_REDUCE : WAIT_UNSHARD;
      const fsdp_collection_t *c = collection_of((fsdp_unit_t *)u, kind);
      if (c->count == 0)
        continue;
      fsdp_dataplane_wait_t w = {
          .unit = u,
          .what = kind == WAIT_UNSHARD ? "gather" : "reduce",
          .step = c->step,
          .waited_ms = now_ms > c->first_ms ? now_ms - c->first_ms : 0,
          .running = c->running,
          .across_hosts = c->running && fsdp_unit_plan_spans_hosts(&u->plan),
          .asked = c->submitted,
      };
      fn(data, &w);
    }
}

bool fsdp_dataplane_describe_oldest(const fsdp_job_t *job, uint64_t now_ms, char *buf,
                                    size_t size) {
  waiter_kind_t kind = WAIT_UNSHARD;
  const fsdp_unit_t *u = oldest(job, &kind);
  if (u)
    describe(job, u, kind, fsdp_dataplane_oldest_wait_ms(job, now_ms), buf, size);
  return u != NULL;
}

void fsdp_dataplane_check_stalls(fsdp_store_t *store, uint64_t now_ms,
                                 uint64_t stall_after_ms) {
  for (fsdp_job_t *job = store->jobs; job; job = job->next) {
    fsdp_job_flight_t *jf = job->flight;
    waiter_kind_t kind = WAIT_UNSHARD;
    const fsdp_unit_t *u = oldest(job, &kind);
    uint64_t first = u ? collection_of((fsdp_unit_t *)u, kind)->first_ms : now_ms;
    uint64_t age_ms = now_ms > first ? now_ms - first : 0;
    bool stalled = u && age_ms >= stall_after_ms;
    if (stalled)
      describe(job, u, kind, age_ms, jf->stall, sizeof jf->stall);
    if (stalled && !jf->stalled) {
      char step[24];
      snprintf(step, sizeof step, "%llu",
               (unsigned long long)collection_of((fsdp_unit_t *)u, kind)->step);
      const fsdp_log_field_t fields[] = {{"JOB", job->name}, {"UNIT", u->spec->unit},
                                         {"STEP", step}};
      fsdp_log_fields(FSDP_LOG_WARNING, fields, 3, "%s (health.stall_after): fsdp.job.%s is "
                      "NOT_SERVING", jf->stall, job->name);
    }
    else if (!stalled && jf->stalled)
      log_info("job '%s' goes on: fsdp.job.%s is SERVING again", job->name, job->name);
    jf->stalled = stalled;
  }
}
