/* The peer table: the other hosts' daemons (cluster.hosts), and the client side of the Peer
 * control plane that joins them, heartbeats them and tells the rest of the daemon when one
 * joins or is lost.
 *
 * Every daemon joins every other one (Peer.Join, retried with backoff), and accepts their
 * Joins (fsdp_peers_accept_join, called by the Peer service); a peer is JOINED once it has
 * joined us and we have joined it, and the cluster is ready once every peer is JOINED. A
 * Join carries the protocol version, the host rank, a random incarnation per start (so a
 * restarted daemon is told from the one before), the settings that must agree on every host
 * (a difference is refused naming the key and both values) and the data plane's (UCX)
 * worker address. Joined peers get a Heartbeat every peer.heartbeat_interval; one that
 * answers nothing for peer.timeout is LOST. A graceful stop sends Leave, and the others mark
 * it LEFT at once. A lost, left or restarted peer is joined again when it answers. What each
 * message means for a relationship, and what to send next, the membership state machine
 * decides (membership.h); this module does the calls, the checks and the clock around it.
 * Its files, one concern each, share the table through peers_internal.h: peer_table.c (the
 * table's life and clock), peer_client.c (our calls), peer_accept.c (the others' calls and
 * the address checks), peer_waiters.c (waiting for the cluster).
 *
 * Threads: everything here runs on the loop thread, callbacks included. The client calls
 * complete on a completion queue of this module's own, which daemon/rpc/cq_bridge.h drains
 * onto the loop; nothing here blocks the loop.
 *
 * Lifetime: fsdp_peers_new at start (one host: no thread, no channel, always ready),
 * fsdp_peers_leave when a stop begins, fsdp_peers_close to end it (async; the done callback
 * runs once every call, thread and handle is gone), then fsdp_peers_free. */
#ifndef FSDP_PEERS_H
#define FSDP_PEERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "config/config.h"
#include "daemon/cluster/membership.h"
#include "daemon/cluster/peer_security.h"
#include "fsdp/v1/peer.pb-c.h"
#include "common/status.h"

typedef struct fsdp_peers fsdp_peers_t;

/* A peer as the status shows it; pointers borrowed until the loop runs again. */
typedef struct fsdp_peer_info {
  unsigned host_rank;
  const char *address; /* its entry in cluster.hosts */
  fsdp_peer_state_t state;
  int64_t last_heard_ms; /* since it last answered or called; -1: never */
  uint64_t rtt_us;       /* the latest Heartbeat's round trip; 0: none yet */
  uint64_t incarnation;  /* 0: unknown */
  const char *last_error;
  const uint8_t *ucx_address; /* its data-plane address as it joined; NULL if none */
  size_t ucx_address_len;
} fsdp_peer_info_t;

/* What the data plane hears. joined: the peer is JOINED (again, or its address changed);
 * ucx_address is borrowed for the call. lost: a peer that was JOINED no longer is (no answer
 * for peer.timeout, it left, it restarted, or it no longer counts us as joined); `why` names
 * the host and the reason, ready to be the message of every waiter's UNAVAILABLE. */
typedef struct fsdp_peers_callbacks {
  void (*joined)(void *data, unsigned host_rank, uint64_t incarnation, const uint8_t *ucx_address,
                 size_t ucx_address_len);
  void (*lost)(void *data, unsigned host_rank, const char *why);
  void *data;
} fsdp_peers_callbacks_t;

/* Builds the table from cfg (cluster.*, peer.*); borrows sec (it must outlive the peers)
 * and callbacks (copied). Joining starts with fsdp_peers_start. */
int fsdp_peers_new(uv_loop_t *loop, const fsdp_config_t *cfg, const fsdp_peer_security_t *sec,
                   const fsdp_peers_callbacks_t *callbacks, fsdp_peers_t **ret_peers,
                   fsdp_status_t *st);
