/* The fsdp.v1.Peer service (Join, Heartbeat, Leave) served on the peer endpoint, and the
 * peers' rows of Operator.Status. The handlers hand the request to the peer table
 * (daemon/cluster/peers.h), which checks it; a Join may be answered later. Loop thread only. */
#ifndef FSDP_PEER_SERVICE_H
#define FSDP_PEER_SERVICE_H

#include "fsdp/v1/operator.pb-c.h"

#include "daemon/services/context.h"

/* The Peer service's table, bound to ctx. */
fsdp_rpc_service_t fsdp_peer_service(fsdp_services_context_t *ctx);

/* Storage for the peers part of one Status reply; freed with fsdp_peer_status_free. */
typedef struct fsdp_peer_status fsdp_peer_status_t;

/* Fills topology's cluster fields and reply->peers from the peer table. -ENOMEM on failure;
 * *ret_storage must be freed whatever the result. */
int fsdp_peer_status_fill(fsdp_services_context_t *ctx, Fsdp__V1__Topology *topology,
                          Fsdp__V1__StatusReply *reply, fsdp_peer_status_t **ret_storage);
void fsdp_peer_status_free(fsdp_peer_status_t *storage);

#endif
