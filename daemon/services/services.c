/* Where the handlers meet their transports: the table of every gRPC service (Trainer,
 * Operator and Peer, each from its own file, and the health service given), and the memory
 * channel's callbacks, which admit a trainer's session to its job's memory and open its fast
 * path. Apart from the handlers as the one file that knows all of them. */
#include "daemon/services/services.h"

#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "daemon/services/calls.h"
#include "daemon/services/fastpath.h"
#include "daemon/services/operator_service.h"
#include "daemon/services/peer_service.h"
#include "daemon/services/trainer_events.h"
#include "daemon/services/trainer_service.h"
#include "proto/fastpath.h"
#include "proto/wire.h"

/* A trainer's hello on the memory channel: the session must be the caller's own and have no
 * channel yet; the answer carries its job's arena, made on the job's first need, its fast
 * path, and on a GPU its events. What it opened for the session before a refusal goes when
 * the session ends (the refused trainer detaches). */
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
  /* Each event's handle is a length-delimited field: the memories keep the frame's rest. */
  _Static_assert(FSDP_SESSION_CUDA_EVENTS * (FSDP_CUDA_IPC_EVENT_BYTES + 2) + 1536 <=
                     FSDP_CHANNEL_FRAME_BYTES,
                 "the welcome's events leave room in its frame");
  const fsdp_backend_t *backend = &ctx->dataplane->backend;
  if (fsdp_backend_has_events(backend)) {
    fsdp_trainer_events_close(s->cuda_events); /* of a refused hello before */
    s->cuda_events = NULL;
    fsdp_trainer_events_t *events;
    if (fsdp_trainer_events_open(backend, &events, w->cuda_event_handles, &w->status) < 0)
      return;
    s->cuda_events = events;
    for (size_t i = 0; i < FSDP_SESSION_CUDA_EVENTS; i++)
      w->cuda_events[i] = (ProtobufCBinaryData){.len = FSDP_CUDA_IPC_EVENT_BYTES,
                                                .data = w->cuda_event_handles[i]};
    w->n_cuda_events = FSDP_SESSION_CUDA_EVENTS;
  }
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
  ret_services[FSDP_SERVICE_TRAINER] = fsdp_trainer_service(ctx);
  ret_services[FSDP_SERVICE_OPERATOR] = fsdp_operator_service(ctx);
  ret_services[FSDP_SERVICE_PEER] = fsdp_peer_service(ctx);
  ret_services[FSDP_SERVICE_HEALTH] = *health;
}
