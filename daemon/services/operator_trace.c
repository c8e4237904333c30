/* Operator.Trace: a job's flight recorder (daemon/dataplane/dataplane.h), oldest first, for
 * fsdpctl trace; and the same record written to a file when a collective times out, which
 * fsdpctl record reads. */
#include "daemon/services/operator_internal.h"
#include "daemon/services/operator_service.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/services/calls.h"
#include "daemon/services/context.h"
#include "common/clock.h"
#include "common/io.h"
#include "proto/limits.h"
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

/* The job's records of its last `steps` steps (0: all) as a TraceReply in *reply, its
 * storage in *t (trace_free); RESOURCE_EXHAUSTED without memory. */
static int build_trace(const fsdp_job_t *job, uint64_t steps, trace_reply_t *t,
                       Fsdp__V1__TraceReply *reply, fsdp_status_t *st) {
  const fsdp_recorder_t *r = &job->flight->recorder;
  *t = (trace_reply_t){.job = job};
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (u->id + 1u > t->n_units)
      t->n_units = u->id + 1u;
  size_t held = r->total < r->capacity ? (size_t)r->total : r->capacity;
  t->unit_names = calloc(t->n_units ? t->n_units : 1, sizeof *t->unit_names);
  t->records = calloc(held ? held : 1, sizeof *t->records);
  t->record_ptrs = calloc(held ? held : 1, sizeof *t->record_ptrs);
  if (!t->unit_names || !t->records || !t->record_ptrs)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for job '%s''s trace",
                           job->name);
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    t->unit_names[u->id] = u->spec->unit;
  if (steps) {
    uint64_t newest = 0;
    fsdp_dataplane_each_record(job, newest_step, &newest);
    t->min_step = newest >= steps ? newest - steps + 1 : 0;
  }
  fsdp_dataplane_each_record(job, add_record, t);
  fsdp__v1__trace_reply__init(reply);
  reply->job = (char *)job->name;
  reply->n_records = t->n;
  reply->records = t->record_ptrs;
  reply->recorded = r->total;
  reply->now_ns = fsdp_clock_now_ns();
  return 0;
}

static void trace_free(trace_reply_t *t) {
  free(t->unit_names);
  free(t->records);
  free(t->record_ptrs);
}

const fsdp_job_t *fsdp_operator_job(fsdp_rpc_call_t *call, const fsdp_store_t *store,
                                    const char *name) {
  const fsdp_job_t *job = fsdp_store_find_job(store, name);
  if (!job)
    fsdp_rpc_call_fail(call, FSDP_E_NOT_FOUND, "field 'job': no job '%s' in this daemon", name);
  return job;
}

void fsdp_operator_trace(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  const Fsdp__V1__TraceRequest *rq = (const void *)request;
  fsdp_services_context_t *ctx = data;
  const fsdp_job_t *job = fsdp_operator_job(call, ctx->store, rq->job);
  if (!job)
    return;
  if (!job->flight->recorder.capacity) {
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION,
                       "job '%s' has no flight recorder: trace.ops was 0 when it began",
                       job->name);
    return;
  }
  trace_reply_t t;
  Fsdp__V1__TraceReply reply;
  fsdp_status_t st;
  if (build_trace(job, rq->steps, &t, &reply, &st) < 0)
    fsdp_services_fail_call(call, &st);
  else
    fsdp_rpc_call_reply(call, &reply.base);
  trace_free(&t);
}

int fsdp_operator_write_record(const fsdp_job_t *job, int dir_fd, const char *dir, char *path,
                               size_t size, fsdp_status_t *st) {
  if (!job->flight->recorder.capacity)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION, "trace.ops was 0 when it began");
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  char name[FSDP_JOB_NAME_MAX + 64];
  snprintf(name, sizeof name, "%s.%lld%03ld.record", job->name, (long long)now.tv_sec,
           now.tv_nsec / 1000000);
  snprintf(path, size, "%s/%s", dir, name);
  trace_reply_t t;
  Fsdp__V1__TraceReply reply;
  int r = build_trace(job, 0, &t, &reply, st);
  uint8_t *bytes = r < 0 ? NULL : malloc(fsdp__v1__trace_reply__get_packed_size(&reply) + 1);
  if (r == 0 && !bytes)
    r = fsdp_status_set(st, -ENOMEM, "out of memory for job '%s''s record", job->name);
  if (r == 0) {
    size_t n = fsdp__v1__trace_reply__pack(&reply, bytes);
    /* A name of its own in the daemon's directory, never a file or link already there. */
    int fd = openat(dir_fd, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0640);
    if (fd < 0) {
      r = fsdp_status_set(st, -errno, "%s: %s", path, strerror(errno));
    } else {
      int w = fsdp_write_all(fd, bytes, n);
      if (w < 0)
        r = fsdp_status_set(st, w, "%s: %s", path, strerror(-w));
      if (close(fd) < 0 && r == 0)
        r = fsdp_status_set(st, -errno, "%s: %s", path, strerror(errno));
      if (r < 0)
        unlinkat(dir_fd, name, 0);
    }
  }
  free(bytes);
  trace_free(&t);
  return r;
}
