/* The Operator service's handlers that change the daemon (ReloadConfig, Drain, Resume, Save
 * and LoadCheckpoint; Status is in operator_status.c, ListUnits and DescribeUnit in
 * operator_units.c), the memory channel's callbacks, and the table of every service. The
 * Trainer service is in trainer_service.c, the Peer service in peer_service.c. */
#include "daemon/services/services.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fsdp/v1/operator.pb-c.h"

#include "common/log.h"
#include "daemon/services/calls.h"
#include "daemon/services/fastpath.h"
#include "daemon/services/operator_internal.h"
#include "daemon/services/peer_service.h"
#include "daemon/services/trainer_service.h"
#include "proto/fastpath.h"

/* Operator methods that change the daemon's state are for its operators only (root, the
 * daemon's uid, daemon.operator_group); the socket lets in the whole group, trainers
 * included. Returns false after failing the call. */
static bool operator_only(fsdp_rpc_call_t *call, fsdp_services_context_t *ctx) {
  fsdp_credentials_t cred;
  const fsdp_credentials_t *who = fsdp_services_caller(ctx, call, &cred);
  if (who && ctx->lifecycle.is_operator(ctx->lifecycle.data, fsdp_rpc_call_peer_fd(call), who))
    return true;
  const char *group = fsdp_config_text(ctx->config, FSDP_OPTION_OPERATOR_GROUP);
  fsdp_rpc_call_fail(call, FSDP_E_PERMISSION_DENIED,
                     "%s: uid %u may not call it: it changes the daemon's state, which needs "
                     "root, the daemon's uid %u or a member of daemon.operator_group%s%s%s",
                     fsdp_rpc_call_method(call), who ? (unsigned)who->uid : (unsigned)-1,
                     (unsigned)geteuid(), group[0] ? " '" : " (not set)", group,
                     group[0] ? "'" : "");
  return false;
}

static void operator_reload(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  (void)request;
  fsdp_services_context_t *ctx = data;
  if (!operator_only(call, ctx))
    return;
  fsdp_option_id_t changed[FSDP_OPTION_COUNT];
  size_t n = 0;
  fsdp_status_t st;
  if (ctx->lifecycle.reload(ctx->lifecycle.data, changed, &n, &st) < 0) {
    log_error("reload requested over RPC failed, keeping the running config: %s", st.message);
    fsdp_rpc_call_fail(call, st.code, "%s; the running config is unchanged", st.message);
    return;
  }
  log_info("config reloaded over RPC: %zu value%s changed", n, n == 1 ? "" : "s");
  char *keys[FSDP_OPTION_COUNT];
  for (size_t i = 0; i < n; i++)
    keys[i] = (char *)fsdp_option_get(changed[i])->key;
  Fsdp__V1__ReloadConfigReply reply = FSDP__V1__RELOAD_CONFIG_REPLY__INIT;
  reply.n_changed = n;
  reply.changed = keys;
  fsdp_rpc_call_reply(call, &reply.base);
}

/* Drain and Resume; false after failing the call (the daemon is stopping). */
static bool set_draining(fsdp_rpc_call_t *call, fsdp_services_context_t *ctx, bool draining) {
  fsdp_status_t st;
  if (ctx->lifecycle.set_draining(ctx->lifecycle.data, draining, &st) < 0) {
    fsdp_rpc_call_fail_status(call, &st);
    return false;
  }
  return true;
}

static void operator_drain(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  (void)request;
  fsdp_services_context_t *ctx = data;
  if (!operator_only(call, ctx) || !set_draining(call, ctx, true))
    return;
  fsdp_rpc_stats_t stats;
  fsdp_rpc_server_get_stats(ctx->rpc, &stats);
  Fsdp__V1__DrainReply reply = FSDP__V1__DRAIN_REPLY__INIT;
  reply.work_inflight = stats.work_inflight;
  fsdp_rpc_call_reply(call, &reply.base);
}

static void operator_resume(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  (void)request;
  if (!operator_only(call, data) || !set_draining(call, data, false))
    return;
  Fsdp__V1__ResumeReply reply = FSDP__V1__RESUME_REPLY__INIT;
  fsdp_rpc_call_reply(call, &reply.base);
}

/* A checkpoint call while its work runs; call is NULL once the caller went away. */
typedef struct checkpoint_call {
  fsdp_rpc_call_t *call;
} checkpoint_call_t;

