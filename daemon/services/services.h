/* Handler tables of the fsdp.v1 services in this release (Trainer from trainer_service.h,
 * Operator from operator_service.h, Peer from peer_service.h), and the memory channel's
 * callbacks.
 *
 * Trainer.Attach (and Peer.Join) check the protocol version first (a mismatch gets
 * FAILED_PRECONDITION naming both versions); methods without a handler answer UNIMPLEMENTED
 * through the RPC adapter. The handlers work on a context (daemon/services/context.h), not on
 * the daemon. Loop thread only. */
#ifndef FSDP_SERVICES_H
#define FSDP_SERVICES_H

#include "daemon/services/context.h"
#include "daemon/session/channel.h"

/* The service tables, each bound to ctx (borrowed: it must outlive the RPC server), with
 * `health` (daemon/services/health.h) at FSDP_SERVICE_HEALTH. */
void fsdp_services_tables(fsdp_services_context_t *ctx, const fsdp_rpc_service_t *health,
                          fsdp_rpc_service_t ret_services[FSDP_SERVICE_COUNT]);

/* The memory channel's callbacks (daemon/session/channel.h), bound to ctx. */
void fsdp_services_channel_callbacks(fsdp_services_context_t *ctx,
                                     fsdp_channel_callbacks_t *ret_callbacks);

#endif
