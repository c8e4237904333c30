/* Peer.Join, Heartbeat, Leave and Recover, handed to the peer table, which checks them
 * (daemon/cluster/peer_check.h) before anything else. Every refusal names the method, the field and
 * the value; a Join refused for its settings names the key and both hosts' values. */
#include "daemon/services/peer_service.h"

#include <errno.h>
#include <stdlib.h>

#include "fsdp/v1/peer.pb-c.h"
#include "common/log.h"
#include "daemon/cluster/peers.h"
#include "daemon/services/calls.h"

static void on_join_answer(void *data, const fsdp_status_t *st,
                           const Fsdp__V1__JoinReply *reply) {
  fsdp_rpc_call_t *call = data;
  if (st)
    fsdp_services_fail_call(call, st);
  else
    fsdp_rpc_call_reply(call, &reply->base);
}

static void on_join_cancel(fsdp_rpc_call_t *call, void *data) {
  (void)call;
  fsdp_peers_join_cancel(data);
}

/* A Join may be answered later: while its data-plane address is checked, or its host's own
 * address asked to confirm it (peers.h). */
static void peer_join(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  fsdp_services_context_t *ctx = data;
  char from[96];
  fsdp_rpc_call_peer_name(call, from, sizeof from);
  fsdp_peers_join_t *join = fsdp_peers_accept_join(ctx->peers, (const void *)request, from,
                                                   on_join_answer, call);
  if (join)
    fsdp_rpc_call_on_cancel(call, on_join_cancel, join);
}

static void peer_heartbeat(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  fsdp_services_context_t *ctx = data;
  Fsdp__V1__HeartbeatReply reply = FSDP__V1__HEARTBEAT_REPLY__INIT;
  fsdp_status_t st;
  if (fsdp_peers_accept_heartbeat(ctx->peers, (const void *)request, &reply, &st) < 0) {
    fsdp_services_fail_call(call, &st);
    return;
  }
  fsdp_rpc_call_reply(call, &reply.base);
}

static void peer_leave(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  fsdp_services_context_t *ctx = data;
  Fsdp__V1__LeaveReply reply = FSDP__V1__LEAVE_REPLY__INIT;
  fsdp_status_t st;
  if (fsdp_peers_accept_leave(ctx->peers, (const void *)request, &st) < 0) {
    fsdp_services_fail_call(call, &st);
    return;
  }
  fsdp_rpc_call_reply(call, &reply.base);
}

/* A Recover that fetches is answered once the job's state is sent; the answer goes only
 * if the caller still waits. */
typedef struct recover_call {
  fsdp_rpc_call_t *call; /* NULL once cancelled */
  fsdp_checkpoints_t *checkpoints;
} recover_call_t;

static void on_recover_cancel(fsdp_rpc_call_t *call, void *data) {
  (void)call;
  recover_call_t *rc = data;
  rc->call = NULL;
  fsdp_checkpoints_abandon_send(rc->checkpoints, rc);
}

static void reply_recovered(fsdp_rpc_call_t *call, const fsdp_peers_recovered_t *answer) {
  Fsdp__V1__RecoverReply reply = FSDP__V1__RECOVER_REPLY__INIT;
  reply.step = answer->step;
  reply.bytes = answer->bytes;
  reply.xxh64 = answer->xxh64;
  fsdp_rpc_call_reply(call, &reply.base);
}

static void on_recover_sent(void *data, const fsdp_status_t *st,
                            const fsdp_peers_recovered_t *answer) {
  recover_call_t *rc = data;
  if (rc->call && st)
    fsdp_services_fail_call(rc->call, st);
  else if (rc->call)
    reply_recovered(rc->call, answer);
  free(rc);
}

/* A host that started empty asks for a job's state (daemon/checkpoints/replicas.c). */
static void peer_recover(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  fsdp_services_context_t *ctx = data;
  const Fsdp__V1__RecoverRequest *rq = (const void *)request;
  fsdp_peers_recover_t ask;
  fsdp_peers_recover_unit_t *units;
  fsdp_status_t st;
  recover_call_t *rc = NULL;
  fsdp_job_t *job = fsdp_store_find_job(ctx->store, rq->job);
  if (fsdp_peers_accept_recover(ctx->peers, rq, &ask, &units, &st) < 0) {
    fsdp_services_fail_call(call, &st);
  } else if (!ask.fetch) {
    fsdp_peers_recovered_t answer = {0};
    if (fsdp_checkpoints_replica_step(ctx->checkpoints, job, &ask, &answer.step, &st) < 0)
      fsdp_services_fail_call(call, &st);
    else
      reply_recovered(call, &answer);
  } else if (!(rc = malloc(sizeof *rc))) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "Recover: out of memory");
  } else if ((*rc = (recover_call_t){call, ctx->checkpoints},
              fsdp_checkpoints_send_to_replica(ctx->checkpoints, job, &ask, on_recover_sent, rc,
                                               &st)) < 0) {
    free(rc);
    fsdp_services_fail_call(call, &st);
  } else {
    fsdp_rpc_call_on_cancel(call, on_recover_cancel, rc);
  }
  free(units);
}