static void on_checkpoint_cancel(fsdp_rpc_call_t *call, void *data) {
  (void)call;
  ((checkpoint_call_t *)data)->call = NULL; /* the work goes on; its end is not answered */
}

static void on_checkpoint_done(void *data, const fsdp_status_t *st, const char *path,
                               uint64_t step) {
  checkpoint_call_t *c = data;
  if (c->call) {
    fsdp_rpc_call_on_cancel(c->call, NULL, NULL);
    if (st->code < 0) {
      fsdp_services_fail_call(c->call, st);
    } else {
      Fsdp__V1__CheckpointReply reply = FSDP__V1__CHECKPOINT_REPLY__INIT;
      reply.path = (char *)path;
      reply.step = step;
      fsdp_rpc_call_reply(c->call, &reply.base);
    }
  }
  free(c);
}

/* SaveCheckpoint and LoadCheckpoint: an operator's, or a trainer's of the job (its session),
 * into or from an absolute path, used with the caller's rights (or the daemon's in
 * checkpoint.dir/<job>/: fsdp_checkpoints_start). */
static void operator_checkpoint(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                                fsdp_services_context_t *ctx, bool load) {
  const Fsdp__V1__CheckpointRequest *rq = (const void *)request;
  const char *verb = load ? "LoadCheckpoint" : "SaveCheckpoint";
  if (rq->session_id) {
    fsdp_session_t *s = fsdp_services_use_session(call, ctx, rq->session_id);
    if (!s)
      return;
    if (strcmp(s->job, rq->job) != 0) {
      fsdp_rpc_call_fail(call, FSDP_E_PERMISSION_DENIED,
                         "%s: field 'job' = '%.256s': session %016llx is of job '%s'", verb,
                         rq->job, (unsigned long long)s->id, s->job);
      return;
    }
  } else if (!operator_only(call, ctx)) {
    return;
  }
  fsdp_job_t *job = fsdp_store_find_job(ctx->store, rq->job);
  if (!job) {
    fsdp_rpc_call_fail(call, FSDP_E_NOT_FOUND, "%s: field 'job' = '%.256s': no such job here",
                       verb, rq->job);
    return;
  }
  if (rq->path[0] != '/') {
    fsdp_rpc_call_fail(call, FSDP_E_INVALID_ARGUMENT,
                       "%s: field 'path' = '%.256s': expected an absolute path", verb, rq->path);
    return;
  }
  /* The caller's rights, not the daemon's, for the path it names. */
  fsdp_credentials_t cred;
  fsdp_checkpoints_caller_t asking = {.trainer = rq->session_id != 0};
  const fsdp_credentials_t *who = fsdp_services_caller(ctx, call, &cred);
  if (!who || fsdp_identity_of_peer(fsdp_rpc_call_peer_fd(call), who, &asking.as) < 0) {
    fsdp_rpc_call_fail(call, FSDP_E_PERMISSION_DENIED,
                       "%s: the caller's credentials cannot be read: its path is not used",
                       verb);
    return;
  }
  checkpoint_call_t *c = calloc(1, sizeof *c);
  if (!c) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "%s: out of memory", verb);
    return;
  }
  c->call = call;
  fsdp_status_t st;
  if (fsdp_checkpoints_start(ctx->checkpoints, job, rq->path, &asking, load, rq->step,
                             on_checkpoint_done, c, &st) < 0) {
    free(c);
    fsdp_services_fail_call(call, &st);
    return;
  }
  fsdp_rpc_call_on_cancel(call, on_checkpoint_cancel, c);
}

static void operator_save_checkpoint(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                                     void *data) {
  operator_checkpoint(call, request, data, false);
}

static void operator_load_checkpoint(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                                     void *data) {
  operator_checkpoint(call, request, data, true);
}

/* The operator's calls are served while draining, so a drain can be watched and undone;
 * LoadCheckpoint, which rewrites a job's units, is work a drain refuses as a trainer's. */
static const fsdp_rpc_handler_t operator_handlers[] = {
    {"Status", fsdp_operator_status, true},
    {"ReloadConfig", operator_reload, true},
    {"Drain", operator_drain, true},
    {"Resume", operator_resume, true},
    {"SaveCheckpoint", operator_save_checkpoint, true},
    {"LoadCheckpoint", operator_load_checkpoint, false},
    {"ListUnits", fsdp_operator_list_units, true},
    {"DescribeUnit", fsdp_operator_describe_unit, true},
};

/* A trainer's hello on the memory channel: the session must be the caller's own and have no
 * channel yet; the answer carries its job's arena, made on the job's first need. */
