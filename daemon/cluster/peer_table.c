/* The peer table (peers.h): built from the config, started, timed and stopped here, driving
 * the membership state machine (membership.h), which decides what each message means and
 * what to send next. The calls to the other hosts are peer_client.c's; this file still
 * holds the Joins it receives, the checks of their addresses and the waiters. The file is
 * not peers.c because peers.h is the contract of all the peer_*.c files together, and
 * their shared struct (peers_internal.h) includes it. */
#include "daemon/cluster/peers_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include <fsdp/fsdp_version.h>

#include "common/log.h"
#include "proto/host/formats.h"

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

/* --- helpers --------------------------------------------------------------------------- */

static void run_waiters(fsdp_peers_t *peers, int status, const char *why) {
  while (peers->waiters) {
    fsdp_peers_waiter_t *w = peers->waiters;
    peers->waiters = w->next;
    w->next = NULL;
    w->cb(w->data, status, why);
  }
}

bool fsdp_peers_address_verified(const peer_t *p, const uint8_t *bytes, size_t len) {
  return len == 0 ||
         (p->verified && fsdp_address_equal(p->verified, p->verified_len, bytes, len));
}

static void refuse_pending(fsdp_peers_t *peers);

/* --- the timer --------------------------------------------------------------------------- */

static void expire_waiters(fsdp_peers_t *peers, uint64_t now);

static void on_tick(uv_timer_t *timer) {
  fsdp_peers_t *peers = timer->data;
  if (leaving(peers) || peers->closing)
    return;
  uint64_t now = now_ms(peers);
  expire_waiters(peers, now);
  fsdp_membership_tick(peers->m, now);
}

static uint64_t tick_ms(const fsdp_peers_t *peers) {
  uint64_t t = peers->heartbeat_ms / 2;
  if (peers->timeout_ms / 4 < t)
    t = peers->timeout_ms / 4;
  if (t > 100)
    t = 100;
  return t < 5 ? 5 : t;
}

/* Fails the waiters whose time is up: those waiting for the cluster to form once
 * peer.join_timeout has passed (formation), those with a deadline of their own once it has
 * passed (now). */
static void fail_waiters(fsdp_peers_t *peers, bool formation, uint64_t now, const char *why) {
  for (fsdp_peers_waiter_t **w = &peers->waiters; *w;) {
    fsdp_peers_waiter_t *waiter = *w;
    if (waiter->deadline_ms ? waiter->deadline_ms > now : !formation) {
      w = &waiter->next;
      continue;
    }
    *w = waiter->next;
    waiter->next = NULL;
    waiter->cb(waiter->data, FSDP_E_UNAVAILABLE, why);
    w = &peers->waiters; /* the callback may have added or cancelled waiters */
  }
}

static void expire_waiters(fsdp_peers_t *peers, uint64_t now) {
  bool due = false;
  for (const fsdp_peers_waiter_t *w = peers->waiters; w; w = w->next)
    due |= w->deadline_ms && w->deadline_ms <= now;
  if (!due)
    return;
  char missing[2048], why[2300];
  fsdp_membership_describe_missing(peers->m, missing, sizeof missing);
  snprintf(why, sizeof why, "%s; not back within peer.timeout (%llu ms)", missing,
           (unsigned long long)peers->timeout_ms);
  fail_waiters(peers, false, now, why);
}

static void on_join_deadline(uv_timer_t *timer) {
  fsdp_peers_t *peers = timer->data;
  peers->deadline_passed = true;
  if (fsdp_membership_ready(peers->m) || peers->formed)
    return;
  char missing[2048], why[2300];
  fsdp_membership_describe_missing(peers->m, missing, sizeof missing);
  snprintf(why, sizeof why, "the cluster is not ready %llu ms after start (peer.join_timeout): %s",
           (unsigned long long)peers->join_deadline_ms, missing);
  log_error("peers: %s", why);
  fail_waiters(peers, true, 0, why);
}

/* --- public ------------------------------------------------------------------------------ */

/* cluster.hosts spelled one way whatever the spaces, so that it compares as a setting. */
static void canonical_hosts(const fsdp_config_t *cfg, char *buf, size_t size) {
  size_t used = 0;
  char one[320];
  buf[0] = '\0';
  for (unsigned i = 0; i < fsdp_config_host_count(cfg) && used < size; i++) {
    fsdp_config_host(cfg, i, one, sizeof one);
    used += (size_t)snprintf(buf + used, size - used, "%s%s", i ? "," : "", one);
  }
}

