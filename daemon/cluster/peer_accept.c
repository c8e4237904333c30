/* The server side of the peer table: what the Peer service (daemon/services/peer_service.c)
 * hands it, a Join, a Heartbeat or a Leave from another host. A Join may be held: while the
 * host's own cluster.hosts entry is asked to confirm a change of a live relationship, or
 * while its data-plane address is checked out of process (address_check.h). Those checks
 * live here with the Joins they hold, and the reply to this daemon's own Join
 * (peer_client.c) waits on the same checks. Apart from the client because it answers calls
 * rather than makes them, and holds state (the Joins) the client never touches. */
#include "daemon/cluster/peers_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include <fsdp/fsdp_version.h>

#include "common/log.h"

/* Joins of one host held at once while its address or incarnation is being checked. */
#define PENDING_JOINS_MAX 8

/* A peer's Join held while its address is checked or its incarnation confirmed. */
struct fsdp_peers_join {
  peer_t *p;
  uint64_t incarnation;
  uint8_t *ucx;
  size_t ucx_len;
  char from[96];
  bool confirming; /* waits for the reply to our Join to the host's own address */
  bool confirmed;  /* that reply came after this Join did */
  fsdp_peers_join_fn cb;
  void *data;
  fsdp_peers_join_t *next;
};

/* An address nothing in UCX needs to unpack (none at all), or the one that last passed. */
bool fsdp_peers_address_verified(const peer_t *p, const uint8_t *bytes, size_t len) {
  return len == 0 ||
         (p->verified && fsdp_address_equal(p->verified, p->verified_len, bytes, len));
}

static void answer_join(peer_t *p, fsdp_peers_join_t *j, const fsdp_status_t *st,
                        const Fsdp__V1__JoinReply *reply) {
  p->n_pending--;
  j->cb(j->data, st, reply);
  free(j->ucx);
  free(j);
}

static void park_join(peer_t *p, fsdp_peers_join_t *j) {
  j->next = p->pending;
  p->pending = j;
}

/* Whether j would change the live relationship with p: another incarnation, or another
 * data-plane address than the one in use. */
static bool changes_relationship(const peer_t *p, const fsdp_peers_join_t *j) {
  const fsdp_member_t *m = p->m;
  if (!(m->in || m->out) || !m->incarnation)
    return false;
  if (j->incarnation != m->incarnation)
    return true;
  return m->ucx && !fsdp_address_equal(m->ucx, m->ucx_len, j->ucx, j->ucx_len);
}

/* The host's own address answered our Join as j says it is. */
static bool confirms(const peer_t *p, const fsdp_peers_join_t *j) {
  return j->incarnation == p->m->incarnation && p->reply_ucx &&
         fsdp_address_equal(p->reply_ucx, p->reply_ucx_len, j->ucx, j->ucx_len);
}

/* Another daemon claims p's host rank while p lives at its own address. */
static void refuse_claim(fsdp_peers_join_t *j) {
  peer_t *p = j->p;
  fsdp_status_t st;
  fsdp_status_set(&st, FSDP_E_ALREADY_EXISTS,
                  "host %u is %s at incarnation %016llx%s, as its own address %s confirmed; "
                  "this Join as host %u, incarnation %016llx, came from %s: another daemon "
                  "claims the host's rank",
                  p->rank, fsdp_peer_state_name(p->m->state),
                  (unsigned long long)p->m->incarnation,
                  j->incarnation == p->m->incarnation ? " with another data-plane address" : "",
                  p->m->address, p->rank, (unsigned long long)j->incarnation, j->from);
  if (p->logged_impostor != j->incarnation) {
    log_error("peers: refused a Join: %s", st.message);
    p->logged_impostor = j->incarnation;
  }
  char why[600];
  snprintf(why, sizeof why, "refused a Join as this host: %s", st.message);
  fsdp_membership_set_error(p->owner->m, p->rank, why);
  answer_join(p, j, &st, NULL);
}