static void channel_welcome(void *data, fsdp_channel_conn_t *conn,
                            const Fsdp__V1__ChannelHello *hello, const fsdp_credentials_t *cred,
                            fsdp_channel_welcome_t *w) {
  fsdp_services_context_t *ctx = data;
  fsdp_session_t *s;
  if (fsdp_sessions_use(ctx->sessions, hello->session_id, cred, fsdp_services_now_ms(ctx),
                        &s, &w->status) < 0)
    return;
  if (s->channel) {
    fsdp_status_set(&w->status, FSDP_E_ALREADY_EXISTS,
                    "session %016llx already has its memory channel", (unsigned long long)s->id);
    return;
  }
  fsdp_job_t *job;
  fsdp_store_rank_t rank = fsdp_services_store_rank(s);
  if (fsdp_store_job_for(ctx->store, &rank, &job, &w->status) < 0)
    return;
  /* Memory 0: the buffers trainers write; memory 1: the unsharded buffers, read-only. */
  const fsdp_arena_t *arenas[2] = {job->arena, job->shared_arena};
  static const char *const what[2] = {"arena", "unsharded buffers"};
  for (size_t i = 0; i < 2; i++) {
    fsdp_arena_stats_t stats;
    fsdp_arena_get_stats(arenas[i], &stats);
    fsdp__v1__channel_memory__init(&w->memory[i]);
    snprintf(w->names[i], sizeof w->names[i], "job '%s' %s", job->name, what[i]);
    w->memory[i].name = w->names[i];
    w->memory[i].bytes = stats.capacity;
    w->memory[i].writable = i == 0;
    w->memory[i].device = (uint32_t)(stats.device + 1);
    w->memories[i] = &w->memory[i];
    w->fds[i] = fsdp_arena_peer_fd(arenas[i]);
  }
  w->n = 2;
  w->n_fds = 2;
  int fast_fds[3];
  size_t fast_bytes;
  if (fsdp_fastpath_open(ctx, s, fast_fds, &fast_bytes, &w->status) < 0)
    return;
  fsdp__v1__channel_memory__init(&w->memory[2]);
  snprintf(w->names[2], sizeof w->names[2], "session %016llx fast path", (unsigned long long)s->id);
  w->memory[2].name = w->names[2];
  w->memory[2].bytes = fast_bytes;
  w->memory[2].writable = true;
  w->memories[2] = &w->memory[2];
  fsdp__v1__fast_path__init(&w->fast_path_storage);
  w->fast_path_storage.version = FSDP_FASTPATH_VERSION;
  w->fast_path_storage.memory = 2;
  w->fast_path = &w->fast_path_storage;
  memcpy(w->fds + 2, fast_fds, sizeof fast_fds);
  w->n = 3;
  w->n_fds = 5;
  s->channel = conn;
  fsdp_channel_conn_set_owner(conn, s);
  log_info("session %016llx: memory channel open, job '%s' arenas of %llu bytes",
           (unsigned long long)s->id, job->name, (unsigned long long)w->memory[0].bytes);
}

static void channel_closed(void *data, void *owner, const char *why) {
  fsdp_services_context_t *ctx = data;
  fsdp_session_t *s = owner;
  s->channel = NULL; /* already closing */
  ctx->lifecycle.end_session(ctx->lifecycle.data, s, why);
}

void fsdp_services_channel_callbacks(fsdp_services_context_t *ctx,
                                     fsdp_channel_callbacks_t *ret_callbacks) {
  *ret_callbacks = (fsdp_channel_callbacks_t){.welcome = channel_welcome,
                                              .closed = channel_closed, .data = ctx};
}

void fsdp_services_tables(fsdp_services_context_t *ctx, const fsdp_rpc_service_t *health,
                          fsdp_rpc_service_t ret_services[FSDP_SERVICE_COUNT]) {
#define SERVICE(descriptor_, handlers_) \
  ((fsdp_rpc_service_t){&(descriptor_), handlers_, sizeof handlers_ / sizeof handlers_[0], ctx})
  ret_services[FSDP_SERVICE_TRAINER] = fsdp_trainer_service(ctx);
  ret_services[FSDP_SERVICE_OPERATOR] = SERVICE(fsdp__v1__operator__descriptor, operator_handlers);
  ret_services[FSDP_SERVICE_PEER] = fsdp_peer_service(ctx);
  ret_services[FSDP_SERVICE_HEALTH] = *health;
#undef SERVICE
}
