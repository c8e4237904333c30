/* Generic gRPC server adapter: dispatch by method table, streaming replies and graceful
 * stop, on a completion queue drained onto the loop by daemon/rpc/cq_bridge.h (whose thread
 * also re-arms requests as they arrive).
 *
 * This file holds the server: its set-up and start, the completion queue's events on both
 * threads, and the stop. Endpoints, dispatch, call contexts and replies are rooms of their
 * own (daemon/rpc/rpc_internal.h).
 *
 * Stop. First the server drains (new work refused, health and status still served) until
 * it holds no work or the drain time is up. Then gRPC's rule applies: only the thread that
 * shuts a server down and cancels its calls may destroy it, and only after the shutdown tag
 * has come back. The loop thread does all three: shutdown_and_notify, cancel_all_calls after
 * a short grace for final replies, and destroy once every endpoint's tag is back and no call
 * context is left. Then the bridge closes the completion queue. */
#include "daemon/rpc/rpc_server.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/log.h>

#include "common/list.h"
#include "common/log.h"
#include "daemon/rpc/cq_bridge.h"
#include "daemon/rpc/rpc_internal.h"

/* Requests kept outstanding per method, so that bursts do not wait for a re-arm. */
#define REQUESTS_PER_METHOD 4
/* After the drain, how long final replies may take to leave before gRPC cancels them: a
 * quarter of the drain time, out of which it is taken, within these bounds. Even a drain of
 * 0 gives final replies (a Watch stream's NOT_SERVING) a moment, or the cancel beats them. */
#define FINAL_SEND_GRACE_MIN_MS 50
#define FINAL_SEND_GRACE_MAX_MS 250

static void maybe_close(fsdp_rpc_server_t *server);

/* Hands a completed tag to the loop (on_event). */
void rpc_post(fsdp_rpc_server_t *server, tag_t *tag, bool success) {
  fsdp_cq_bridge_post(server->bridge, tag, success);
}

grpc_completion_queue *rpc_queue(const fsdp_rpc_server_t *server) {
  return fsdp_cq_bridge_queue(server->bridge);
}

/* CQ thread: a requested call arrived (or, with !success, the server is shutting down). */
static void on_request(fsdp_rpc_call_t *call, bool success) {
  if (!success) {
    rpc_call_unref(call);
    return;
  }
  rpc_count_connection_call(call);
  if (!atomic_load(&call->server->stopping))
    rpc_request_call(call->endpoint, call->method);
  /* Learn early when the client goes away or its deadline passes: gRPC never interrupts a
   * handler, and a parked call would otherwise live until it is answered. */
  grpc_op op = {.op = GRPC_OP_RECV_CLOSE_ON_SERVER};
  op.data.recv_close_on_server.cancelled = &call->cancelled;
  rpc_call_ref(call);
  if (grpc_call_start_batch(call->call, &op, 1, &call->close_tag, NULL) != GRPC_CALL_OK)
    rpc_call_unref(call);
  rpc_post(call->server, &call->request_tag, true); /* takes over the request's reference */
}

/* The queue's thread: what must happen there (the re-arm of a request, the count of
 * connections), and what the loop must see is posted to it. */
static void on_cq_event(void *data, void *t, bool success) {
  fsdp_rpc_server_t *server = data;
  tag_t *tag = t;
  fsdp_rpc_call_t *call = tag->owner;
  switch (tag->kind) {
  case TAG_REQUEST:
    on_request(call, success);
    break;
  case TAG_RECV_CLOSE:
    if (call->cancelled)
      rpc_post(server, tag, true);
    else
      rpc_call_unref(call);
    break;
  case TAG_SEND:
  case TAG_SHUTDOWN:
    rpc_post(server, tag, success);
    break;
  }
}

/* The loop's side of on_cq_event. */
static void on_event(void *data, void *t, bool success) {
  (void)data;
  tag_t *tag = t;
  fsdp_rpc_call_t *call = tag->owner;
  switch (tag->kind) {
  case TAG_REQUEST:
    rpc_dispatch(call); /* the event's reference becomes the loop's */
    break;
  case TAG_RECV_CLOSE:
    call->cancel_seen = true;
    rpc_call_cancel(call, GRPC_STATUS_CANCELLED, "cancelled: the client went away or its deadline passed");
    rpc_call_unref(call);
    break;
  case TAG_SEND:
    rpc_call_sent(call, success);
    rpc_call_unref(call);
    break;
  case TAG_SHUTDOWN:
    ((fsdp_rpc_endpoint_t *)tag->owner)->shutdown_done = true;
    break;
  }
}

