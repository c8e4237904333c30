/* The cluster's membership: what this daemon knows of every other host's daemon, and what
 * it should do next, as a state machine with no I/O and no clock of its own.
 *
 * Each peer has two halves of a relationship: `in` (it joined us: we accepted its Join at its
 * current incarnation) and `out` (we joined it: it accepted ours). JOINED is both. Any sign
 * that one half is gone (a Heartbeat refused as "not joined", a new incarnation, a Leave,
 * silence for the timeout) drops both, tells the listener if the peer was JOINED, and the
 * join starts over; the other side hears the same through its own calls, so the two
 * converge without more protocol. The cluster is ready once every peer is JOINED.
 *
 * Events come in as calls (a Join received or answered, a Heartbeat received or answered, a
 * Leave, a tick of the clock), each with the current time in milliseconds of a monotonic
 * clock; actions go out through the listener: start a Join or a Heartbeat to a host (the
 * listener says whether it could), a peer joined or was lost, the cluster is ready. The
 * listener runs inside the call that caused it. What the messages say has been checked
 * before they come here (peer_check.h), and so has a data-plane address (address_check.h):
 * the driver (peers.h) does both, and the gRPC calls.
 *
 * Threads: one (the loop's). Lifetime: fsdp_membership_new / fsdp_membership_free. */
#ifndef FSDP_MEMBERSHIP_H
#define FSDP_MEMBERSHIP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* Join retries: from FSDP_MEMBERSHIP_BACKOFF_MIN_MS doubling to FSDP_MEMBERSHIP_BACKOFF_MAX_MS. */
#define FSDP_MEMBERSHIP_BACKOFF_MIN_MS 50
#define FSDP_MEMBERSHIP_BACKOFF_MAX_MS 1000

typedef struct fsdp_membership fsdp_membership_t;

typedef enum fsdp_peer_state {
  FSDP_PEER_SELF,    /* this daemon's own row */
  FSDP_PEER_JOINING, /* not yet joined both ways */
  FSDP_PEER_JOINED,
  FSDP_PEER_LOST,    /* no answer for the timeout */
  FSDP_PEER_LEFT,    /* it sent Leave */
  FSDP_PEER_REFUSED, /* a Join between us was refused; last_error says why */
} fsdp_peer_state_t;

const char *fsdp_peer_state_name(fsdp_peer_state_t state);

/* One host's row. Read-only outside membership.c; valid until the membership is freed. */
typedef struct fsdp_member {
  unsigned rank;
  char address[320]; /* its cluster.hosts entry */
  fsdp_peer_state_t state;
  bool in, out;
  bool announced;        /* the listener was told joined, and not yet lost */
  bool rejoin;           /* send Join again although out (the local address changed) */
  bool join_in_flight;   /* a Join call of ours is out */
  bool join_checking;    /* its reply came, and waits for its data-plane address's check */
  bool heartbeat_in_flight;
  uint64_t incarnation;   /* 0: unknown */
  uint64_t last_heard_ms; /* 0: never */
  uint64_t rtt_us;
  char last_error[512];
  /* The refusals last logged each way, so that a retry every second logs nothing new. */
  char logged_in_refusal[512], logged_out_refusal[512];
  uint8_t *ucx; /* the data-plane address in use */
  size_t ucx_len;
  uint64_t next_join_ms, next_heartbeat_ms;
  unsigned backoff_ms;
} fsdp_member_t;

/* Actions. send_join and send_heartbeat start a call to the host and say whether it
 * started (a Join that did not is retried after the backoff). joined: the peer is JOINED
 * (again, or its data-plane address changed; the address is borrowed for the call). lost: a
 * peer that was JOINED no longer is; `why` names the host and the reason. ready: every peer
 * has become JOINED. Any may be NULL. */
typedef struct fsdp_membership_listener {
  bool (*send_join)(void *data, unsigned host_rank);
  bool (*send_heartbeat)(void *data, unsigned host_rank);
  void (*joined)(void *data, unsigned host_rank, uint64_t incarnation,
                 const uint8_t *ucx_address, size_t ucx_address_len);
  void (*lost)(void *data, unsigned host_rank, const char *why);
  void (*ready)(void *data);
  void *data;
} fsdp_membership_listener_t;

typedef struct fsdp_membership_options {
  unsigned n_hosts; /* >= 1 */
  unsigned self;    /* < n_hosts */
  uint64_t incarnation; /* this daemon's, nonzero */
  const char *const *addresses; /* n_hosts cluster.hosts entries (copied); NULL: all "" */
  uint64_t heartbeat_interval_ms, timeout_ms;
  fsdp_membership_listener_t listener; /* copied */
} fsdp_membership_options_t;

int fsdp_membership_new(const fsdp_membership_options_t *options,
                        fsdp_membership_t **ret_membership);
/* NULL-safe. */
void fsdp_membership_free(fsdp_membership_t *membership);

void fsdp_membership_set_timing(fsdp_membership_t *membership, uint64_t heartbeat_interval_ms,
                                uint64_t timeout_ms);