int fsdp_peers_start(fsdp_peers_t *peers);
/* Replaces the callbacks (copied), e.g. once the data plane is up. */
void fsdp_peers_set_callbacks(fsdp_peers_t *peers, const fsdp_peers_callbacks_t *callbacks);
/* New heartbeat interval and timeout (reload). */
void fsdp_peers_set_timing(fsdp_peers_t *peers, uint64_t heartbeat_interval_ms,
                           uint64_t timeout_ms);
/* The local data-plane address sent in every Join (copied); a change re-sends Join to the
 * peers already joined. */
int fsdp_peers_set_local_address(fsdp_peers_t *peers, const void *bytes, size_t len);

/* Sends Leave to every peer we are joined with, and stops joining and heartbeating. */
void fsdp_peers_leave(fsdp_peers_t *peers, const char *why);
/* Ends every call (a Leave in flight may finish within its short deadline), then the thread
 * and handles; `done` runs on the loop afterwards, never inside the call. Ready waiters get
 * FSDP_E_CANCELLED. */
void fsdp_peers_close(fsdp_peers_t *peers, void (*done)(void *data), void *data);
/* Frees a table that was never started, or whose close has completed. NULL-safe. */
void fsdp_peers_free(fsdp_peers_t *peers);

/* Topology. */
unsigned fsdp_peers_host_rank(const fsdp_peers_t *peers);
unsigned fsdp_peers_host_count(const fsdp_peers_t *peers); /* >= 1 */
uint64_t fsdp_peers_incarnation(const fsdp_peers_t *peers);
/* Every peer is JOINED (always true on one host). */
bool fsdp_peers_ready(const fsdp_peers_t *peers);
/* Rows by host rank, this daemon's included (state SELF). */
void fsdp_peers_get(const fsdp_peers_t *peers, unsigned host_rank, fsdp_peer_info_t *ret_info);

/* Waiting for the cluster: cb runs once, with 0 when every peer is JOINED, FSDP_E_UNAVAILABLE
 * (why names the hosts missing and their last errors) when they are not all JOINED in time,
 * or FSDP_E_CANCELLED when the daemon stops. In time: until peer.join_timeout after start
 * while the cluster forms; once it had been ready, peer.timeout from the call (a host lost
 * or left is back within that, or whoever needs it fails). If that is already decided, cb
 * runs before fsdp_peers_when_ready returns. The waiter is caller-owned storage that must
 * stay valid until cb has run or fsdp_peers_wait_cancel. */
typedef void (*fsdp_peers_ready_fn)(void *data, int status, const char *why);
typedef struct fsdp_peers_waiter {
  fsdp_peers_ready_fn cb;
  void *data;
  uint64_t deadline_ms; /* loop time; 0: the join deadline */
  struct fsdp_peers_waiter *next;
} fsdp_peers_waiter_t;

void fsdp_peers_when_ready(fsdp_peers_t *peers, fsdp_peers_waiter_t *waiter,
                           fsdp_peers_ready_fn cb, void *data);
void fsdp_peers_wait_cancel(fsdp_peers_t *peers, fsdp_peers_waiter_t *waiter);

/* Peer.Recover, in plain values (daemon/checkpoints/replicas.c asks and answers it; the
 * Peer service decodes it): a host that started empty asks a replica of its shards where a
 * job stands (units NULL), or to send the job's state (the units as the asking host holds
 * them, the step it goes on after, and the bytes it takes). */
typedef struct fsdp_peers_recover_unit {
  const char *name;
  uint64_t numel, shard_numel;
  uint32_t host_first_shard, host_shards, optimizer_arrays;
} fsdp_peers_recover_unit_t;

typedef struct fsdp_peers_recover {
  unsigned host;        /* the asking host's rank */
  uint64_t incarnation; /* the asking daemon's */
  const char *job;
  uint64_t uid;
  bool fetch;
  uint64_t step, bytes;
  const fsdp_peers_recover_unit_t *units;
  size_t n_units;
} fsdp_peers_recover_t;