static void on_drained(void *data) {
  maybe_close(data);
}

static void on_handle_closed(uv_handle_t *handle) {
  fsdp_rpc_server_t *server = handle->data;
  if (--server->open_handles > 0)
    return;
  if (server->done)
    server->done(server->done_data);
  else
    free(server); /* fsdp_rpc_server_free() of a server that never ran */
}

static void on_bridge_closed(void *data) {
  fsdp_rpc_server_t *server = data;
  server->bridge = NULL;
  uv_close((uv_handle_t *)&server->drain_timer, on_handle_closed);
}

static void destroy_grpc(fsdp_rpc_server_t *server) {
  for (fsdp_rpc_endpoint_t *ep = server->endpoints; ep; ep = ep->next) {
    if (ep->grpc)
      grpc_server_destroy(ep->grpc);
    ep->grpc = NULL;
  }
}

static void on_final_grace(uv_timer_t *timer) {
  fsdp_rpc_server_t *server = timer->data;
  for (fsdp_rpc_endpoint_t *ep = server->endpoints; ep; ep = ep->next)
    grpc_server_cancel_all_calls(ep->grpc);
}

/* No more calls: gRPC is told to shut down, and after the grace whatever is still stuck (a
 * client that stopped reading its replies, a request whose message never came) is cancelled. */
static void shut_down_grpc(fsdp_rpc_server_t *server) {
  server->state = SERVER_SHUTTING_DOWN;
  atomic_store(&server->stopping, true);
  for (fsdp_rpc_endpoint_t *ep = server->endpoints; ep; ep = ep->next)
    grpc_server_shutdown_and_notify(ep->grpc, rpc_queue(server), &ep->shutdown_tag);
  uv_timer_start(&server->drain_timer, on_final_grace, server->final_grace_ms, 0);
}

/* The drain time is up: held work ends with UNAVAILABLE, which tells a client to retry
 * elsewhere or later, and the shutdown proper begins. */
static void on_drain_deadline(uv_timer_t *timer) {
  fsdp_rpc_server_t *server = timer->data;
  if (server->work)
    log_warning("drain time is up; ending %u calls still in flight", server->work);
  fsdp_rpc_call_t *call;
  fsdp_list_for_each(call, &server->active, active)
    if (call->is_work)
      rpc_call_cancel(call, GRPC_STATUS_UNAVAILABLE, "fsdpd is shutting down");
  shut_down_grpc(server);
}

/* Advances a stop, one stage at a time, whenever something it waits for may have happened. */
static void maybe_close(fsdp_rpc_server_t *server) {
  if (server->state == SERVER_STOP_DRAINING && server->work == 0) {
    uv_timer_stop(&server->drain_timer);
    shut_down_grpc(server);
  }
  if (server->state == SERVER_SHUTTING_DOWN) {
    for (fsdp_rpc_endpoint_t *ep = server->endpoints; ep; ep = ep->next)
      if (!ep->shutdown_done)
        return;
    if (atomic_load(&server->alive) > 0)
      return;
    uv_timer_stop(&server->drain_timer);
    destroy_grpc(server);
    server->state = SERVER_CLOSING;
    fsdp_cq_bridge_close(server->bridge, on_bridge_closed, server);
  }
}

int fsdp_rpc_server_new(uv_loop_t *loop, const fsdp_rpc_server_options_t *options,
                        fsdp_rpc_server_t **ret_server) {
  fsdp_rpc_server_t *server = calloc(1, sizeof *server);
  if (!server)
    return -ENOMEM;
  /* Sized to the descriptor limit, which the daemon raised before creating the server. */
  struct rlimit nofile;
  server->n_conns = getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY
                        ? (size_t)nofile.rlim_cur
                        : 65536;
  server->conns = calloc(server->n_conns, sizeof *server->conns);
  if (!server->conns) {
    free(server);
    return -ENOMEM;
  }
  server->loop = loop;
  server->options = *options;
  fsdp_list_init(&server->active);
  atomic_init(&server->stopping, false);
  atomic_init(&server->alive, 0);
  grpc_init();
  if (fsdp_cq_bridge_new(loop,
                         &(fsdp_cq_bridge_ops_t){.on_event = on_event,
                                                 .on_drained = on_drained,
                                                 .on_cq_event = on_cq_event},
                         server, &server->bridge) < 0) {
    grpc_shutdown();
    free(server->conns);
    free(server);
    return -ENOMEM;
  }
  uv_timer_init(loop, &server->drain_timer);
  server->drain_timer.data = server;
  server->open_handles = 1;
  server->credentials = grpc_insecure_server_credentials_create();
  *ret_server = server;
  return 0;
}