/* The Join is valid and p's relationship may take it: the in half. */
static void apply_join(fsdp_peers_t *peers, fsdp_peers_join_t *j) {
  peer_t *p = j->p;
  if (fsdp_membership_join_received(peers->m, p->rank, now_ms(peers), j->incarnation, j->ucx,
                                    j->ucx_len) < 0) {
    fsdp_status_t st;
    fsdp_status_set(&st, FSDP_E_RESOURCE_EXHAUSTED,
                    "out of memory for the data-plane address of host %u", p->rank);
    answer_join(p, j, &st, NULL);
    return;
  }
  Fsdp__V1__JoinReply reply = FSDP__V1__JOIN_REPLY__INIT;
  reply.protocol_version = FSDP_PROTOCOL_VERSION;
  reply.host_rank = peers->self;
  reply.incarnation = peers->incarnation;
  reply.ucx_worker_address.data = peers->local_ucx;
  reply.ucx_worker_address.len = peers->local_ucx_len;
  answer_join(p, j, NULL, &reply);
}

static int start_check(fsdp_peers_t *peers, peer_t *p, const uint8_t *bytes, size_t len,
                       fsdp_status_t *st);

/* Takes j as far as it can go now: answered (true), or waiting for the host's own address
 * to confirm it or for its data-plane address's check (false). */
static bool join_step(fsdp_peers_t *peers, fsdp_peers_join_t *j) {
  peer_t *p = j->p;
  fsdp_status_t st;
  if (leaving(peers)) {
    fsdp_status_set(&st, FSDP_E_UNAVAILABLE, "host %u is leaving", peers->self);
    answer_join(p, j, &st, NULL);
    return true;
  }
  /* A live relationship changes only on the word of the host's own address. */
  if (changes_relationship(p, j) && !(j->confirmed && confirms(p, j))) {
    if (j->confirmed) {
      refuse_claim(j);
      return true;
    }
    if (!j->confirming) {
      j->confirming = true;
      if (!fsdp_membership_send_join(peers->m, p->rank, now_ms(peers))) {
        fsdp_status_set(&st, FSDP_E_UNAVAILABLE,
                        "cannot ask host %u's own address %s to confirm incarnation %016llx; "
                        "retry",
                        p->rank, p->m->address, (unsigned long long)j->incarnation);
        answer_join(p, j, &st, NULL);
        return true;
      }
    }
    return false;
  }
  if (!fsdp_peers_address_verified(p, j->ucx, j->ucx_len)) {
    if (start_check(peers, p, j->ucx, j->ucx_len, &st) == 0)
      return false;
    fsdp_status_set(&st, FSDP_E_UNAVAILABLE, "field 'ucx_worker_address' (%zu bytes) of host "
                    "%u: %s; retry", j->ucx_len, p->rank, st.message);
    answer_join(p, j, &st, NULL);
    return true;
  }
  apply_join(peers, j);
  return true;
}

/* The first Join of a list, taken off it; NULL once it is empty. A loop over p's held Joins
 * takes the whole list first, so that each can be parked again on p->pending. */
static fsdp_peers_join_t *pop_join(fsdp_peers_join_t **list) {
  fsdp_peers_join_t *j = *list;
  if (j) {
    *list = j->next;
    j->next = NULL;
  }
  return j;
}

static fsdp_peers_join_t *take_pending(peer_t *p) {
  fsdp_peers_join_t *list = p->pending;
  p->pending = NULL;
  return list;
}

/* Every held Join of p, once more. */
static void run_pending(fsdp_peers_t *peers, peer_t *p) {
  fsdp_peers_join_t *list = take_pending(p), *j;
  while ((j = pop_join(&list))) {
    if (!join_step(peers, j))
      park_join(p, j);
  }
}

/* Our Join to p's own address came back: the Joins waiting for it are confirmed, or, when
 * it failed (failure says how), refused as unconfirmable. */
void fsdp_peers_confirmations_done(fsdp_peers_t *peers, peer_t *p, const char *failure) {
  fsdp_peers_join_t *list = take_pending(p), *j;
  while ((j = pop_join(&list))) {
    if (j->confirming && failure) {
      fsdp_status_t st;
      fsdp_status_set(&st, FSDP_E_UNAVAILABLE,
                      "host %u is %s at incarnation %016llx; its own address %s could not "
                      "confirm incarnation %016llx from %s: %s",
                      p->rank, fsdp_peer_state_name(p->m->state),
                      (unsigned long long)p->m->incarnation, p->m->address,
                      (unsigned long long)j->incarnation, j->from, failure);
      answer_join(p, j, &st, NULL);
      continue;
    }
    if (j->confirming) {
      j->confirming = false;
      j->confirmed = true;
    }
    park_join(p, j);
  }
  run_pending(peers, p);
}

