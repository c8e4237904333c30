/* Operator.Status: one reply that tells the whole daemon (its version, config, listeners,
 * topology and peers, sessions, jobs and their memory, RPC counters), built from storage
 * that its messages point into. Apart from the other Operator handlers because it reads every
 * part of the daemon and changes none. */
#include "daemon/services/operator_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "fsdp/v1/operator.pb-c.h"

#include <fsdp/fsdp_version.h>

#include "daemon/dataplane/optimizer.h"
#include "daemon/services/calls.h"
#include "daemon/services/context.h"
#include "daemon/services/peer_service.h"

static Fsdp__V1__ConfigSource source_to_proto(fsdp_config_source_t source) {
  switch (source) {
  case FSDP_SOURCE_DEFAULT:
    return FSDP__V1__CONFIG_SOURCE__CONFIG_SOURCE_DEFAULT;
  case FSDP_SOURCE_FILE:
    return FSDP__V1__CONFIG_SOURCE__CONFIG_SOURCE_FILE;
  case FSDP_SOURCE_ENV:
    return FSDP__V1__CONFIG_SOURCE__CONFIG_SOURCE_ENV;
  case FSDP_SOURCE_FLAG:
    return FSDP__V1__CONFIG_SOURCE__CONFIG_SOURCE_FLAG;
  }
  return FSDP__V1__CONFIG_SOURCE__CONFIG_SOURCE_UNSPECIFIED;
}

/* Storage for one Status reply, which its protobuf-c messages point into: one block for the
 * fixed parts and an array for each table that grows with the daemon, rather than an
 * allocation per field. */
typedef struct status_storage {
  Fsdp__V1__ConfigEntry entries[FSDP_OPTION_COUNT];
  Fsdp__V1__ConfigEntry *entry_ptrs[FSDP_OPTION_COUNT];
  char values[FSDP_OPTION_COUNT][256];
  Fsdp__V1__Listener listeners[4];
  Fsdp__V1__Listener *listener_ptrs[4];
  char addresses[2][sizeof(((fsdp_listener_t *)0)->socket_path) + 8];
  char *local_services[FSDP_SERVICE_LOCAL_COUNT];
  char *health_services[1];
  char *peer_services[2];
  char *metrics_services[1];
  fsdp_peer_status_t *peers;
  Fsdp__V1__Topology topology;
  Fsdp__V1__Memory memory;
  Fsdp__V1__Session *sessions; /* session.max_sessions may be large: sized per reply */
  Fsdp__V1__Session **session_ptrs;
  Fsdp__V1__JobMemory *jobs;
  Fsdp__V1__JobMemory **job_ptrs;
  Fsdp__V1__Pool *pools; /* per job: its copies, its host sums, each local rank's gradients */
  Fsdp__V1__Pool **pool_ptrs;
} status_storage_t;

static Fsdp__V1__Pool *fill_pool(Fsdp__V1__Pool *p, const fsdp_pool_t *pool) {
  fsdp__v1__pool__init(p);
  p->buffers = pool->n_buffers;
  for (unsigned i = 0; i < pool->n_buffers; i++)
    p->bytes += pool->buffers[i].bytes;
  p->lent = pool->n_lent;
  p->most_lent = pool->most_lent;
  p->waits = pool->n_waits;
  return p;
}

