/* The Peer client: this daemon's Joins, Heartbeats and Leaves to the other hosts, as a small
 * asynchronous gRPC client on a completion queue of its own, and what their replies tell the
 * membership (membership.h). Apart from the table because it is the one part that speaks
 * gRPC as a client: its channels, calls and their completions.
 *
 * Calls. Each call is one batch of all six client ops, tagged with its own context, on a
 * completion queue that the bridge (daemon/rpc/cq_bridge.h) drains onto the loop, where the
 * reply is decoded and acted on. A peer has at most one Join and one Heartbeat in flight;
 * every call has a deadline (peer.timeout, shorter for Leave). A recovery's Recover
 * (fsdp_peers_recover) goes the same way, with its caller's deadline and callback. */
#include "daemon/cluster/peers_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include <fsdp/fsdp_version.h>

#include "common/log.h"
#include "proto/wire.h"

/* A Leave must not hold up a stop. */
#define LEAVE_DEADLINE_MAX_MS 1000

typedef enum call_kind { CALL_JOIN, CALL_HEARTBEAT, CALL_LEAVE, CALL_RECOVER } call_kind_t;

typedef struct peer peer_t;

struct pcall {
  fsdp_peers_t *peers;
  peer_t *peer;
  call_kind_t kind;
  grpc_call *call;
  grpc_metadata auth;
  grpc_byte_buffer *send;
  grpc_byte_buffer *recv;
  grpc_metadata_array initial_md, trailing_md;
  grpc_status_code status;
  grpc_slice details;
  const char *error_string;
  bool success;
  uint64_t sent_ns;
  /* CALL_RECOVER's caller. */
  fsdp_peers_recover_fn done;
  void *done_data;
  struct pcall *all_prev, *all_next; /* every call in flight */
};

static void pcall_free(pcall_t *c) {
  if (c->call)
    grpc_call_unref(c->call);
  if (c->send)
    grpc_byte_buffer_destroy(c->send);
  if (c->recv)
    grpc_byte_buffer_destroy(c->recv);
  grpc_metadata_array_destroy(&c->initial_md);
  grpc_metadata_array_destroy(&c->trailing_md);
  grpc_slice_unref(c->details);
  gpr_free((void *)c->error_string);
  free(c);
}

static const char *method_path(call_kind_t kind) {
  switch (kind) {
  case CALL_JOIN:
    return "/fsdp.v1.Peer/Join";
  case CALL_HEARTBEAT:
    return "/fsdp.v1.Peer/Heartbeat";
  case CALL_LEAVE:
    return "/fsdp.v1.Peer/Leave";
  case CALL_RECOVER:
    return "/fsdp.v1.Peer/Recover";
  }
  return "";
}

/* Starts one call to p; NULL when it could not start (logged, retried later). */
static pcall_t *start_call(fsdp_peers_t *peers, peer_t *p, call_kind_t kind,
                           const ProtobufCMessage *request, uint64_t deadline_ms) {
  pcall_t *c = calloc(1, sizeof *c);
  if (!c)
    return NULL;
  c->peers = peers;
  c->peer = p;
  c->kind = kind;
  c->details = grpc_empty_slice();
  grpc_metadata_array_init(&c->initial_md);
  grpc_metadata_array_init(&c->trailing_md);
  if (fsdp_wire_encode(request, &c->send) < 0) {
    pcall_free(c);
    return NULL;
  }
  gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                       gpr_time_from_millis((int64_t)deadline_ms, GPR_TIMESPAN));
  c->call = grpc_channel_create_call(p->channel, NULL, GRPC_PROPAGATE_DEFAULTS,
                                     fsdp_cq_bridge_queue(peers->bridge),
                                     grpc_slice_from_static_string(method_path(kind)), NULL,
                                     deadline, NULL);
  grpc_op ops[6];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (peers->auth_value) {
    c->auth.key = grpc_slice_from_static_string("authorization");
    c->auth.value = grpc_slice_from_static_string(peers->auth_value);
    ops[0].data.send_initial_metadata.count = 1;
    ops[0].data.send_initial_metadata.metadata = &c->auth;
  }
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = c->send;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &c->initial_md;
  ops[4].op = GRPC_OP_RECV_MESSAGE;
  ops[4].data.recv_message.recv_message = &c->recv;
  ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[5].data.recv_status_on_client.trailing_metadata = &c->trailing_md;
  ops[5].data.recv_status_on_client.status = &c->status;
  ops[5].data.recv_status_on_client.status_details = &c->details;
  ops[5].data.recv_status_on_client.error_string = &c->error_string;
  grpc_call_error e = grpc_call_start_batch(c->call, ops, 6, c, NULL);
  if (e != GRPC_CALL_OK) {
    log_error("peers: cannot start %s to host %u: gRPC error %d", method_path(kind), p->rank, e);
    pcall_free(c);
    return NULL;
  }
  c->all_next = peers->inflight;
  if (peers->inflight)
    peers->inflight->all_prev = c;
  peers->inflight = c;
  return c;
}

