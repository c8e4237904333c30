/* The data plane's connections to the other hosts' daemons: one UCX worker (transport/ucx.h)
 * on the loop, and one UCX peer per joined host.
 *
 * The worker's address travels in Peer.Join (daemon/cluster/peers.h). When a peer joins (again, or
 * with a new address), it is connected; when it is lost, its connection is failed at once,
 * which ends every transfer with it (the collectives waiting on them name the host), and
 * fsdp_fabric_peer() answers NULL with the reason until it joins again. A connection that
 * failed while the peer stays joined (a collective gave up on it) is made again on the next
 * fsdp_fabric_peer().
 *
 * On one host there is no fabric (fsdp_fabric_new gives NULL and starts nothing).
 * Loop thread only. */
#ifndef FSDP_FABRIC_H
#define FSDP_FABRIC_H

#include <uv.h>

#include "common/status.h"
#include "daemon/cluster/peers.h"
#include "transport/ucx.h"

typedef struct fsdp_fabric fsdp_fabric_t;

/* Starts the worker and hands its address and the join/loss callbacks to peers (which must
 * outlive the fabric's close). *ret_fabric is NULL on one host. */
int fsdp_fabric_new(uv_loop_t *loop, fsdp_peers_t *peers, fsdp_fabric_t **ret_fabric,
                    fsdp_status_t *st);

fsdp_ucx_t *fsdp_fabric_ucx(const fsdp_fabric_t *fabric);

/* The connection to a host, or NULL (host_rank is this host, or not connected: *ret_why, if
 * not NULL, says why). */
fsdp_ucx_peer_t *fsdp_fabric_peer(fsdp_fabric_t *fabric, unsigned host_rank,
                                  const char **ret_why);

/* The registration of [addr, addr + len) with the worker (fsdp_ucx_mem_register), made on
 * first use and kept until fsdp_fabric_forget_memory() or the close; NULL when UCX refused
 * it (logged once; transfers then go without) or the fabric is closing. */
const fsdp_ucx_mem_t *fsdp_fabric_memory(fsdp_fabric_t *fabric, void *addr, size_t len);

/* Releases every registration that starts in [addr, addr + len), before that memory goes.
 * NULL fabric, or one closing: no-op (the registrations go with the transport). No transfer
 * may still be using them. */
void fsdp_fabric_forget_memory(fsdp_fabric_t *fabric, const void *addr, size_t len);

/* Fails every transfer (their collectives end CANCELLED), closes the worker and frees the
 * fabric; done(data) runs on the loop afterwards, never inside the call. */
void fsdp_fabric_close(fsdp_fabric_t *fabric, void (*done)(void *data), void *data);

#endif
