/* The inside of the peer table (peers.h), shared by the files that make it up and by no
 * other: peer_table.c builds the table, starts and stops it and runs its clock;
 * peer_client.c makes this daemon's calls to the other hosts; peer_accept.c answers theirs;
 * peer_waiters.c tells whoever waits for the cluster that it is ready. The table is one
 * object, so its struct is here whole; each function below belongs to the file its group
 * names. Loop thread only. */
#ifndef FSDP_PEERS_INTERNAL_H
#define FSDP_PEERS_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/grpc.h>
#include <uv.h>

#include "common/status.h"
#include "daemon/cluster/address_check.h"
#include "daemon/cluster/membership.h"
#include "daemon/cluster/peer_check.h"
#include "daemon/cluster/peers.h"
#include "daemon/rpc/cq_bridge.h"

/* The settings that must agree on every host, sent in each Join. */
#define N_SETTINGS 4

/* A call in flight; peer_client.c's own. */
typedef struct pcall pcall_t;

typedef struct peer peer_t;

/* What the client keeps of a host beside its membership row. */
struct peer {
  fsdp_peers_t *owner;
  unsigned rank;
  const fsdp_member_t *m; /* its row in the membership */
  grpc_channel *channel;
  /* The last address that passed a check, and the one being checked (one at a time). */
  uint8_t *verified, *checking;
  size_t verified_len, checking_len;
  fsdp_address_check_t *check;
  /* The address of the reply to our Join, held while it is checked. */
  uint8_t *reply_ucx;
  size_t reply_ucx_len;
  fsdp_peers_join_t *pending; /* its Joins being checked */
  unsigned n_pending;
  uint64_t logged_impostor; /* the incarnation last refused as another daemon's */
};

struct fsdp_peers {
  uv_loop_t *loop;
  unsigned n, self;
  fsdp_membership_t *m;
  peer_t *peers; /* n of them; peers[self] is this daemon */
  uint64_t incarnation;
  uint64_t heartbeat_ms, timeout_ms, join_deadline_ms, address_check_ms;
  const fsdp_peer_security_t *sec;
  fsdp_peers_callbacks_t cb;
  char *auth_value; /* "Bearer <token>" */
  Fsdp__V1__Setting settings[N_SETTINGS];
  char setting_values[N_SETTINGS][4096];
  fsdp_peer_rules_t rules;
  unsigned checks; /* address checks not yet done */
  uint8_t *local_ucx;
  size_t local_ucx_len;

  /* formed: the cluster had been ready; from then on a waiter waits peer.timeout. */
  bool started, closing, formed, deadline_passed;
  fsdp_peers_waiter_t *waiters;

  fsdp_cq_bridge_t *bridge; /* the client's completion queue, drained onto the loop */
  bool grpc_initialized, channels_gone;
  pcall_t *inflight;
  uv_timer_t timer, deadline_timer;
  int open_handles;
  void (*done)(void *data);
  void *done_data;
};

static inline uint64_t now_ms(const fsdp_peers_t *peers) {
  return uv_now(peers->loop);
}

static inline bool leaving(const fsdp_peers_t *peers) {
  return fsdp_membership_leaving(peers->m);
}

/* --- peer_client.c: this daemon's calls to the other hosts --- */

/* The client of a table of more than one host: the token's header, gRPC, the completion
 * queue and a channel per peer. On failure st says why, and fsdp_peers_free frees what was
 * made. */
int fsdp_peers_client_open(fsdp_peers_t *peers, fsdp_status_t *st);
/* Frees what fsdp_peers_client_open made and the close left (channels, queue, gRPC). */
void fsdp_peers_client_free(fsdp_peers_t *peers);
/* The membership's actions: a Join or a Heartbeat to a host (data: the table). */
bool fsdp_peers_send_join(void *data, unsigned host_rank);
bool fsdp_peers_send_heartbeat(void *data, unsigned host_rank);
/* Sends Leave to every peer a relationship holds, with a short deadline; returns how many
 * went. */
unsigned fsdp_peers_send_leave(fsdp_peers_t *peers, const char *why);
/* Ends the Joins and Heartbeats in flight now; Leaves have their own short deadline. */
void fsdp_peers_cancel_calls(fsdp_peers_t *peers);
/* Our Join failed (refused: by the host, or its reply did not pass), with why in words. */
void fsdp_peers_join_failed(fsdp_peers_t *peers, peer_t *p, bool refused, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* --- peer_accept.c: the Joins, Heartbeats and Leaves of the other hosts --- */

/* An address nothing in UCX needs to unpack (none at all), or the one that last passed. */
bool fsdp_peers_address_verified(const peer_t *p, const uint8_t *bytes, size_t len);
/* Our Join's reply waits for its address's check; none could start. */
void fsdp_peers_check_reply_address(fsdp_peers_t *peers, peer_t *p);
/* Our Join to p's own address came back: the Joins waiting for it are confirmed, or, when
 * it failed (failure says how), refused as unconfirmable. */
void fsdp_peers_confirmations_done(fsdp_peers_t *peers, peer_t *p, const char *failure);
/* Every held Join ends: the daemon is leaving. */
void fsdp_peers_refuse_pending(fsdp_peers_t *peers);

/* --- peer_waiters.c: waiting for the cluster --- */

/* Runs every waiter's callback with status and why, and forgets them. */
void fsdp_peers_run_waiters(fsdp_peers_t *peers, int status, const char *why);
/* The membership's word that the cluster is ready (data: the table). */
void fsdp_peers_on_ready(void *data);
/* Fails the waiters whose own deadline (peer.timeout after they began) has passed. */
void fsdp_peers_expire_waiters(fsdp_peers_t *peers, uint64_t now);
/* The deadline timer's callback: peer.join_timeout has passed since start. */
void fsdp_peers_on_join_deadline(uv_timer_t *timer);

/* --- peer_table.c: the table --- */

/* Ends a close once every call and check is back. */
void fsdp_peers_maybe_finish_close(fsdp_peers_t *peers);

#endif