/* The membership's actions: a Join or a Heartbeat to a host. */
bool fsdp_peers_send_join(void *data, unsigned host_rank) {
  fsdp_peers_t *peers = data;
  Fsdp__V1__JoinRequest rq = FSDP__V1__JOIN_REQUEST__INIT;
  Fsdp__V1__Setting *settings[N_SETTINGS];
  for (size_t i = 0; i < N_SETTINGS; i++)
    settings[i] = &peers->settings[i];
  rq.protocol_version = FSDP_PROTOCOL_VERSION;
  rq.host_rank = peers->self;
  rq.n_settings = N_SETTINGS;
  rq.settings = settings;
  rq.ucx_worker_address.data = peers->local_ucx;
  rq.ucx_worker_address.len = peers->local_ucx_len;
  rq.incarnation = peers->incarnation;
  return start_call(peers, &peers->peers[host_rank], CALL_JOIN, &rq.base, peers->timeout_ms) !=
         NULL;
}

bool fsdp_peers_send_heartbeat(void *data, unsigned host_rank) {
  fsdp_peers_t *peers = data;
  Fsdp__V1__HeartbeatRequest rq = FSDP__V1__HEARTBEAT_REQUEST__INIT;
  rq.host_rank = peers->self;
  rq.incarnation = peers->incarnation;
  rq.sent_ns = uv_hrtime();
  pcall_t *c = start_call(peers, &peers->peers[host_rank], CALL_HEARTBEAT, &rq.base,
                          peers->timeout_ms);
  if (c)
    c->sent_ns = rq.sent_ns;
  return c != NULL;
}

/* A call's failure in words: "Join: UNAVAILABLE: <details>". */
static void describe_failure(const pcall_t *c, char *buf, size_t size) {
  const char *path = method_path(c->kind), *name = strrchr(path, '/') + 1;
  int len = (int)GRPC_SLICE_LENGTH(c->details);
  snprintf(buf, size, "%s: %s: %.*s", name, fsdp_wire_status_name(c->status), len,
           (const char *)GRPC_SLICE_START_PTR(c->details));
}

