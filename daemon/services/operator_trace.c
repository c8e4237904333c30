/* Operator.Trace: a job's flight recorder (daemon/dataplane/dataplane.h), oldest first, for
 * fsdpctl trace. */
#include "daemon/services/operator_internal.h"

#include <stdlib.h>
#include <string.h>

#include "daemon/services/calls.h"
#include "daemon/services/context.h"
#include "common/clock.h"
#include "proto/wire.h"
#include "fsdp/v1/operator.pb-c.h"

typedef struct trace_reply {
  const fsdp_job_t *job;
  const char **unit_names; /* by unit id */
  size_t n_units;
  uint64_t min_step; /* records of older steps are left out */
  Fsdp__V1__OpRecord *records;
  Fsdp__V1__OpRecord **record_ptrs;
  size_t n;
} trace_reply_t;

static void newest_step(void *data, const fsdp_op_record_t *r) {
  uint64_t *newest = data;
  if (r->step > *newest)
    *newest = r->step;
}

void fsdp_operator_op_record(const fsdp_op_record_t *r, const char *unit,
                             Fsdp__V1__OpRecord *out) {
  fsdp__v1__op_record__init(out);
  out->kind = (Fsdp__V1__OpRecord__Kind)r->kind;
  out->unit = (char *)unit;
  out->step = r->step;
  out->rank = r->rank;
  out->work = (char *)(r->kind == FSDP_RECORD_WORK ? fsdp_dataplane_work_name(r->work) : "");
  out->submit_ns = r->submit_ns;
  out->start_ns = r->start_ns;
  out->end_ns = r->end_ns;
  out->bytes = r->bytes;
  out->code = (char *)fsdp_wire_status_name(fsdp_wire_status_from_error(r->code));
}

static void add_record(void *data, const fsdp_op_record_t *r) {
  trace_reply_t *t = data;
  if (r->step < t->min_step) /* a unit's preparation has no step: before them all */
    return;
  const char *unit = r->unit_id < t->n_units && t->unit_names[r->unit_id]
                         ? t->unit_names[r->unit_id] : "";
  fsdp_operator_op_record(r, unit, &t->records[t->n]);
  t->record_ptrs[t->n] = &t->records[t->n];
  t->n++;
}

void fsdp_operator_trace(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  const Fsdp__V1__TraceRequest *rq = (const void *)request;
  fsdp_services_context_t *ctx = data;
  const fsdp_job_t *job = fsdp_store_find_job(ctx->store, rq->job);
  if (!job) {
    fsdp_rpc_call_fail(call, FSDP_E_NOT_FOUND, "field 'job': no job '%s' in this daemon",
                       rq->job);
    return;
  }
  const fsdp_recorder_t *r = &job->flight->recorder;
  if (!r->capacity) {
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION,
                       "job '%s' has no flight recorder: trace.ops was 0 when it began",
                       job->name);
    return;
  }
  trace_reply_t t = {.job = job};
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (u->id + 1u > t.n_units)
      t.n_units = u->id + 1u;
  size_t held = r->total < r->capacity ? (size_t)r->total : r->capacity;
  t.unit_names = calloc(t.n_units ? t.n_units : 1, sizeof *t.unit_names);
  t.records = calloc(held ? held : 1, sizeof *t.records);
  t.record_ptrs = calloc(held ? held : 1, sizeof *t.record_ptrs);
  if (!t.unit_names || !t.records || !t.record_ptrs) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for job '%s''s trace",
                       job->name);
    goto out;
  }
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    t.unit_names[u->id] = u->spec->unit;
  if (rq->steps) {
    uint64_t newest = 0;
    fsdp_dataplane_each_record(job, newest_step, &newest);
    t.min_step = newest >= rq->steps ? newest - rq->steps + 1 : 0;
  }
  fsdp_dataplane_each_record(job, add_record, &t);
  Fsdp__V1__TraceReply reply = FSDP__V1__TRACE_REPLY__INIT;
  reply.job = (char *)job->name;
  reply.n_records = t.n;
  reply.records = t.record_ptrs;
  reply.recorded = r->total;
  reply.now_ns = fsdp_clock_now_ns();
  fsdp_rpc_call_reply(call, &reply.base);
out:
  free(t.unit_names);
  free(t.records);
  free(t.record_ptrs);
}