static void on_check_done(void *data, int result, const char *why) {
  peer_t *p = data;
  fsdp_peers_t *peers = p->owner;
  peers->checks--;
  p->check = NULL;
  uint8_t *bytes = p->checking;
  size_t len = p->checking_len;
  p->checking = NULL;
  p->checking_len = 0;
  if (result == 0) {
    free(p->verified);
    p->verified = bytes;
    p->verified_len = len;
  } else if (result != FSDP_E_CANCELLED && fsdp_membership_first_refusal(peers->m, p->rank, why)) {
    log_error("peers: the data-plane address of host %u (%s), %zu bytes, is refused: %s",
              p->rank, p->m->address, len, why);
  }
  if (p->m->join_checking && fsdp_address_equal(p->reply_ucx, p->reply_ucx_len, bytes, len)) {
    if (result == 0)
      fsdp_membership_join_accepted(peers->m, p->rank, now_ms(peers), bytes, len);
    else
      fsdp_peers_join_failed(peers, p, result == FSDP_E_INVALID_ARGUMENT,
                             "Join: its data-plane address (%zu bytes) is refused: %s", len, why);
  }
  /* Joins with the address just refused get why; the others go on (one may start the
   * next check). */
  fsdp_peers_join_t *list = take_pending(p), *j;
  while ((j = pop_join(&list))) {
    if (result != 0 && fsdp_address_equal(j->ucx, j->ucx_len, bytes, len)) {
      fsdp_status_t st;
      fsdp_status_set(&st, result == FSDP_E_INVALID_ARGUMENT ? result : FSDP_E_UNAVAILABLE,
                      "field 'ucx_worker_address' (%zu bytes) of host %u: %s%s", len, p->rank,
                      why, result == FSDP_E_INVALID_ARGUMENT ? "" : "; retry");
      answer_join(p, j, &st, NULL);
      continue;
    }
    park_join(p, j);
  }
  if (result != 0)
    free(bytes);
  if (peers->closing) {
    fsdp_peers_maybe_finish_close(peers);
    return;
  }
  run_pending(peers, p);
  if (p->m->join_checking && !p->check)
    fsdp_peers_check_reply_address(peers, p);
}

/* Has [bytes, len) checked, unless a check of p's is running (the next one starts when it
 * ends): 0, and what waits on the check finds its outcome in on_check_done; or a negative
 * code when none could start, with st saying why. */
static int start_check(fsdp_peers_t *peers, peer_t *p, const uint8_t *bytes, size_t len,
                       fsdp_status_t *st) {
  if (p->check)
    return 0;
  if (peers->closing)
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "host %u is stopping", peers->self);
  if (fsdp_address_copy(&p->checking, &p->checking_len, bytes, len) < 0)
    return fsdp_status_set(st, -ENOMEM, "out of memory to check the data-plane address");
  int r = fsdp_address_check_start(peers->loop, bytes, len, peers->address_check_ms,
                                   on_check_done, p, &p->check, st);
  if (r < 0) {
    log_error("peers: checking the data-plane address of host %u (%s): %s", p->rank,
              p->m->address, st->message);
    return r;
  }
  peers->checks++;
  return 0;
}

void fsdp_peers_check_reply_address(fsdp_peers_t *peers, peer_t *p) {
  fsdp_status_t st;
  if (start_check(peers, p, p->reply_ucx, p->reply_ucx_len, &st) < 0)
    fsdp_peers_join_failed(peers, p, false, "Join: %s", st.message);
}

fsdp_peers_join_t *fsdp_peers_accept_join(fsdp_peers_t *peers, const Fsdp__V1__JoinRequest *rq,
                                          const char *from, fsdp_peers_join_fn cb, void *data) {
  fsdp_status_t st;
  if (fsdp_peer_check_join(&peers->rules, rq, &st) < 0) {
    /* A relationship with the host, if it names one, stays as it is. */
    if (rq->host_rank < peers->n && rq->host_rank != peers->self)
      fsdp_membership_join_refused(peers->m, rq->host_rank, from, st.message);
    cb(data, &st, NULL);
    return NULL;
  }
  peer_t *p = &peers->peers[rq->host_rank];
  if (p->n_pending >= PENDING_JOINS_MAX) {
    fsdp_status_set(&st, FSDP_E_RESOURCE_EXHAUSTED,
                    "host %u already has %d Joins being checked; retry", p->rank,
                    PENDING_JOINS_MAX);
    cb(data, &st, NULL);
    return NULL;
  }
  fsdp_peers_join_t *j = calloc(1, sizeof *j);
  if (!j || fsdp_address_copy(&j->ucx, &j->ucx_len, rq->ucx_worker_address.data,
                              rq->ucx_worker_address.len) < 0) {
    free(j);
    fsdp_status_set(&st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for the Join of host %u",
                    rq->host_rank);
    cb(data, &st, NULL);
    return NULL;
  }
  *j = (fsdp_peers_join_t){.p = p, .incarnation = rq->incarnation, .ucx = j->ucx,
                           .ucx_len = j->ucx_len, .cb = cb, .data = data};
  snprintf(j->from, sizeof j->from, "%s", from);
  p->n_pending++;
  if (join_step(peers, j))
    return NULL;
  park_join(p, j);
  return j;
}

