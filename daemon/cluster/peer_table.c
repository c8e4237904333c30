/* The peer table (peers.h): built from the config, started, timed and stopped here, driving
 * the membership state machine (membership.h), which decides what each message means and
 * what to send next. The calls to the other hosts are peer_client.c's; the Joins received
 * and the checks of addresses peer_accept.c's; the waiters peer_waiters.c's. The file
 * is not peers.c because peers.h is the contract of all the peer_*.c files together, and
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

/* --- the timer --------------------------------------------------------------------------- */

static void on_tick(uv_timer_t *timer) {
  fsdp_peers_t *peers = timer->data;
  if (leaving(peers) || peers->closing)
    return;
  uint64_t now = now_ms(peers);
  fsdp_peers_expire_waiters(peers, now);
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
 * cluster is ready, to the waiters (fsdp_peers_on_ready). */
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

/* The host count and rank, and the times, from cluster.* and peer.*. */
static void read_options(fsdp_peers_t *peers, const fsdp_config_t *cfg) {
  unsigned n = fsdp_config_host_count(cfg);
  peers->n = n ? n : 1;
  peers->self = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_CLUSTER_HOST_RANK);
  set_timing(peers, (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_PEER_HEARTBEAT_INTERVAL),
             (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_PEER_TIMEOUT));
  peers->join_deadline_ms = (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_PEER_JOIN_TIMEOUT);
  peers->address_check_ms =
      (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_PEER_ADDRESS_CHECK_TIMEOUT);
}

/* A random nonzero incarnation, so that the others tell this start from the one before. */
static void draw_incarnation(fsdp_peers_t *peers) {
  while (peers->incarnation == 0)
    if (getrandom(&peers->incarnation, sizeof peers->incarnation, 0) != sizeof peers->incarnation)
      peers->incarnation = uv_hrtime() ^ ((uint64_t)getpid() << 32);
}

/* The settings every host must agree on, as each Join carries them, and the rules the
 * messages of the others are checked by. */
static void set_agreed_settings(fsdp_peers_t *peers, const fsdp_config_t *cfg) {
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
}

/* The membership, a row per cluster.hosts entry, and the client's row beside each;
 * -ENOMEM when memory runs out. */
static int make_membership(fsdp_peers_t *peers, const fsdp_config_t *cfg) {
  unsigned n = fsdp_config_host_count(cfg);
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
        .listener = {.send_join = fsdp_peers_send_join,
                     .send_heartbeat = fsdp_peers_send_heartbeat, .joined = on_member_joined,
                     .lost = on_member_lost, .ready = fsdp_peers_on_ready, .data = peers}};
    r = fsdp_membership_new(&options, &peers->m);
  }
  free(addresses);
  free(names);
  if (r < 0)
    return r;
  for (unsigned i = 0; i < peers->n; i++) {
    peer_t *p = &peers->peers[i];
    p->owner = peers;
    p->rank = i;
    p->m = fsdp_membership_member(peers->m, i);
  }
  return 0;
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
  read_options(peers, cfg);
  draw_incarnation(peers);
  set_agreed_settings(peers, cfg);
  int r = make_membership(peers, cfg);
  if (r < 0) {
    fsdp_peers_free(peers);
    return fsdp_status_set(st, -ENOMEM, "out of memory for the peer table");
  }
  /* One host has no client: no thread, no channel, always ready. */
  if (peers->n > 1 && (r = fsdp_peers_client_open(peers, st)) < 0) {
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
  uv_timer_start(&peers->deadline_timer, fsdp_peers_on_join_deadline, peers->join_deadline_ms, 0);
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
  fsdp_peers_refuse_pending(peers);
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
  fsdp_peers_run_waiters(peers, FSDP_E_CANCELLED, "fsdpd is stopping");
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
  fsdp_peers_refuse_pending(peers);
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