unsigned fsdp_membership_host_count(const fsdp_membership_t *membership);
const fsdp_member_t *fsdp_membership_member(const fsdp_membership_t *membership,
                                            unsigned host_rank);
/* Every peer is JOINED (always true on one host). */
bool fsdp_membership_ready(const fsdp_membership_t *membership);
bool fsdp_membership_leaving(const fsdp_membership_t *membership);

/* The clock: a peer silent for the timeout is LOST; due Joins and Heartbeats start. Nothing
 * once leaving. */
void fsdp_membership_tick(fsdp_membership_t *membership, uint64_t now_ms);

/* Starts a Join to the host now, unless one is out; whether one is out afterwards. */
bool fsdp_membership_send_join(fsdp_membership_t *membership, unsigned host_rank,
                               uint64_t now_ms);
/* Our Join's call ended with a reply from the host at this incarnation (a new one drops the
 * relationship: the host restarted); the reply's data-plane address is now checked, and
 * fsdp_membership_join_accepted or fsdp_membership_join_failed follows. */
void fsdp_membership_join_replied(fsdp_membership_t *membership, unsigned host_rank,
                                  uint64_t now_ms, uint64_t incarnation);
/* The out half: the reply's address passed; it becomes the one in use (copied). */
void fsdp_membership_join_accepted(fsdp_membership_t *membership, unsigned host_rank,
                                   uint64_t now_ms, const uint8_t *ucx_address,
                                   size_t ucx_address_len);
/* Our Join failed (why becomes last_error); refused: the host said no (or its reply did not
 * pass), which a JOINED peer does not survive. Retried after the backoff. */
void fsdp_membership_join_failed(fsdp_membership_t *membership, unsigned host_rank,
                                 uint64_t now_ms, bool refused, const char *why);
/* Our Join's call did not reach the host; why becomes last_error unless the peer is LOST,
 * LEFT or REFUSED, which says more. Retried after the backoff. */
void fsdp_membership_join_unreachable(fsdp_membership_t *membership, unsigned host_rank,
                                      uint64_t now_ms, const char *why);

/* The in half: the host's Join, checked, at this incarnation and data-plane address
 * (copied). 0, or -ENOMEM with the in half not taken (a new incarnation still ended the
 * old relationship). */
int fsdp_membership_join_received(fsdp_membership_t *membership, unsigned host_rank,
                                  uint64_t now_ms, uint64_t incarnation,
                                  const uint8_t *ucx_address, size_t ucx_address_len);
/* The host's Join was refused by the checks (msg says why, from where it came): logged
 * once, shown on its row; a relationship with the host stays as it is. */
void fsdp_membership_join_refused(fsdp_membership_t *membership, unsigned host_rank,
                                  const char *from, const char *msg);

/* A Heartbeat from the host: 0, or FAILED_PRECONDITION when it has not joined us at that
 * incarnation. */
int fsdp_membership_heartbeat_received(fsdp_membership_t *membership, unsigned host_rank,
                                       uint64_t now_ms, uint64_t incarnation,
                                       fsdp_status_t *st);
/* Our Heartbeat came back: answered at this incarnation, with its round trip; refused as
 * "not joined" (the relationship starts over); failed otherwise (why becomes last_error). */
void fsdp_membership_heartbeat_answered(fsdp_membership_t *membership, unsigned host_rank,
                                        uint64_t now_ms, uint64_t incarnation,
                                        uint64_t rtt_us);
void fsdp_membership_heartbeat_refused(fsdp_membership_t *membership, unsigned host_rank,
                                       uint64_t now_ms, const char *why);
void fsdp_membership_heartbeat_failed(fsdp_membership_t *membership, unsigned host_rank,
                                      const char *why);

/* The host left, at this incarnation (an older one's Leave is ignored). */
void fsdp_membership_leave_received(fsdp_membership_t *membership, unsigned host_rank,
                                    uint64_t now_ms, uint64_t incarnation, const char *reason);

/* This daemon leaves: no more Joins or Heartbeats, and replies to ours are ignored. */
void fsdp_membership_leave(fsdp_membership_t *membership);
/* The local data-plane address changed: Join again the peers we had joined. */
void fsdp_membership_rejoin_all(fsdp_membership_t *membership);

/* why becomes the host's last_error. */
void fsdp_membership_set_error(fsdp_membership_t *membership, unsigned host_rank,
                               const char *why);
/* Whether an in-refusal `why` of the host differs from the last one logged (and is now). */
bool fsdp_membership_first_refusal(fsdp_membership_t *membership, unsigned host_rank,
                                   const char *why);
/* Data-plane addresses as bytes: whether two are the same; and *dst becoming a copy of
 * [bytes, len), which returns 1 if that changed it, 0 if not, or -ENOMEM. */
bool fsdp_address_equal(const uint8_t *a, size_t a_len, const uint8_t *b, size_t b_len);
int fsdp_address_copy(uint8_t **dst, size_t *dst_len, const uint8_t *bytes, size_t len);

/* The hosts not JOINED, with their last errors, into buf. */
void fsdp_membership_describe_missing(const fsdp_membership_t *membership, char *buf,
                                      size_t size);

#endif
