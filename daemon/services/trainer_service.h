/* The fsdp.v1.Trainer service: sessions (Attach, Detach, KeepAlive), units and their
 * operations (RegisterUnit, Unshard, Reshard, ReduceScatter, AllReduce), and a job's
 * schedule and optimizer. Calls that wait in the data plane are parked and answered from its
 * callbacks; the fast path (daemon/services/fastpath.h) serves the same operations with the
 * same checks. Loop thread only. */
#ifndef FSDP_TRAINER_SERVICE_H
#define FSDP_TRAINER_SERVICE_H

#include "daemon/services/context.h"

/* The Trainer service's table, bound to ctx. */
fsdp_rpc_service_t fsdp_trainer_service(fsdp_services_context_t *ctx);

#endif
