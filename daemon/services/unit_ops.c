/* Checks and arguments shared by the Trainer handlers and the fast path. */
#include "daemon/services/unit_ops.h"

#include "daemon/services/trainer_events.h"
#include "proto/limits.h"

fsdp_dataplane_rank_t fsdp_unit_ops_rank(const fsdp_session_t *s) {
  return (fsdp_dataplane_rank_t){.local_rank = s->local_rank, .session_id = s->id,
                                 .serial = s->serial, .generation = s->generation};
}

uint64_t fsdp_unit_ops_deadline(const fsdp_services_context_t *ctx) {
  return uv_now(ctx->loop) +
         (uint64_t)fsdp_config_number(ctx->config, FSDP_OPTION_COLLECTIVE_TIMEOUT);
}

int fsdp_unit_ops_order_after_trainer(fsdp_session_t *s, uint32_t event, fsdp_status_t *st) {
  return fsdp_trainer_events_wait(s->cuda_events, event, st);
}

int fsdp_unit_ops_check_unit(const fsdp_session_t *s, const fsdp_unit_t *unit, const char *name,
                             fsdp_status_t *st) {
  if (unit && fsdp_store_unit_registered_by(unit, s->local_rank))
    return 0;
  return fsdp_status_set(st, unit ? FSDP_E_FAILED_PRECONDITION : FSDP_E_NOT_FOUND,
                         "unit '%s' is not registered by job '%s' local rank %u", name, s->job,
                         s->local_rank);
}

int fsdp_unit_ops_check_reduce(const fsdp_unit_t *unit, bool all_reduce, fsdp_status_t *st) {
  bool no_shard = unit->spec->strategy == FSDP_UNIT_NO_SHARD;
  if (no_shard == all_reduce)
    return 0;
  return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION, "unit '%s' is %s: use %s",
                         unit->spec->unit, no_shard ? "NO_SHARD" : "sharded",
                         no_shard ? "AllReduce" : "ReduceScatter");
}

int fsdp_unit_ops_check_step(const fsdp_job_t *job, const fsdp_unit_t *unit, uint64_t step,
                             fsdp_status_t *st) {
  const fsdp_job_flight_t *jf = job->flight;
  uint64_t last = jf->last_step > jf->resume_step ? jf->last_step : jf->resume_step;
  if (step <= last || step - last <= FSDP_STEP_AHEAD_MAX)
    return 0;
  return fsdp_status_set(st, FSDP_E_OUT_OF_RANGE,
                         "unit '%s': field 'step' = %llu is outside [0, %llu]: job '%s' is at "
                         "step %llu, and an operation may name at most %d steps past it",
                         unit->spec->unit, (unsigned long long)step,
                         (unsigned long long)(last + FSDP_STEP_AHEAD_MAX), job->name,
                         (unsigned long long)last, FSDP_STEP_AHEAD_MAX);
}