static void set_timing(fsdp_peers_t *peers, uint64_t heartbeat_ms, uint64_t timeout_ms) {
  peers->heartbeat_ms = heartbeat_ms;
  peers->timeout_ms = timeout_ms;
  if (peers->m)
    fsdp_membership_set_timing(peers->m, heartbeat_ms, timeout_ms);
}

/* The membership's word that a peer joined or was lost goes to the data plane; that the
 * cluster is ready, to the waiters. */
static void on_member_joined(void *data, unsigned host_rank, uint64_t incarnation,
                             const uint8_t *ucx_address, size_t ucx_address_len) {
  fsdp_peers_t *peers = data;
  if (peers->cb.joined)
    peers->cb.joined(peers->cb.data, host_rank, incarnation, ucx_address, ucx_address_len);
}

static void on_member_lost(void *data, unsigned host_rank, const char *why) {
  fsdp_peers_t *peers = data;
  if (peers->cb.lost)
    peers->cb.lost(peers->cb.data, host_rank, why);
}

static void on_ready(void *data) {
  fsdp_peers_t *peers = data;
  peers->formed = true;
  run_waiters(peers, 0, "");
}

int fsdp_peers_new(uv_loop_t *loop, const fsdp_config_t *cfg, const fsdp_peer_security_t *sec,
                   const fsdp_peers_callbacks_t *callbacks, fsdp_peers_t **ret_peers,
                   fsdp_status_t *st) {
  fsdp_peers_t *peers = calloc(1, sizeof *peers);
  if (!peers)
    return fsdp_status_set(st, -ENOMEM, "out of memory for the peer table");
  peers->loop = loop;
  peers->sec = sec;
  if (callbacks)
    peers->cb = *callbacks;
  unsigned n = fsdp_config_host_count(cfg);
  peers->n = n ? n : 1;
  peers->self = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_CLUSTER_HOST_RANK);
  set_timing(peers, (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_PEER_HEARTBEAT_INTERVAL),
             (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_PEER_TIMEOUT));
  peers->join_deadline_ms = (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_PEER_JOIN_TIMEOUT);
  peers->address_check_ms =
      (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_PEER_ADDRESS_CHECK_TIMEOUT);
  while (peers->incarnation == 0)
    if (getrandom(&peers->incarnation, sizeof peers->incarnation, 0) != sizeof peers->incarnation)
      peers->incarnation = uv_hrtime() ^ ((uint64_t)getpid() << 32);

  static const fsdp_option_id_t agree[N_SETTINGS] = {
      FSDP_OPTION_CLUSTER_HOSTS, FSDP_OPTION_CLUSTER_LOCAL_WORLD_SIZE,
      FSDP_OPTION_CLUSTER_SHARD_GROUP_HOSTS, FSDP_OPTION_BACKEND};
  for (size_t i = 0; i < N_SETTINGS; i++) {
    fsdp__v1__setting__init(&peers->settings[i]);
    peers->settings[i].key = (char *)fsdp_option_get(agree[i])->key;
    if (agree[i] == FSDP_OPTION_CLUSTER_HOSTS)
      canonical_hosts(cfg, peers->setting_values[i], sizeof peers->setting_values[i]);
    else
      fsdp_config_format(cfg, agree[i], peers->setting_values[i], sizeof peers->setting_values[i]);
    peers->settings[i].value = peers->setting_values[i];
  }
  peers->rules = (fsdp_peer_rules_t){.n_hosts = peers->n, .self = peers->self,
                                     .settings = peers->settings, .n_settings = N_SETTINGS};

  peers->peers = calloc(peers->n, sizeof *peers->peers);
  char(*addresses)[320] = calloc(peers->n, sizeof *addresses);
  const char **names = calloc(peers->n, sizeof *names);
  int r = peers->peers && addresses && names ? 0 : -ENOMEM;
  for (unsigned i = 0; r == 0 && i < peers->n; i++) {
    if (n)
      fsdp_config_host(cfg, i, addresses[i], sizeof addresses[i]);
    names[i] = addresses[i];
  }
  if (r == 0) {
    fsdp_membership_options_t options = {
        .n_hosts = peers->n, .self = peers->self, .incarnation = peers->incarnation,
        .addresses = names, .heartbeat_interval_ms = peers->heartbeat_ms,
        .timeout_ms = peers->timeout_ms,
        .listener = {.send_join = fsdp_peers_send_join, .send_heartbeat = fsdp_peers_send_heartbeat,
                     .joined = on_member_joined, .lost = on_member_lost, .ready = on_ready,
                     .data = peers}};
    r = fsdp_membership_new(&options, &peers->m);
  }
  free(addresses);
  free(names);
  if (r < 0) {
    fsdp_peers_free(peers);
    return fsdp_status_set(st, -ENOMEM, "out of memory for the peer table");
  }
  for (unsigned i = 0; i < peers->n; i++) {
    peer_t *p = &peers->peers[i];
    p->owner = peers;
    p->rank = i;
    p->m = fsdp_membership_member(peers->m, i);
  }
  if (peers->n == 1) {
    *ret_peers = peers;
    return 0;
  }

  if ((r = fsdp_peers_client_open(peers, st)) < 0) {
    fsdp_peers_free(peers);
    return r;
  }
  *ret_peers = peers;
  return 0;
}

