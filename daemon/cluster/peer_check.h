/* The checks every message from a peer passes before it may touch the peer table: a Join,
 * a Heartbeat and a Leave as the Peer service receives them, and the replies to this
 * daemon's own Join and Heartbeat. They need nothing but the rules (the cluster's shape and
 * the settings that must agree), change nothing and do no I/O, so that the fuzz harness
 * (tests/fuzz/fuzz_peer.c) drives exactly what the daemon runs. What only UCX can check, the
 * packed worker address behind this format's header, is checked out of process
 * (address_check.h) after these.
 *
 * Each returns 0, or a negative code with st naming the field, its value and what was
 * expected: INVALID_ARGUMENT for a malformed message, FAILED_PRECONDITION for another
 * protocol version or settings that differ. Any thread. */
#ifndef FSDP_PEER_CHECK_H
#define FSDP_PEER_CHECK_H

#include <stddef.h>

#include "fsdp/v1/peer.pb-c.h"
#include "common/status.h"

/* Longest Leave reason taken (it goes into logs and status). */
#define FSDP_PEER_REASON_MAX 256

typedef struct fsdp_peer_rules {
  unsigned n_hosts; /* >= 1 */
  unsigned self;    /* this daemon's host rank */
  /* This host's settings that every Join must carry with the same values (borrowed). */
  const Fsdp__V1__Setting *settings;
  size_t n_settings;
} fsdp_peer_rules_t;

/* A peer's Join: protocol version, host rank (a peer's, not ours), nonzero incarnation,
 * the framing of its data-plane address (when it sends one), and exactly our settings. */
int fsdp_peer_check_join(const fsdp_peer_rules_t *rules, const Fsdp__V1__JoinRequest *rq,
                         fsdp_status_t *st);
/* The reply to our Join sent to host_rank at address (its cluster.hosts entry). */
int fsdp_peer_check_join_reply(const fsdp_peer_rules_t *rules, unsigned host_rank,
                               const char *address, const Fsdp__V1__JoinReply *reply,
                               fsdp_status_t *st);
int fsdp_peer_check_heartbeat(const fsdp_peer_rules_t *rules,
                              const Fsdp__V1__HeartbeatRequest *rq, fsdp_status_t *st);
int fsdp_peer_check_heartbeat_reply(const fsdp_peer_rules_t *rules, unsigned host_rank,
                                    const Fsdp__V1__HeartbeatReply *reply, fsdp_status_t *st);
int fsdp_peer_check_leave(const fsdp_peer_rules_t *rules, const Fsdp__V1__LeaveRequest *rq,
                          fsdp_status_t *st);
/* A Recover: a peer's host rank, a nonzero incarnation, a job name, and for a fetch the
 * bytes and units it names (names of units, at most FSDP_UNIT_NAME_MAX bytes). */
int fsdp_peer_check_recover(const fsdp_peer_rules_t *rules, const Fsdp__V1__RecoverRequest *rq,
                            fsdp_status_t *st);

#endif
