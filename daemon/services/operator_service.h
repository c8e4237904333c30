/* The fsdp.v1.Operator service: the daemon's state and its units as operators read them
 * (Status, ListUnits, DescribeUnit), and what changes the daemon (ReloadConfig, Drain,
 * Resume, Save and LoadCheckpoint), which only its operators may call, or a trainer of the
 * job for a checkpoint. Loop thread only. */
#ifndef FSDP_OPERATOR_SERVICE_H
#define FSDP_OPERATOR_SERVICE_H

#include "daemon/services/context.h"

/* The Operator service's table, bound to ctx. */
fsdp_rpc_service_t fsdp_operator_service(fsdp_services_context_t *ctx);

#endif