int fsdp_peers_start(fsdp_peers_t *peers) {
  if (peers->n == 1)
    return 0;
  /* The bridge first: if it cannot start, there is nothing to close, only to free. */
  int r = fsdp_cq_bridge_start(peers->bridge);
  if (r < 0)
    return r;
  uv_timer_init(peers->loop, &peers->timer);
  uv_timer_init(peers->loop, &peers->deadline_timer);
  peers->timer.data = peers->deadline_timer.data = peers;
  peers->open_handles = 3;
  peers->started = true;
  log_info("peers: host %u of %u, incarnation %016llx, joining %u peers",
           peers->self, peers->n, (unsigned long long)peers->incarnation, peers->n - 1);
  uv_timer_start(&peers->timer, on_tick, 0, tick_ms(peers));
  uv_timer_start(&peers->deadline_timer, on_join_deadline, peers->join_deadline_ms, 0);
  return 0;
}

void fsdp_peers_set_callbacks(fsdp_peers_t *peers, const fsdp_peers_callbacks_t *callbacks) {
  peers->cb = *callbacks;
}

void fsdp_peers_set_timing(fsdp_peers_t *peers, uint64_t heartbeat_interval_ms,
                           uint64_t timeout_ms) {
  set_timing(peers, heartbeat_interval_ms, timeout_ms);
  if (peers->started && !peers->closing) {
    uv_timer_set_repeat(&peers->timer, tick_ms(peers));
    uv_timer_again(&peers->timer);
  }
}

int fsdp_peers_set_local_address(fsdp_peers_t *peers, const void *bytes, size_t len) {
  if (len > FSDP_UCX_ADDRESS_MAX)
    return -E2BIG;
  uint8_t *copy = NULL;
  if (len && !(copy = malloc(len)))
    return -ENOMEM;
  if (len)
    memcpy(copy, bytes, len);
  free(peers->local_ucx);
  peers->local_ucx = copy;
  peers->local_ucx_len = len;
  fsdp_membership_rejoin_all(peers->m);
  return 0;
}

void fsdp_peers_leave(fsdp_peers_t *peers, const char *why) {
  if (!peers || !peers->started || leaving(peers))
    return;
  fsdp_membership_leave(peers->m);
  refuse_pending(peers);
  unsigned sent = fsdp_peers_send_leave(peers, why);
  log_info("peers: leaving (%s), told %u peer%s", why, sent, sent == 1 ? "" : "s");
}

/* The handles and the bridge close apart; the last to go ends the close. */
static void closed_one(fsdp_peers_t *peers) {
  if (--peers->open_handles > 0)
    return;
  if (peers->done)
    peers->done(peers->done_data);
}

static void on_handle_closed(uv_handle_t *handle) {
  closed_one(handle->data);
}

static void on_bridge_closed(void *data) {
  fsdp_peers_t *peers = data;
  peers->bridge = NULL;
  closed_one(peers);
}

void fsdp_peers_maybe_finish_close(fsdp_peers_t *peers) {
  if (!peers->closing || peers->inflight || peers->checks || peers->channels_gone)
    return;
  /* Every call is back: nothing more can be queued, so the queue may shut down. */
  for (unsigned i = 0; i < peers->n; i++)
    if (peers->peers[i].channel) {
      grpc_channel_destroy(peers->peers[i].channel);
      peers->peers[i].channel = NULL;
    }
  peers->channels_gone = true;
  fsdp_cq_bridge_close(peers->bridge, on_bridge_closed, peers);
  uv_close((uv_handle_t *)&peers->timer, on_handle_closed);
  uv_close((uv_handle_t *)&peers->deadline_timer, on_handle_closed);
}

