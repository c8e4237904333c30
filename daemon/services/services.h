/* Handler tables of the fsdp.v1 services (Trainer, Operator; Peer comes from
 * peer_service.h) in this release.
 *
 * Operator.Status and Operator.ReloadConfig are served here. Trainer.Attach (and Peer.Join)
 * check the protocol version first (a mismatch gets FAILED_PRECONDITION naming both
 * versions); methods without a handler answer UNIMPLEMENTED through the RPC adapter.
 * Loop thread only. */
#ifndef FSDP_SERVICES_H
#define FSDP_SERVICES_H

#include "daemon/daemon.h"

/* Fills daemon->services, each bound to daemon. */
void fsdp_services_init(fsdp_daemon_t *daemon);

/* The memory channel's callbacks (daemon/session/channel.h), bound to daemon. */
void fsdp_services_channel_callbacks(fsdp_daemon_t *daemon, fsdp_channel_callbacks_t *ret);

#endif