void fsdp_peers_join_cancel(fsdp_peers_join_t *join) {
  peer_t *p = join->p;
  for (fsdp_peers_join_t **j = &p->pending; *j; j = &(*j)->next)
    if (*j == join) {
      *j = join->next;
      p->n_pending--;
      free(join->ucx);
      free(join);
      return;
    }
}

/* Every held Join ends: the daemon is leaving. */
void fsdp_peers_refuse_pending(fsdp_peers_t *peers) {
  for (unsigned i = 0; i < peers->n; i++)
    run_pending(peers, &peers->peers[i]);
}

int fsdp_peers_accept_heartbeat(fsdp_peers_t *peers, const Fsdp__V1__HeartbeatRequest *rq,
                                Fsdp__V1__HeartbeatReply *reply, fsdp_status_t *st) {
  int r = fsdp_peer_check_heartbeat(&peers->rules, rq, st);
  if (r < 0)
    return r;
  if ((r = fsdp_membership_heartbeat_received(peers->m, rq->host_rank, now_ms(peers),
                                              rq->incarnation, st)) < 0)
    return r;
  reply->sent_ns = rq->sent_ns;
  reply->incarnation = peers->incarnation;
  return 0;
}

int fsdp_peers_accept_leave(fsdp_peers_t *peers, const Fsdp__V1__LeaveRequest *rq,
                            fsdp_status_t *st) {
  int r = fsdp_peer_check_leave(&peers->rules, rq, st);
  if (r < 0)
    return r;
  fsdp_membership_leave_received(peers->m, rq->host_rank, now_ms(peers), rq->incarnation,
                                 rq->reason);
  return 0;
}

bool fsdp_peers_joined_as(const fsdp_peers_t *peers, unsigned host, uint64_t incarnation) {
  fsdp_peer_info_t info;
  fsdp_peers_get(peers, host, &info);
  return info.state == FSDP_PEER_JOINED && info.incarnation == incarnation;
}

int fsdp_peers_accept_recover(fsdp_peers_t *peers, const Fsdp__V1__RecoverRequest *rq,
                              fsdp_peers_recover_t *ret_ask,
                              fsdp_peers_recover_unit_t **ret_units, fsdp_status_t *st) {
  *ret_units = NULL;
  int r = fsdp_peer_check_recover(&peers->rules, rq, st);
  if (r < 0)
    return r;
  /* Only a fetch sends anything, to the daemon joined at that rank: where a job stands
   * goes back in the reply to the caller alone. */
  if (rq->fetch && !fsdp_peers_joined_as(peers, rq->host_rank, rq->incarnation))
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "Recover from host %u, incarnation %016llx: that host has not "
                           "joined this one at that incarnation: ask once it has",
                           rq->host_rank, (unsigned long long)rq->incarnation);
  if (rq->n_units && !(*ret_units = calloc(rq->n_units, sizeof **ret_units)))
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "Recover: out of memory");
  for (size_t i = 0; i < rq->n_units; i++) {
    const Fsdp__V1__RecoverUnit *u = rq->units[i];
    (*ret_units)[i] = (fsdp_peers_recover_unit_t){
        .name = u->name, .numel = u->numel, .shard_numel = u->shard_numel,
        .host_first_shard = u->host_first_shard, .host_shards = u->host_shards,
        .optimizer_arrays = u->optimizer_arrays};
  }
  *ret_ask = (fsdp_peers_recover_t){.host = rq->host_rank, .incarnation = rq->incarnation,
                                    .job = rq->job, .uid = rq->uid, .fetch = rq->fetch,
                                    .step = rq->step, .bytes = rq->bytes, .units = *ret_units,
                                    .n_units = rq->n_units};
  return 0;
}