/* Join is work a drain refuses: a draining daemon takes no new peer. Heartbeat and Leave are
 * served while draining, so that a drain for maintenance does not make the peers count this
 * host as lost, and a stopping host still hears the others leave; Recover too, for a job
 * this host serves already. */
static const fsdp_rpc_handler_t peer_handlers[] = {
    {"Join", peer_join, false},
    {"Heartbeat", peer_heartbeat, true},
    {"Leave", peer_leave, true},
    {"Recover", peer_recover, true},
};

fsdp_rpc_service_t fsdp_peer_service(fsdp_services_context_t *ctx) {
  return (fsdp_rpc_service_t){&fsdp__v1__peer__descriptor, peer_handlers,
                              sizeof peer_handlers / sizeof peer_handlers[0], ctx};
}

struct fsdp_peer_status {
  Fsdp__V1__PeerStatus *rows;
  Fsdp__V1__PeerStatus **ptrs;
};

static Fsdp__V1__PeerState state_to_proto(fsdp_peer_state_t state) {
  switch (state) {
  case FSDP_PEER_SELF:
    return FSDP__V1__PEER_STATE__PEER_STATE_SELF;
  case FSDP_PEER_JOINING:
    return FSDP__V1__PEER_STATE__PEER_STATE_JOINING;
  case FSDP_PEER_JOINED:
    return FSDP__V1__PEER_STATE__PEER_STATE_JOINED;
  case FSDP_PEER_LOST:
    return FSDP__V1__PEER_STATE__PEER_STATE_LOST;
  case FSDP_PEER_LEFT:
    return FSDP__V1__PEER_STATE__PEER_STATE_LEFT;
  case FSDP_PEER_REFUSED:
    return FSDP__V1__PEER_STATE__PEER_STATE_REFUSED;
  }
  return FSDP__V1__PEER_STATE__PEER_STATE_UNSPECIFIED;
}

int fsdp_peer_status_fill(fsdp_services_context_t *ctx, Fsdp__V1__Topology *topology,
                          Fsdp__V1__StatusReply *reply, fsdp_peer_status_t **ret_storage) {
  const fsdp_peers_t *peers = ctx->peers;
  fsdp_peer_status_t *s = calloc(1, sizeof *s);
  *ret_storage = s;
  if (!s)
    return -ENOMEM;
  unsigned n = fsdp_peers_host_count(peers);
  topology->host_rank = fsdp_peers_host_rank(peers);
  topology->hosts = n;
  topology->local_world_size =
      (uint32_t)fsdp_config_number(ctx->config, FSDP_OPTION_CLUSTER_LOCAL_WORLD_SIZE);
  topology->shard_group_hosts =
      (uint32_t)fsdp_config_number(ctx->config, FSDP_OPTION_CLUSTER_SHARD_GROUP_HOSTS);
  topology->peers_ready = fsdp_peers_ready(peers);
  topology->incarnation = fsdp_peers_incarnation(peers);
  if (n == 1)
    return 0;
  s->rows = calloc(n, sizeof *s->rows);
  s->ptrs = calloc(n, sizeof *s->ptrs);
  if (!s->rows || !s->ptrs)
    return -ENOMEM;
  for (unsigned i = 0; i < n; i++) {
    fsdp_peer_info_t info;
    fsdp_peers_get(peers, i, &info);
    Fsdp__V1__PeerStatus *row = &s->rows[i];
    fsdp__v1__peer_status__init(row);
    row->host_rank = info.host_rank;
    row->address = (char *)info.address;
    row->state = state_to_proto(info.state);
    row->last_heard_ms = info.last_heard_ms;
    row->rtt_us = info.rtt_us;
    row->incarnation = info.incarnation;
    row->last_error = (char *)info.last_error;
    row->ucx_address_bytes = (uint32_t)info.ucx_address_len;
    s->ptrs[i] = row;
  }
  reply->n_peers = n;
  reply->peers = s->ptrs;
  return 0;
}

void fsdp_peer_status_free(fsdp_peer_status_t *storage) {
  if (!storage)
    return;
  free(storage->rows);
  free(storage->ptrs);
  free(storage);
}
