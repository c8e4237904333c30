/* The flight recorder: each job's last trace.ops operations, a rank's or the daemon's work's
 * (fsdp_op_record_t), kept in a ring the job owns, for fsdpctl trace. A record is a struct
 * copied into place on the loop: the cost the bench shows. */
#include "daemon/dataplane/internal.h"

#include <stdlib.h>

#include "common/clock.h"
#include "common/log.h"

void dp_recorder_make(const fsdp_dataplane_t *dp, fsdp_job_t *job) {
  fsdp_recorder_t *r = &job->flight->recorder;
  if (r->records || !dp->trace_ops)
    return;
  r->records = calloc(dp->trace_ops, sizeof *r->records);
  if (!r->records)
    log_warning("job '%s': no memory for its flight recorder (trace.ops = %u): it records "
                "nothing", job->name, dp->trace_ops);
  r->capacity = r->records ? dp->trace_ops : 0;
}

static void add(fsdp_job_t *job, const fsdp_op_record_t *record) {
  fsdp_recorder_t *r = &job->flight->recorder;
  if (!r->capacity)
    return;
  r->records[r->total % r->capacity] = *record;
  r->total++;
}

static uint64_t param_bytes(const fsdp_unit_t *u) {
  return u->layout.numel * fsdp_dtype_size(param_dtype(u));
}

void dp_record_op(const fsdp_dataplane_op_t *op, int code) {
  if (op->kind != WAIT_UNSHARD && op->kind != WAIT_REDUCE)
    return;
  const fsdp_unit_t *u = op->unit;
  bool gather = op->kind == WAIT_UNSHARD;
  uint64_t started = gather ? u->flight->gather_started_ns : u->flight->reduce_started_ns;
  /* The collective it joined began after it came; one that began before served it at once
   * (the copy it held), and one that failed before beginning never started. */
  uint64_t start = started >= op->submit_ns ? started : code < 0 ? 0 : op->submit_ns;
  fsdp_op_record_t record = {
      .submit_ns = op->submit_ns, .start_ns = start, .end_ns = fsdp_clock_now_ns(),
      .step = op->step, .bytes = param_bytes(u), .unit_id = u->id, .code = code,
      .rank = (uint16_t)op->who.local_rank,
      .kind = gather ? FSDP_RECORD_GATHER : FSDP_RECORD_REDUCE};
  add(u->job, &record);
}

void dp_record_work(const fsdp_dataplane_work_t *w, int code) {
  const fsdp_unit_t *u = w->unit;
  bool gather = w->kind == WORK_GATHER || w->kind == WORK_UNSTAGE_GATHER;
  fsdp_op_record_t record = {
      .submit_ns = w->queued_ns, .start_ns = w->start_ns, .end_ns = w->start_ns + w->run_ns,
      .step = w->kind == WORK_PREFAULT ? 0 : gather ? u->flight->gather.step : u->flight->reduce.step,
      .unit_id = u->id, .code = code, .kind = FSDP_RECORD_WORK, .work = (uint8_t)w->kind};
  add(w->job, &record);
}

void fsdp_dataplane_each_record(const fsdp_job_t *job,
                                void (*fn)(void *data, const fsdp_op_record_t *record),
                                void *data) {
  const fsdp_recorder_t *r = &job->flight->recorder;
  uint64_t first = r->total > r->capacity ? r->total - r->capacity : 0;
  for (uint64_t i = first; i < r->total; i++)
    fn(data, &r->records[i % r->capacity]);
}