/* Per-job memory; returns the bytes in use over all jobs, or -ENOMEM. */
static int64_t fill_jobs(fsdp_services_context_t *ctx, Fsdp__V1__StatusReply *reply,
                         status_storage_t *s) {
  unsigned n = ctx->store->n_jobs;
  size_t n_pools = 0;
  for (const fsdp_job_t *j = ctx->store->jobs; j; j = j->next)
    n_pools += 2 + j->local_world_size;
  s->jobs = calloc(n ? n : 1, sizeof *s->jobs);
  s->job_ptrs = calloc(n ? n : 1, sizeof *s->job_ptrs);
  s->pools = calloc(n_pools ? n_pools : 1, sizeof *s->pools);
  s->pool_ptrs = calloc(n_pools ? n_pools : 1, sizeof *s->pool_ptrs);
  if (!s->jobs || !s->job_ptrs || !s->pools || !s->pool_ptrs)
    return -ENOMEM;
  int64_t in_use = 0;
  size_t i = 0, pool = 0;
  for (const fsdp_job_t *j = ctx->store->jobs; j; j = j->next, i++) {
    Fsdp__V1__JobMemory *m = &s->jobs[i];
    fsdp__v1__job_memory__init(m);
    m->job = (char *)j->name;
    m->units = j->n_units;
    m->local_world_size = j->local_world_size;
    m->max_inflight = j->max_inflight;
    m->forward_prefetch = j->flight->forward_prefetch;
    m->backward_prefetch = j->flight->backward_prefetch;
    m->order_given = j->flight->order_given;
    m->copies = fill_pool(&s->pools[pool++], &j->copies);
    m->sums = fill_pool(&s->pools[pool++], &j->sums);
    m->optimizer = (char *)fsdp_optimizer_kind_name(j);
    m->optimizer_bytes = fsdp_optimizer_state_bytes(j);
    fsdp_checkpoints_job_info_t saved;
    fsdp_checkpoints_job_info(j, &saved);
    m->checkpoint_staging_bytes = saved.staging_bytes;
    m->last_checkpoint_step = saved.last_step;
    m->last_checkpoint_path = (char *)saved.last_path;
    m->checkpoint_state = (char *)fsdp_checkpoints_save_state(ctx->checkpoints, j);
    size_t staging_bytes;
    fsdp_staging_count(&j->staging, &m->ring_staging_buffers, &staging_bytes);
    m->ring_staging_bytes = staging_bytes;
    m->gradients = &s->pool_ptrs[pool];
    m->n_gradients = j->local_world_size;
    for (uint32_t r = 0; r < j->local_world_size; r++, pool++)
      s->pool_ptrs[pool] = fill_pool(&s->pools[pool], &j->grad_pools[r]);
    const fsdp_arena_t *arenas[2] = {j->arena, j->shared_arena};
    for (size_t k = 0; k < 2 && arenas[k]; k++) {
      fsdp_arena_stats_t stats;
      fsdp_arena_get_stats(arenas[k], &stats);
      m->arena_bytes += stats.capacity;
      m->used_bytes += stats.used;
      in_use += (int64_t)stats.used;
    }
    s->job_ptrs[i] = m;
  }
  reply->n_jobs = n;
  reply->jobs = s->job_ptrs;
  return in_use;
}

static int fill_sessions(fsdp_services_context_t *ctx, Fsdp__V1__StatusReply *reply,
                         status_storage_t *s) {
  unsigned n = ctx->sessions->count;
  s->sessions = calloc(n ? n : 1, sizeof *s->sessions);
  s->session_ptrs = calloc(n ? n : 1, sizeof *s->session_ptrs);
  if (!s->sessions || !s->session_ptrs)
    return -ENOMEM;
  uint64_t now = fsdp_services_now_ms(ctx);
  size_t i = 0;
  for (const fsdp_session_t *ses = ctx->sessions->head; ses; ses = ses->next, i++) {
    Fsdp__V1__Session *out = &s->sessions[i];
    fsdp__v1__session__init(out);
    out->session_id = ses->id;
    out->job = (char *)ses->job;
    out->local_rank = ses->local_rank;
    out->local_world_size = ses->local_world_size;
    out->generation = ses->generation;
    out->pid = ses->pid;
    out->uid = ses->owner.uid;
    out->attached_ms = now - ses->attached_ms;
    out->idle_ms = ses->parked ? 0 : now - ses->last_call_ms;
    s->session_ptrs[i] = out;
  }
  reply->n_sessions = n;
  reply->sessions = s->session_ptrs;
  return 0;
}

static void fill_config(fsdp_services_context_t *ctx, Fsdp__V1__StatusReply *reply,
                        status_storage_t *s) {
  for (int id = 0; id < FSDP_OPTION_COUNT; id++) {
    const fsdp_option_t *opt = fsdp_option_get((fsdp_option_id_t)id);
    const fsdp_config_value_t *v = &ctx->config->values[id];
    Fsdp__V1__ConfigEntry *e = &s->entries[id];
    fsdp__v1__config_entry__init(e);
    fsdp_config_format(ctx->config, (fsdp_option_id_t)id, s->values[id], sizeof s->values[id]);
    e->key = (char *)opt->key;
    e->value = s->values[id];
    /* The table spells defaults canonically (a config test holds it to that). */
    e->default_value = (char *)opt->default_value;
    e->source = source_to_proto(v->source);
    e->origin = (char *)v->origin;
    e->reloadable = opt->reloadable;
    e->unit = (char *)(opt->unit ? opt->unit : "");
    e->help = (char *)opt->help;
    s->entry_ptrs[id] = e;
  }
  reply->n_config = FSDP_OPTION_COUNT;
  reply->config = s->entry_ptrs;
}