void fsdp_peers_close(fsdp_peers_t *peers, void (*done)(void *data), void *data) {
  run_waiters(peers, FSDP_E_CANCELLED, "fsdpd is stopping");
  if (!peers->started) {
    /* Nothing to end, but done still runs later, as after every close: a handle closed at
     * once brings it on the loop's next turn. */
    peers->done = done;
    peers->done_data = data;
    uv_timer_init(peers->loop, &peers->timer);
    peers->timer.data = peers;
    peers->open_handles = 1;
    uv_close((uv_handle_t *)&peers->timer, on_handle_closed);
    return;
  }
  peers->closing = true;
  fsdp_membership_leave(peers->m);
  refuse_pending(peers);
  for (unsigned i = 0; i < peers->n; i++)
    if (peers->peers[i].check)
      fsdp_address_check_cancel(peers->peers[i].check);
  peers->done = done;
  peers->done_data = data;
  uv_timer_stop(&peers->timer);
  uv_timer_stop(&peers->deadline_timer);
  fsdp_peers_cancel_calls(peers);
  fsdp_peers_maybe_finish_close(peers);
}

void fsdp_peers_free(fsdp_peers_t *peers) {
  if (!peers)
    return;
  fsdp_peers_client_free(peers);
  for (unsigned i = 0; peers->peers && i < peers->n; i++) {
    free(peers->peers[i].verified);
    free(peers->peers[i].checking);
    free(peers->peers[i].reply_ucx);
  }
  free(peers->peers);
  fsdp_membership_free(peers->m);
  free(peers->local_ucx);
  free(peers);
}

unsigned fsdp_peers_host_rank(const fsdp_peers_t *peers) {
  return peers->self;
}

unsigned fsdp_peers_host_count(const fsdp_peers_t *peers) {
  return peers->n;
}

uint64_t fsdp_peers_incarnation(const fsdp_peers_t *peers) {
  return peers->incarnation;
}

bool fsdp_peers_ready(const fsdp_peers_t *peers) {
  return fsdp_membership_ready(peers->m);
}

void fsdp_peers_get(const fsdp_peers_t *peers, unsigned host_rank, fsdp_peer_info_t *ret) {
  const fsdp_member_t *p =
      fsdp_membership_member(peers->m, host_rank < peers->n ? host_rank : peers->self);
  uint64_t now = now_ms(peers);
  *ret = (fsdp_peer_info_t){
      .host_rank = p->rank,
      .address = p->address,
      .state = p->state,
      .last_heard_ms = p->rank == peers->self ? 0
                       : p->last_heard_ms  ? (int64_t)(now - p->last_heard_ms)
                                           : -1,
      .rtt_us = p->rtt_us,
      .incarnation = p->incarnation,
      .last_error = p->last_error,
      .ucx_address = p->rank == peers->self ? peers->local_ucx : p->ucx,
      .ucx_address_len = p->rank == peers->self ? peers->local_ucx_len : p->ucx_len,
  };
}

void fsdp_peers_when_ready(fsdp_peers_t *peers, fsdp_peers_waiter_t *waiter,
                           fsdp_peers_ready_fn cb, void *data) {
  waiter->cb = cb;
  waiter->data = data;
  waiter->next = NULL;
  /* Once the cluster had been ready, a host missing was lost or left: whoever needs it
   * waits peer.timeout for it to be back, not what is left of the join deadline. */
  waiter->deadline_ms = peers->formed ? now_ms(peers) + peers->timeout_ms : 0;
  if (fsdp_membership_ready(peers->m)) {
    cb(data, 0, "");
    return;
  }
  if (peers->closing || leaving(peers)) {
    cb(data, FSDP_E_CANCELLED, "fsdpd is stopping");
    return;
  }
  if (peers->deadline_passed && !peers->formed) {
    char missing[2048], why[2300];
    fsdp_membership_describe_missing(peers->m, missing, sizeof missing);
    snprintf(why, sizeof why, "the cluster is not ready (peer.join_timeout %llu ms passed): %s",
             (unsigned long long)peers->join_deadline_ms, missing);
    cb(data, FSDP_E_UNAVAILABLE, why);
    return;
  }
  waiter->next = peers->waiters;
  peers->waiters = waiter;
}

void fsdp_peers_wait_cancel(fsdp_peers_t *peers, fsdp_peers_waiter_t *waiter) {
  for (fsdp_peers_waiter_t **w = &peers->waiters; *w; w = &(*w)->next)
    if (*w == waiter) {
      *w = waiter->next;
      waiter->next = NULL;
      return;
    }
}

/* --- server side ------------------------------------------------------------------------- */

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
static void refuse_pending(fsdp_peers_t *peers) {
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
