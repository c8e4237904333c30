/* The fsdp.v1.Operator service: the daemon's state and its units as operators read them
 * (Status, ListUnits, DescribeUnit), and what changes the daemon (ReloadConfig, Drain,
 * Resume, Save and LoadCheckpoint), which only its operators may call, or a trainer of the
 * job for a checkpoint; Trace and Why, and the record a timeout leaves. Loop thread only. */
#ifndef FSDP_OPERATOR_SERVICE_H
#define FSDP_OPERATOR_SERVICE_H

#include "daemon/services/context.h"

/* The Operator service's table, bound to ctx. */
fsdp_rpc_service_t fsdp_operator_service(fsdp_services_context_t *ctx);

/* Writes the job's flight recorder, as Operator.Trace gives it (a packed TraceReply), into
 * a file of a new name in the directory dir_fd (dir: its path, for messages), its path in
 * path: on a collective's timeout, for fsdpctl record. */
int fsdp_operator_write_record(const fsdp_job_t *job, int dir_fd, const char *dir, char *path,
                               size_t size, fsdp_status_t *st);

#endif