static void fill_listeners(fsdp_services_context_t *ctx, Fsdp__V1__StatusReply *reply,
                           status_storage_t *s) {
  size_t n = 0;
  for (int i = 0; i < FSDP_SERVICE_LOCAL_COUNT; i++)
    s->local_services[i] = (char *)ctx->services[i].descriptor->name;
  s->health_services[0] = (char *)ctx->services[FSDP_SERVICE_HEALTH].descriptor->name;

  fsdp__v1__listener__init(&s->listeners[n]);
  snprintf(s->addresses[n], sizeof s->addresses[n], "unix:%s", ctx->listener->socket_path);
  s->listeners[n].address = s->addresses[n];
  s->listeners[n].n_services = FSDP_SERVICE_LOCAL_COUNT;
  s->listeners[n].services = s->local_services;
  n++;
  if (ctx->health_address[0]) {
    fsdp__v1__listener__init(&s->listeners[n]);
    s->listeners[n].address = (char *)ctx->health_address;
    s->listeners[n].n_services = 1;
    s->listeners[n].services = s->health_services;
    n++;
  }
  if (ctx->peer_address[0]) {
    s->peer_services[0] = (char *)ctx->services[FSDP_SERVICE_PEER].descriptor->name;
    s->peer_services[1] = s->health_services[0];
    fsdp__v1__listener__init(&s->listeners[n]);
    s->listeners[n].address = (char *)ctx->peer_address;
    s->listeners[n].n_services = 2;
    s->listeners[n].services = s->peer_services;
    n++;
  }
  if (ctx->metrics_address && ctx->metrics_address[0]) { /* HTTP, not gRPC */
    s->metrics_services[0] = "metrics";
    fsdp__v1__listener__init(&s->listeners[n]);
    s->listeners[n].address = (char *)ctx->metrics_address;
    s->listeners[n].n_services = 1;
    s->listeners[n].services = s->metrics_services;
    n++;
  }
  for (size_t i = 0; i < n; i++)
    s->listener_ptrs[i] = &s->listeners[i];
  reply->n_listeners = n;
  reply->listeners = s->listener_ptrs;
}

static Fsdp__V1__ServingState serving_state(fsdp_services_state_t state) {
  switch (state) {
  case FSDP_SERVICES_SERVING:
    return FSDP__V1__SERVING_STATE__SERVING_STATE_SERVING;
  case FSDP_SERVICES_DRAINING:
    return FSDP__V1__SERVING_STATE__SERVING_STATE_DRAINING;
  case FSDP_SERVICES_STOPPING:
    break;
  }
  return FSDP__V1__SERVING_STATE__SERVING_STATE_STOPPING;
}

void fsdp_operator_status(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  (void)request;
  fsdp_services_context_t *ctx = data;
  status_storage_t *s = calloc(1, sizeof *s);
  if (!s) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "out of memory building the status");
    return;
  }
  Fsdp__V1__StatusReply reply = FSDP__V1__STATUS_REPLY__INIT;
  reply.version = FSDP_VERSION_STRING;
  reply.protocol_version = FSDP_PROTOCOL_VERSION;
  reply.uptime_ms = fsdp_services_now_ms(ctx) - ctx->started_ms;
  reply.pid = (int32_t)getpid();
  reply.config_file = ctx->config->file ? ctx->config->file : "";
  fill_config(ctx, &reply, s);
  fill_listeners(ctx, &reply, s);
  reply.backend = (char *)fsdp_backend_name(&ctx->dataplane->backend);
  fsdp__v1__topology__init(&s->topology);
  reply.topology = &s->topology;
  if (fsdp_peer_status_fill(ctx, &s->topology, &reply, &s->peers) < 0 ||
      fill_sessions(ctx, &reply, s) < 0) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "out of memory building the status");
    goto out;
  }
  int64_t in_use = fill_jobs(ctx, &reply, s);
  if (in_use < 0) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "out of memory building the status");
    goto out;
  }
  fsdp__v1__memory__init(&s->memory);
  s->memory.in_use_bytes = (uint64_t)in_use;
  s->memory.reserved_bytes = ctx->store->reserved;
  s->memory.limit_bytes = (uint64_t)fsdp_config_number(ctx->config, FSDP_OPTION_MEMORY_LIMIT);
  reply.memory = &s->memory;
  reply.state = serving_state(ctx->lifecycle.state(ctx->lifecycle.data));
  fsdp_rpc_stats_t stats;
  fsdp_rpc_server_get_stats(ctx->rpc, &stats);
  reply.rpc_calls_total = stats.calls_total;
  reply.rpc_calls_failed = stats.calls_failed;
  reply.rpc_calls_inflight = stats.calls_inflight;
  reply.rpc_work_inflight = stats.work_inflight;
  fsdp_rpc_call_reply(call, &reply.base);
out:
  fsdp_peer_status_free(s->peers);
  free(s->sessions);
  free(s->session_ptrs);
  free(s->jobs);
  free(s->job_ptrs);
  free(s->pools);
  free(s->pool_ptrs);
  free(s);
}
