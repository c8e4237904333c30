/* The Operator service's table, and its handlers that change the daemon: ReloadConfig,
 * Drain, Resume, and Save and LoadCheckpoint (a trainer of the job may call these two with
 * its session). Who may call them is decided here (operator_only); the reports, which anyone
 * let in by the socket may read, are in operator_status.c and operator_units.c. */
#include "daemon/services/operator_service.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fsdp/v1/operator.pb-c.h"

#include "common/log.h"
#include "daemon/services/calls.h"
#include "daemon/services/operator_internal.h"

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
    {"Trace", fsdp_operator_trace, true},
    {"Why", fsdp_operator_why, true},
};

fsdp_rpc_service_t fsdp_operator_service(fsdp_services_context_t *ctx) {
  return (fsdp_rpc_service_t){&fsdp__v1__operator__descriptor, operator_handlers,
                              sizeof operator_handlers / sizeof operator_handlers[0], ctx};
}