/* Our Join failed (refused: by the host, or its reply did not pass), with why in words. */
void fsdp_peers_join_failed(fsdp_peers_t *peers, peer_t *p, bool refused, const char *fmt, ...) {
  char why[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  fsdp_membership_join_failed(peers->m, p->rank, now_ms(peers), refused, why);
}

/* The reply to our Join, from the host's own cluster.hosts entry: what it says (its
 * incarnation, its address) is what relationships with the host go by. */
static bool take_join_reply(fsdp_peers_t *peers, peer_t *p, const pcall_t *c) {
  ProtobufCMessage *msg;
  fsdp_status_t st;
  if (fsdp_wire_decode(&fsdp__v1__join_reply__descriptor, c->recv, &msg, &st) < 0) {
    fsdp_peers_join_failed(peers, p, true, "Join: bad reply: %s", st.message);
    return false;
  }
  const Fsdp__V1__JoinReply *reply = (const void *)msg;
  if (fsdp_peer_check_join_reply(&peers->rules, p->rank, p->m->address, reply, &st) < 0) {
    protobuf_c_message_free_unpacked(msg, NULL);
    fsdp_peers_join_failed(peers, p, true, "Join: %s", st.message);
    return false;
  }
  fsdp_membership_join_replied(peers->m, p->rank, now_ms(peers), reply->incarnation);
  int r = fsdp_address_copy(&p->reply_ucx, &p->reply_ucx_len, reply->ucx_worker_address.data,
                            reply->ucx_worker_address.len);
  protobuf_c_message_free_unpacked(msg, NULL);
  if (r < 0) {
    fsdp_peers_join_failed(peers, p, false, "Join: out of memory for its data-plane address");
    return false;
  }
  if (fsdp_peers_address_verified(p, p->reply_ucx, p->reply_ucx_len)) {
    fsdp_membership_join_accepted(peers->m, p->rank, now_ms(peers), p->reply_ucx,
                                  p->reply_ucx_len);
    return true;
  }
  /* Joined once its address passed (on_check_done); no other Join meanwhile. */
  fsdp_peers_check_reply_address(peers, p);
  return true;
}

static void on_join_done(fsdp_peers_t *peers, peer_t *p, pcall_t *c) {
  if (leaving(peers))
    return;
  if (c->status != GRPC_STATUS_OK) {
    bool refused = c->status == GRPC_STATUS_FAILED_PRECONDITION ||
                   c->status == GRPC_STATUS_UNAUTHENTICATED ||
                   c->status == GRPC_STATUS_PERMISSION_DENIED ||
                   c->status == GRPC_STATUS_INVALID_ARGUMENT ||
                   c->status == GRPC_STATUS_ALREADY_EXISTS;
    char failure[512];
    describe_failure(c, failure, sizeof failure);
    if (refused)
      fsdp_membership_join_failed(peers->m, p->rank, now_ms(peers), true, failure);
    else
      fsdp_membership_join_unreachable(peers->m, p->rank, now_ms(peers), failure);
    char why[700];
    int len = (int)GRPC_SLICE_LENGTH(c->details);
    snprintf(why, sizeof why, "%s %.*s", fsdp_wire_status_name(c->status), len,
             (const char *)GRPC_SLICE_START_PTR(c->details));
    fsdp_peers_confirmations_done(peers, p, why);
    return;
  }
  bool ok = take_join_reply(peers, p, c);
  fsdp_peers_confirmations_done(peers, p, ok ? NULL : p->m->last_error);
}

static void on_heartbeat_done(fsdp_peers_t *peers, peer_t *p, pcall_t *c) {
  if (c->status == GRPC_STATUS_FAILED_PRECONDITION) {
    /* It no longer counts us as joined (it restarted, or lost us): join again. */
    char why[600];
    int len = (int)GRPC_SLICE_LENGTH(c->details);
    snprintf(why, sizeof why, "it no longer counts this host as joined: %.*s", len,
             (const char *)GRPC_SLICE_START_PTR(c->details));
    fsdp_membership_heartbeat_refused(peers->m, p->rank, now_ms(peers), why);
    return;
  }
  char why[600];
  if (c->status != GRPC_STATUS_OK) {
    describe_failure(c, why, sizeof why);
    fsdp_membership_heartbeat_failed(peers->m, p->rank, why);
    return;
  }
  ProtobufCMessage *msg;
  fsdp_status_t st;
  if (fsdp_wire_decode(&fsdp__v1__heartbeat_reply__descriptor, c->recv, &msg, &st) < 0) {
    snprintf(why, sizeof why, "Heartbeat: bad reply: %s", st.message);
    fsdp_membership_heartbeat_failed(peers->m, p->rank, why);
    return;
  }
  const Fsdp__V1__HeartbeatReply *reply = (const void *)msg;
  int r = fsdp_peer_check_heartbeat_reply(&peers->rules, p->rank, reply, &st);
  uint64_t incarnation = reply->incarnation;
  protobuf_c_message_free_unpacked(msg, NULL);
  if (r < 0) {
    snprintf(why, sizeof why, "Heartbeat: %s", st.message);
    fsdp_membership_heartbeat_failed(peers->m, p->rank, why);
    return;
  }
  fsdp_membership_heartbeat_answered(peers->m, p->rank, now_ms(peers), incarnation,
                                     (uv_hrtime() - c->sent_ns) / 1000);
}

/* A recovery's Recover: its caller hears the answer, or the status naming the host. */
static void on_recover_done(pcall_t *c) {
  fsdp_status_t st = {0};
  ProtobufCMessage *msg = NULL;
  fsdp_peers_recovered_t answer = {0};
  if (c->status != GRPC_STATUS_OK) {
    char failure[512];
    describe_failure(c, failure, sizeof failure);
    fsdp_status_set(&st, fsdp_wire_error_from_status(c->status), "host %u (%s): %s",
                    c->peer->rank, c->peer->m->address, failure);
  } else if (fsdp_wire_decode(&fsdp__v1__recover_reply__descriptor, c->recv, &msg, &st) < 0) {
    fsdp_status_t bad = st;
    fsdp_status_set(&st, FSDP_E_UNAVAILABLE, "host %u (%s): Recover: bad reply: %s",
                    c->peer->rank, c->peer->m->address, bad.message);
  } else {
    const Fsdp__V1__RecoverReply *reply = (const void *)msg;
    answer = (fsdp_peers_recovered_t){reply->step, reply->bytes, reply->xxh64};
    protobuf_c_message_free_unpacked(msg, NULL);
  }
  c->done(c->done_data, st.code < 0 ? &st : NULL, &answer);
}

int fsdp_peers_recover(fsdp_peers_t *peers, unsigned host_rank, const fsdp_peers_recover_t *ask,
                       uint64_t deadline_ms, fsdp_peers_recover_fn done, void *data,
                       fsdp_status_t *st) {
  if (host_rank >= peers->n || host_rank == peers->self)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "Recover: host %u is not a peer",
                           host_rank);
  if (leaving(peers))
    return fsdp_status_set(st, FSDP_E_CANCELLED, "Recover: the daemon is stopping");
  Fsdp__V1__RecoverUnit *units = calloc(ask->n_units ? ask->n_units : 1, sizeof *units);
  Fsdp__V1__RecoverUnit **ptrs = calloc(ask->n_units ? ask->n_units : 1, sizeof *ptrs);
  pcall_t *c = NULL;
  if (units && ptrs) {
    for (size_t i = 0; i < ask->n_units; i++) {
      const fsdp_peers_recover_unit_t *u = &ask->units[i];
      fsdp__v1__recover_unit__init(&units[i]);
      units[i].name = (char *)u->name;
      units[i].numel = u->numel;
      units[i].shard_numel = u->shard_numel;
      units[i].host_first_shard = u->host_first_shard;
      units[i].host_shards = u->host_shards;
      units[i].optimizer_arrays = u->optimizer_arrays;
      ptrs[i] = &units[i];
    }
    Fsdp__V1__RecoverRequest rq = FSDP__V1__RECOVER_REQUEST__INIT;
    rq.host_rank = peers->self;
    rq.incarnation = peers->incarnation;
    rq.job = (char *)ask->job;
    rq.uid = ask->uid;
    rq.fetch = ask->fetch;
    rq.step = ask->step;
    rq.bytes = ask->bytes;
    rq.n_units = ask->n_units;
    rq.units = ptrs;
    c = start_call(peers, &peers->peers[host_rank], CALL_RECOVER, &rq.base, deadline_ms);
  }
  free(ptrs);
  free(units);
  if (!c)
    return fsdp_status_set(st, FSDP_E_INTERNAL, "Recover to host %u could not start", host_rank);
  c->done = done;
  c->done_data = data;
  return 0;
}

