/* What the Trainer handlers and the fast path (daemon/services/fastpath.h) both check and
 * hand the data plane for a unit operation, so that both paths mean the same and say the
 * same. Loop thread only. */
#ifndef FSDP_SERVICES_UNIT_OPS_H
#define FSDP_SERVICES_UNIT_OPS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "daemon/dataplane/dataplane.h"
#include "daemon/services/context.h"
#include "daemon/session/sessions.h"
#include "daemon/store/store.h"

/* The session's rank as the data plane knows it. */
fsdp_dataplane_rank_t fsdp_unit_ops_rank(const fsdp_session_t *s);

/* When every local rank must have joined a collective that an operation starts now. */
uint64_t fsdp_unit_ops_deadline(const fsdp_services_context_t *ctx);

/* The daemon's device work from now on follows the trainer's before its request: the
 * request's `event` (UnitOpRequest.event), waited on by the backend's streams
 * (daemon/services/trainer_events.h). INVALID_ARGUMENT naming the field and the value when
 * the session has no such event. */
int fsdp_unit_ops_order_after_trainer(fsdp_session_t *s, uint32_t event, fsdp_status_t *st);

/* Whether unit (NULL: no such unit, `name` saying which was asked for) is registered by the
 * session's rank; else FAILED_PRECONDITION or NOT_FOUND, naming it, the job and the rank. */
int fsdp_unit_ops_check_unit(const fsdp_session_t *s, const fsdp_unit_t *unit, const char *name,
                             fsdp_status_t *st);

/* Whether an Unshard, ReduceScatter or AllReduce may name `step` of the unit: at most
 * FSDP_STEP_AHEAD_MAX past its job's last step (job->last_step, or the step it resumed
 * from); else OUT_OF_RANGE naming the unit, the field, the value and the range. */
int fsdp_unit_ops_check_step(const fsdp_job_t *job, const fsdp_unit_t *unit, uint64_t step,
                             fsdp_status_t *st);

/* Whether method (ReduceScatter: all_reduce false; AllReduce: true) suits the unit's
 * strategy: NO_SHARD units all-reduce, the others reduce-scatter. */
int fsdp_unit_ops_check_reduce(const fsdp_unit_t *unit, bool all_reduce, fsdp_status_t *st);

#endif