void fsdp_rpc_server_free(fsdp_rpc_server_t *server) {
  if (!server)
    return;
  destroy_grpc(server);
  for (fsdp_rpc_endpoint_t *ep = server->endpoints, *next; ep; ep = next) {
    next = ep->next;
    rpc_endpoint_free(ep);
  }
  server->endpoints = NULL;
  fsdp_cq_bridge_free(server->bridge);
  server->bridge = NULL;
  grpc_server_credentials_release(server->credentials);
  for (size_t i = 0; i < server->n_conns; i++)
    free(server->conns[i].name);
  free(server->conns);
  server->conns = NULL;
  grpc_shutdown();
  if (server->open_handles > 0) {
    /* Never started: close the timer here; its close callback frees the server. */
    server->done = NULL;
    uv_close((uv_handle_t *)&server->drain_timer, on_handle_closed);
  } else {
    free(server);
  }
}

int fsdp_rpc_server_start(fsdp_rpc_server_t *server) {
  /* The bridge first: if it cannot start, no gRPC server has started either, and the
   * server can still simply be freed. */
  int r = fsdp_cq_bridge_start(server->bridge);
  if (r < 0)
    return r;
  server->state = SERVER_RUNNING;
  for (fsdp_rpc_endpoint_t *ep = server->endpoints; ep; ep = ep->next) {
    grpc_server_start(ep->grpc);
    for (size_t i = 0; i < ep->n_methods; i++)
      for (int k = 0; k < REQUESTS_PER_METHOD; k++)
        rpc_request_call(ep, &ep->methods[i]);
    rpc_request_call(ep, NULL);
  }
  return 0;
}

void fsdp_rpc_server_set_draining(fsdp_rpc_server_t *server, bool draining) {
  server->draining = draining;
}

void fsdp_rpc_server_stop(fsdp_rpc_server_t *server, uint64_t drain_ms,
                          void (*done)(void *data), void *data) {
  if (server->state != SERVER_RUNNING)
    return;
  server->done = done;
  server->done_data = data;
  server->state = SERVER_STOP_DRAINING;
  server->draining = true;
  uint64_t grace = drain_ms / 4;
  if (grace < FINAL_SEND_GRACE_MIN_MS)
    grace = FINAL_SEND_GRACE_MIN_MS;
  if (grace > FINAL_SEND_GRACE_MAX_MS)
    grace = FINAL_SEND_GRACE_MAX_MS;
  server->final_grace_ms = grace;
  uv_timer_start(&server->drain_timer, on_drain_deadline, drain_ms > grace ? drain_ms - grace : 0,
                 0);
  maybe_close(server);
}

void fsdp_rpc_server_each_method(const fsdp_rpc_server_t *server,
                                 void (*fn)(void *data, const char *endpoint, const char *path,
                                            const uint64_t ended[FSDP_RPC_CODES]),
                                 void *data) {
  for (const fsdp_rpc_endpoint_t *e = server->endpoints; e; e = e->next)
    for (size_t i = 0; i < e->n_methods; i++)
      fn(data, e->name, e->methods[i].path, e->methods[i].ended);
}

void fsdp_rpc_server_get_stats(const fsdp_rpc_server_t *server, fsdp_rpc_stats_t *ret_stats) {
  *ret_stats = (fsdp_rpc_stats_t){.calls_total = server->calls_total,
                                  .calls_failed = server->calls_failed,
                                  .calls_inflight = server->inflight,
                                  .work_inflight = server->work};
}

static void grpc_log_sink(gpr_log_func_args *args) {
  fsdp_log_level_t level = args->severity == GPR_LOG_SEVERITY_ERROR ? FSDP_LOG_WARNING
                                                                    : FSDP_LOG_DEBUG;
  fsdp_log(level, "grpc: %s", args->message);
}

void fsdp_rpc_route_log(fsdp_log_level_t level) {
  gpr_set_log_function(grpc_log_sink);
  gpr_set_log_verbosity(level >= FSDP_LOG_DEBUG ? GPR_LOG_SEVERITY_INFO : GPR_LOG_SEVERITY_ERROR);
}
