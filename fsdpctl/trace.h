/* A job's flight recorder (Operator.Trace) as Chrome's trace-event JSON, which Perfetto and
 * chrome://tracing open: one process for the job, a track for each local rank's gathers and
 * one for its reduces, and one for the daemon's work. Each operation is a complete event
 * ("ph": "X") from its start (the collective's, every rank there) to its end, preceded by
 * its wait from its arrival when it waited; its args hold the step, the bytes and the
 * status. Times in microseconds from the first record. */
#ifndef FSDPCTL_TRACE_H
#define FSDPCTL_TRACE_H

#include "common/status.h"
#include "fsdp/v1/operator.pb-c.h"

/* Writes the reply's records to `out`, as fsdpctl/out_file.h writes a file (a link there is
 * replaced, never written through); st names the file on failure. */
int fsdpctl_write_trace(const Fsdp__V1__TraceReply *reply, const char *out, fsdp_status_t *st);

#endif