static void on_call_done(fsdp_peers_t *peers, pcall_t *c) {
  if (c->all_prev)
    c->all_prev->all_next = c->all_next;
  else
    peers->inflight = c->all_next;
  if (c->all_next)
    c->all_next->all_prev = c->all_prev;
  if (!c->success)
    c->status = GRPC_STATUS_UNKNOWN; /* only API misuse; treat as a failed call */
  peer_t *p = c->peer;
  switch (c->kind) {
  case CALL_JOIN:
    on_join_done(peers, p, c);
    break;
  case CALL_HEARTBEAT:
    on_heartbeat_done(peers, p, c);
    break;
  case CALL_LEAVE:
    if (c->status != GRPC_STATUS_OK)
      log_warning("peers: Leave to host %u (%s): %s", p->rank, p->m->address,
                  fsdp_wire_status_name(c->status));
    break;
  case CALL_RECOVER:
    on_recover_done(c);
    break;
  }
  pcall_free(c);
}

/* The bridge's events: each is a call that completed. */
static void on_call_event(void *data, void *tag, bool success) {
  pcall_t *c = tag;
  c->success = success;
  on_call_done(data, c);
}

static void on_calls_drained(void *data) {
  fsdp_peers_maybe_finish_close(data);
}

/* A channel to every peer, TLS when the peer.* keys say so. */
static int open_channels(fsdp_peers_t *peers, fsdp_status_t *st) {
  const fsdp_peer_security_t *sec = peers->sec;
  grpc_arg args[] = {
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, {.integer = 4 << 20}},
      {GRPC_ARG_INTEGER, GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, {.integer = 100}},
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, {.integer = 1000}},
      /* A proxy in the environment must not sit between daemons. */
      {GRPC_ARG_INTEGER, GRPC_ARG_ENABLE_HTTP_PROXY, {.integer = 0}},
      /* Each peer's connection backs off on its own, not shared by address. */
      {GRPC_ARG_INTEGER, GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, {.integer = 1}},
  };
  grpc_channel_args channel_args = {sizeof args / sizeof args[0], args};
  for (unsigned i = 0; i < peers->n; i++) {
    if (i == peers->self)
      continue;
    grpc_channel_credentials *creds;
    if (sec->tls_cert) {
      grpc_ssl_pem_key_cert_pair pair = {sec->tls_key, sec->tls_cert};
      creds = grpc_ssl_credentials_create(sec->tls_ca, &pair, NULL, NULL);
    } else {
      creds = grpc_insecure_credentials_create();
    }
    peers->peers[i].channel = grpc_channel_create(peers->peers[i].m->address, creds,
                                                  &channel_args);
    grpc_channel_credentials_release(creds);
    if (!peers->peers[i].channel)
      return fsdp_status_set(st, FSDP_E_CONFIG, "key 'cluster.hosts': cannot make a channel to "
                                                "'%s'", peers->peers[i].m->address);
  }
  return 0;
}