/* What a replica answers: the job's last completed step (0: none trained), and for a
 * fetch the bytes sent and their XXH64 (seed 0). */
typedef struct fsdp_peers_recovered {
  uint64_t step, bytes, xxh64;
} fsdp_peers_recovered_t;

/* Sends ask (its host and incarnation: this daemon's, whatever it says) to host_rank with
 * the table's token and credentials and a deadline of deadline_ms. done runs once, on the loop, never
 * inside this call: with st NULL and the answer, or with st naming the host and the status
 * (CANCELLED when the daemon stops). Returns 0, or an error (done never runs): a host that
 * is not a peer, a daemon stopping, a call gRPC would not start. */
typedef void (*fsdp_peers_recover_fn)(void *data, const fsdp_status_t *st,
                                      const fsdp_peers_recovered_t *answer);
int fsdp_peers_recover(fsdp_peers_t *peers, unsigned host_rank, const fsdp_peers_recover_t *ask,
                       uint64_t deadline_ms, fsdp_peers_recover_fn done, void *data,
                       fsdp_status_t *st);

/* Server side, for the Peer service (daemon/services/peer_service.c). Every message first passes
 * daemon/cluster/peer_check.h (a refusal names the field and value), and an invalid one changes no
 * state of a relationship. `from` is the caller's address ("ipv4:10.0.0.2:41234"), for
 * messages.
 *
 * A Join may take time to answer: a data-plane address not yet checked is unpacked by UCX
 * in a process of its own first (address_check.h; one it refuses gets INVALID_ARGUMENT
 * naming the field), and a Join that would change the incarnation or address of a live
 * relationship is accepted only when the host's own cluster.hosts entry confirms it (its
 * reply to a Join sent there carries both); otherwise ALREADY_EXISTS names the host, the
 * live incarnation and where the Join came from. cb runs once with st NULL and the reply
 * (borrowed for the call), or with the refusal; before fsdp_peers_accept_join returns, which
 * then gives NULL, or later, when it gives a handle for fsdp_peers_join_cancel (after which
 * cb never runs; the checks it started go on, and their outcome is kept). */
typedef struct fsdp_peers_join fsdp_peers_join_t;
typedef void (*fsdp_peers_join_fn)(void *data, const fsdp_status_t *st,
                                   const Fsdp__V1__JoinReply *reply);
fsdp_peers_join_t *fsdp_peers_accept_join(fsdp_peers_t *peers, const Fsdp__V1__JoinRequest *rq,
                                          const char *from, fsdp_peers_join_fn cb, void *data);
void fsdp_peers_join_cancel(fsdp_peers_join_t *join);
/* FAILED_PRECONDITION for a Heartbeat from a host that has not joined (at that incarnation). */
int fsdp_peers_accept_heartbeat(fsdp_peers_t *peers, const Fsdp__V1__HeartbeatRequest *rq,
                                Fsdp__V1__HeartbeatReply *reply, fsdp_status_t *st);
int fsdp_peers_accept_leave(fsdp_peers_t *peers, const Fsdp__V1__LeaveRequest *rq,
                            fsdp_status_t *st);
/* A Recover (fsdp_peer_check_recover's checks) into *ret_ask, whose strings and units point
 * into rq and *ret_units (the caller frees it). One that fetches must come from the daemon
 * this one has joined at the host rank it names (FAILED_PRECONDITION when that host is not
 * JOINED at that incarnation): what is sent goes to that daemon's data-plane address only. */
int fsdp_peers_accept_recover(fsdp_peers_t *peers, const Fsdp__V1__RecoverRequest *rq,
                              fsdp_peers_recover_t *ret_ask,
                              fsdp_peers_recover_unit_t **ret_units, fsdp_status_t *st);
/* Whether host is JOINED at incarnation now: what a replica checks again before it sends. */
bool fsdp_peers_joined_as(const fsdp_peers_t *peers, unsigned host, uint64_t incarnation);

#endif
