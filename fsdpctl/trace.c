/* Chrome trace-event JSON of a job's flight recorder (trace.h). */
#include "fsdpctl/trace.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <json-c/json.h>

#include "common/io.h"
#include "fsdpctl/out_file.h"

/* Tracks: each rank's gathers (2r), its reduces (2r + 1); the daemon's work after them. */
#define WORK_TRACK 100000

static int track_of(const Fsdp__V1__OpRecord *r) {
  if (r->kind == FSDP__V1__OP_RECORD__KIND__WORK)
    return WORK_TRACK;
  return (int)r->rank * 2 + (r->kind == FSDP__V1__OP_RECORD__KIND__REDUCE);
}

static json_object *metadata(const char *what, int tid, const char *name) {
  json_object *e = json_object_new_object(), *args = json_object_new_object();
  json_object_object_add(e, "name", json_object_new_string(what));
  json_object_object_add(e, "ph", json_object_new_string("M"));
  json_object_object_add(e, "pid", json_object_new_int(1));
  json_object_object_add(e, "tid", json_object_new_int(tid));
  json_object_object_add(args, "name", json_object_new_string(name));
  json_object_object_add(e, "args", args);
  return e;
}

static json_object *slice(const char *name, int tid, uint64_t from_ns, uint64_t to_ns,
                          uint64_t origin_ns, json_object *args) {
  json_object *e = json_object_new_object();
  json_object_object_add(e, "name", json_object_new_string(name));
  json_object_object_add(e, "ph", json_object_new_string("X"));
  json_object_object_add(e, "pid", json_object_new_int(1));
  json_object_object_add(e, "tid", json_object_new_int(tid));
  json_object_object_add(e, "ts", json_object_new_double((double)(from_ns - origin_ns) / 1e3));
  json_object_object_add(e, "dur", json_object_new_double((double)(to_ns - from_ns) / 1e3));
  json_object_object_add(e, "args", args);
  return e;
}

static json_object *record_args(const Fsdp__V1__OpRecord *r) {
  json_object *args = json_object_new_object();
  json_object_object_add(args, "unit", json_object_new_string(r->unit));
  json_object_object_add(args, "step", json_object_new_uint64(r->step));
  json_object_object_add(args, "code", json_object_new_string(r->code));
  if (r->kind != FSDP__V1__OP_RECORD__KIND__WORK)
    json_object_object_add(args, "bytes", json_object_new_uint64(r->bytes));
  return args;
}

/* The events of one record: its wait (arrival to start) and its run (start to end). */
static void add_record(json_object *events, const Fsdp__V1__OpRecord *r, uint64_t origin) {
  char name[320];
  const char *what = r->kind == FSDP__V1__OP_RECORD__KIND__GATHER   ? "unshard"
                     : r->kind == FSDP__V1__OP_RECORD__KIND__REDUCE ? "reduce"
                                                                   : r->work;
  snprintf(name, sizeof name, "%s %s", what, r->unit);
  int tid = track_of(r);
  uint64_t start = r->start_ns ? r->start_ns : r->end_ns; /* never started: all wait */
  if (start > r->submit_ns) {
    char waiting[340];
    snprintf(waiting, sizeof waiting, "%s (waits)", name);
    json_object_array_add(events, slice(waiting, tid, r->submit_ns, start, origin,
                                        record_args(r)));
  }
  if (r->end_ns > start || r->start_ns)
    json_object_array_add(events, slice(name, tid, start, r->end_ns, origin, record_args(r)));
}

int fsdpctl_write_trace(const Fsdp__V1__TraceReply *reply, const char *out, fsdp_status_t *st) {
  uint64_t origin = UINT64_MAX;
  unsigned ranks = 0;
  for (size_t i = 0; i < reply->n_records; i++) {
    const Fsdp__V1__OpRecord *r = reply->records[i];
    if (r->submit_ns && r->submit_ns < origin)
      origin = r->submit_ns;
    if (r->kind != FSDP__V1__OP_RECORD__KIND__WORK && r->rank + 1 > ranks)
      ranks = r->rank + 1;
  }
  json_object *root = json_object_new_object(), *events = json_object_new_array();
  char name[320];
  snprintf(name, sizeof name, "fsdpd job %s", reply->job);
  json_object_array_add(events, metadata("process_name", 0, name));
  for (unsigned rank = 0; rank < ranks; rank++) {
    snprintf(name, sizeof name, "rank %u gathers", rank);
    json_object_array_add(events, metadata("thread_name", (int)rank * 2, name));
    snprintf(name, sizeof name, "rank %u reduces", rank);
    json_object_array_add(events, metadata("thread_name", (int)rank * 2 + 1, name));
  }
  json_object_array_add(events, metadata("thread_name", WORK_TRACK, "daemon work"));
  for (size_t i = 0; i < reply->n_records; i++)
    add_record(events, reply->records[i], origin == UINT64_MAX ? 0 : origin);
  json_object_object_add(root, "traceEvents", events);
  json_object_object_add(root, "displayTimeUnit", json_object_new_string("ms"));
  size_t len;
  const char *text = json_object_to_json_string_length(root, JSON_C_TO_STRING_PLAIN, &len);
  fsdpctl_out_file_t f;
  int r = text ? fsdpctl_out_file_open(&f, out, "trace", st)
               : fsdp_status_set(st, -ENOMEM, "trace: out of memory");
  if (r == 0) {
    int w = fsdp_write_all(f.fd, text, len);
    r = fsdpctl_out_file_end(&f, w < 0 ? fsdpctl_out_file_write_failed(&f, -w, st) : 0, st);
  }
  json_object_put(root);
  return r;
}