int fsdp_peers_client_open(fsdp_peers_t *peers, fsdp_status_t *st) {
  const fsdp_peer_security_t *sec = peers->sec;
  if (sec->token) {
    size_t len = strlen(sec->token) + sizeof "Bearer ";
    if (!(peers->auth_value = malloc(len)))
      return fsdp_status_set(st, -ENOMEM, "out of memory for the peer table");
    snprintf(peers->auth_value, len, "Bearer %s", sec->token);
  }
  grpc_init();
  peers->grpc_initialized = true;
  if (fsdp_cq_bridge_new(peers->loop,
                         &(fsdp_cq_bridge_ops_t){.on_event = on_call_event,
                                                 .on_drained = on_calls_drained},
                         peers, &peers->bridge) < 0)
    return fsdp_status_set(st, -ENOMEM, "out of memory for the peer table");
  return open_channels(peers, st);
}

void fsdp_peers_client_free(fsdp_peers_t *peers) {
  for (unsigned i = 0; peers->peers && i < peers->n; i++)
    if (peers->peers[i].channel)
      grpc_channel_destroy(peers->peers[i].channel);
  fsdp_cq_bridge_free(peers->bridge);
  if (peers->grpc_initialized)
    grpc_shutdown();
  fsdp_peer_secret_free(&peers->auth_value);
}

unsigned fsdp_peers_send_leave(fsdp_peers_t *peers, const char *why) {
  Fsdp__V1__LeaveRequest rq = FSDP__V1__LEAVE_REQUEST__INIT;
  rq.host_rank = peers->self;
  rq.incarnation = peers->incarnation;
  rq.reason = (char *)why;
  uint64_t deadline = peers->timeout_ms < LEAVE_DEADLINE_MAX_MS ? peers->timeout_ms
                                                                : LEAVE_DEADLINE_MAX_MS;
  unsigned sent = 0;
  for (unsigned i = 0; i < peers->n; i++) {
    peer_t *p = &peers->peers[i];
    if (i == peers->self || !(p->m->in || p->m->out))
      continue;
    if (start_call(peers, p, CALL_LEAVE, &rq.base, deadline))
      sent++;
  }
  return sent;
}

void fsdp_peers_cancel_calls(fsdp_peers_t *peers) {
  for (pcall_t *c = peers->inflight; c; c = c->all_next)
    if (c->kind != CALL_LEAVE)
      grpc_call_cancel(c->call, NULL);
}
