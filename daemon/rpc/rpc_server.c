/* Generic gRPC server adapter: dispatch by method table, streaming replies and graceful
 * stop, on a completion queue drained onto the loop by daemon/rpc/cq_bridge.h (whose thread
 * also re-arms requests as they arrive).
 *
 * Call lifetime. A call context is reference-counted: one reference per outstanding gRPC tag
 * (the request, RECV_CLOSE_ON_SERVER, a send batch), one per queued hand-off event, and one
 * held by the loop from arrival until the final status has been sent. Whichever thread drops
 * the last reference frees it; gRPC's call functions are safe from any thread.
 *
 * Stop. First the server drains (new work refused, health and status still served) until
 * it holds no work or the drain time is up. Then gRPC's rule applies: only the thread that
 * shuts a server down and cancels its calls may destroy it, and only after the shutdown tag
 * has come back. The loop thread does all three: shutdown_and_notify, cancel_all_calls after
 * a short grace for final replies, and destroy once every endpoint's tag is back and no call
 * context is left. Then the bridge closes the completion queue. */
#include "daemon/rpc/rpc_server.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <grpc/grpc.h>
#include <grpc/grpc_posix.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>

#include <fsdp/fsdp_version.h>

#include "common/list.h"
#include "common/log.h"
#include "daemon/rpc/cq_bridge.h"
#include "proto/wire.h"

/* Requests kept outstanding per method, so that bursts do not wait for a re-arm. */
#define REQUESTS_PER_METHOD 4
/* After the drain, how long final replies may take to leave before gRPC cancels them: a
 * quarter of the drain time, out of which it is taken, within these bounds. Even a drain of
 * 0 gives final replies (a Watch stream's NOT_SERVING) a moment, or the cancel beats them. */
#define FINAL_SEND_GRACE_MIN_MS 50
#define FINAL_SEND_GRACE_MAX_MS 250

typedef enum tag_kind { TAG_REQUEST, TAG_RECV_CLOSE, TAG_SEND, TAG_SHUTDOWN } tag_kind_t;

typedef struct tag {
  tag_kind_t kind;
  void *owner;
} tag_t;

/* What an arrived call counts against on its endpoint: each has its own limit, so that
 * Watch streams cannot starve Checks, nor either of them the trainers' work. */
typedef enum budget {
  BUDGET_CONTROL,
  BUDGET_WORK,
  BUDGET_STREAMS,
  BUDGET_REFUSED,
  BUDGET_COUNT
} budget_t;

static const char *const budget_names[BUDGET_COUNT] = {
    "health and operator calls", "calls of work", "streams", "refused calls"};

typedef struct method {
  fsdp_rpc_endpoint_t *endpoint;
  const fsdp_rpc_service_t *service;
  unsigned index;
  fsdp_rpc_handler_fn handler; /* NULL: not implemented */
  bool while_draining;
  bool streaming;
  size_t max_request; /* bytes; larger requests are refused before they are decoded */
  void *registration;
  char path[FSDP_WIRE_PATH_MAX];
} method_t;

#define AUTH_LOG_INTERVAL_MS 1000

struct fsdp_rpc_endpoint {
  fsdp_rpc_server_t *server;
  char name[32];
  fsdp_rpc_endpoint_options_t options; /* the pointers in it are not kept: see below */
  char *auth_expected;                 /* "Bearer <token>", or NULL: no token needed */
  char auth_name[64];
  /* Refusals are logged once a second at most, so that a client without the token cannot
   * make the daemon write its log as fast as it opens streams. Loop thread. */
  uint64_t auth_logged_ms;
  unsigned long auth_unlogged;
  grpc_server_credentials *credentials; /* TLS, or NULL: the server's insecure ones */
  unsigned inflight; /* loop thread */
  unsigned held[BUDGET_COUNT];
  unsigned max_streams_per_connection;
  grpc_server *grpc;
  method_t *methods;
  size_t n_methods;
  tag_t shutdown_tag;
  bool shutdown_done;
  fsdp_rpc_endpoint_t *next;
};

typedef struct pending_message {
  grpc_byte_buffer *buffer;
  struct pending_message *next;
} pending_message_t;

struct fsdp_rpc_call {
  fsdp_rpc_server_t *server;
  fsdp_rpc_endpoint_t *endpoint;
  method_t *method; /* NULL: the catch-all for paths nobody registered */
  atomic_int refs;
  tag_t request_tag, close_tag, send_tag;

  /* Filled by gRPC. */
  grpc_call *call;
  gpr_timespec deadline;
  grpc_metadata_array request_metadata;
  grpc_call_details details;
  grpc_byte_buffer *request_payload;
  int cancelled;

  /* Loop thread only. */
  fsdp_list_t active; /* in the server's list of active calls */
  char path[FSDP_WIRE_PATH_MAX];
  budget_t budget;
  bool is_work; /* a call of a method not served while draining: a stop waits for it */
  bool cancel_seen;
  bool initial_metadata_sent;
  bool batch_in_flight;
  bool status_queued; /* the final status is decided; nothing may be added */
  bool status_sent;   /* ... and is part of a started batch */
  pending_message_t *queue_head, *queue_tail;
  grpc_byte_buffer *sending;
  grpc_status_code status;
  grpc_slice status_details;
  fsdp_rpc_cancel_fn on_cancel;
  void *cancel_data;

  /* Set by the CQ thread at arrival. */
  int conn_fd;    /* the adopted connection it came on, or -1 */
  bool conn_cut;      /* its connection was cut for holding more calls than its streams */
  bool conn_logs_cut; /* ... by this call, which says so */
};

/* Calls in existence per adopted connection, by file descriptor: the listener closes idle
 * connections (no call) first. HTTP/2 lets a client reset a stream and open the next at once
 * ("rapid reset"), and gRPC 1.51 makes a call of every stream whatever the client does with
 * it next, so a connection can pile up calls beyond its stream limit faster than the loop
 * answers them: one whose calls exceed the limit is cut (shutdown(2); gRPC then closes it).
 * This sees calls only once gRPC hands them over, so it is the second line: the health
 * port, open to anyone on the host, is relayed frame by frame (daemon/rpc/relay.h), which stops
 * such a client before gRPC reads its streams. */
typedef struct conn_slot {
  atomic_uint calls;
  atomic_bool cut;
  atomic_bool proven;        /* a call came on it: a client, not a connection left open */
  atomic_bool authenticated; /* a call on it carried the endpoint's token */
  _Atomic ino_t ino;         /* the socket's inode at adoption */
  char *name;        /* loop thread only: the client's address, when the adopter knew it */
} conn_slot_t;

typedef enum server_state {
  SERVER_NEW,
  SERVER_RUNNING,
  SERVER_STOP_DRAINING, /* stop called: waiting for held work to end */
  SERVER_SHUTTING_DOWN, /* gRPC shut down: waiting for tags and call contexts */
  SERVER_CLOSING,       /* gRPC destroyed: waiting for the bridge, then the timer */
} server_state_t;

struct fsdp_rpc_server {
  uv_loop_t *loop;
  fsdp_rpc_server_options_t options;
  fsdp_cq_bridge_t *bridge; /* NULL once closed */
  grpc_server_credentials *credentials;
  fsdp_rpc_endpoint_t *endpoints;
  uv_timer_t drain_timer;
  int open_handles;

  atomic_bool stopping;
  atomic_int alive; /* call contexts in existence */
  conn_slot_t *conns; /* by fd; descriptors at or above n_conns are not counted */
  size_t n_conns;

  /* Loop thread only. */
  server_state_t state;
  bool draining;
  uint64_t final_grace_ms;
  fsdp_list_t active; /* fsdp_rpc_call_t, newest first */
  unsigned inflight;
  unsigned work; /* active calls with is_work */
  uint64_t calls_total, calls_failed;
  void (*done)(void *data);
  void *done_data;
};

/* Hands a completed tag to the loop (on_event). */
static void post(fsdp_rpc_server_t *server, tag_t *tag, bool success) {
  fsdp_cq_bridge_post(server->bridge, tag, success);
}

static grpc_completion_queue *queue(const fsdp_rpc_server_t *server) {
  return fsdp_cq_bridge_queue(server->bridge);
}

static void call_ref(fsdp_rpc_call_t *call) {
  atomic_fetch_add(&call->refs, 1);
}

static void call_unref(fsdp_rpc_call_t *call) {
  if (atomic_fetch_sub(&call->refs, 1) != 1)
    return;
  fsdp_rpc_server_t *server = call->server;
  if (call->call)
    grpc_call_unref(call->call);
  grpc_metadata_array_destroy(&call->request_metadata);
  grpc_call_details_destroy(&call->details);
  if (call->request_payload)
    grpc_byte_buffer_destroy(call->request_payload);
  if (call->sending)
    grpc_byte_buffer_destroy(call->sending);
  for (pending_message_t *m = call->queue_head, *next; m; m = next) {
    next = m->next;
    grpc_byte_buffer_destroy(m->buffer);
    free(m);
  }
  grpc_slice_unref(call->status_details);
  if (call->conn_fd >= 0)
    atomic_fetch_sub(&server->conns[call->conn_fd].calls, 1);
  free(call);
  /* The last context gone may be what a stopping server waits for. */
  if (atomic_fetch_sub(&server->alive, 1) == 1 && atomic_load(&server->stopping))
    fsdp_cq_bridge_wake(server->bridge);
}

/* Keeps one more request outstanding for `method` (NULL: unregistered paths). */
static void request_call(fsdp_rpc_endpoint_t *endpoint, method_t *method) {
  fsdp_rpc_server_t *server = endpoint->server;
  fsdp_rpc_call_t *call = calloc(1, sizeof *call);
  if (!call) {
    /* A request not re-armed is lost for good: the method would fall silent. */
    log_error("out of memory arming a request on %s", method ? method->path : "*");
    abort();
  }
  call->server = server;
  call->endpoint = endpoint;
  call->method = method;
  fsdp_list_init(&call->active);
  atomic_init(&call->refs, 1);
  call->request_tag = (tag_t){TAG_REQUEST, call};
  call->close_tag = (tag_t){TAG_RECV_CLOSE, call};
  call->send_tag = (tag_t){TAG_SEND, call};
  call->status_details = grpc_empty_slice();
  call->conn_fd = -1;
  grpc_metadata_array_init(&call->request_metadata);
  grpc_call_details_init(&call->details);
  atomic_fetch_add(&server->alive, 1);

  grpc_call_error e;
  if (method)
    e = grpc_server_request_registered_call(endpoint->grpc, method->registration, &call->call,
                                            &call->deadline, &call->request_metadata,
                                            &call->request_payload, queue(server), queue(server),
                                            &call->request_tag);
  else
    e = grpc_server_request_call(endpoint->grpc, &call->call, &call->details,
                                 &call->request_metadata, queue(server), queue(server),
                                 &call->request_tag);
  if (e != GRPC_CALL_OK) {
    log_error("cannot request calls for %s: gRPC error %d", method ? method->path : "*", e);
    call_unref(call);
  }
}

/* gRPC names a connection made from a file descriptor "fd:N"; -1 for any other. */
static int peer_fd(grpc_call *call) {
  char *peer = grpc_call_get_peer(call);
  int fd = -1;
  if (peer && strncmp(peer, "fd:", 3) == 0) {
    char *end;
    long n = strtol(peer + 3, &end, 10);
    if (end != peer + 3 && *end == '\0' && n >= 0 && n <= INT32_MAX)
      fd = (int)n;
  }
  gpr_free(peer);
  return fd;
}

/* CQ thread: counts the call against its connection, and cuts a connection that holds
 * more calls than it may have streams open. */
static void count_connection_call(fsdp_rpc_call_t *call) {
  fsdp_rpc_server_t *server = call->server;
  int fd = peer_fd(call->call);
  if (fd < 0 || (size_t)fd >= server->n_conns)
    return;
  call->conn_fd = fd;
  conn_slot_t *slot = &server->conns[fd];
  atomic_store(&slot->proven, true);
  unsigned calls = atomic_fetch_add(&slot->calls, 1) + 1;
  if (calls > call->endpoint->max_streams_per_connection && !atomic_exchange(&slot->cut, true)) {
    /* Only if the descriptor is still that connection: gRPC may have closed it, and the
     * number may be another file's by now. */
    struct stat sb;
    if (fstat(fd, &sb) == 0 && sb.st_ino == atomic_load(&slot->ino))
      shutdown(fd, SHUT_RDWR);
    call->conn_logs_cut = true;
  }
  call->conn_cut = atomic_load(&slot->cut);
}

/* CQ thread: a requested call arrived (or, with !success, the server is shutting down). */
static void on_request(fsdp_rpc_call_t *call, bool success) {
  if (!success) {
    call_unref(call);
    return;
  }
  count_connection_call(call);
  if (!atomic_load(&call->server->stopping))
    request_call(call->endpoint, call->method);
  /* Learn early when the client goes away or its deadline passes: gRPC never interrupts a
   * handler, and a parked call would otherwise live until it is answered. */
  grpc_op op = {.op = GRPC_OP_RECV_CLOSE_ON_SERVER};
  op.data.recv_close_on_server.cancelled = &call->cancelled;
  call_ref(call);
  if (grpc_call_start_batch(call->call, &op, 1, &call->close_tag, NULL) != GRPC_CALL_OK)
    call_unref(call);
  post(call->server, &call->request_tag, true); /* takes over the request's reference */
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
      post(server, tag, true);
    else
      call_unref(call);
    break;
  case TAG_SEND:
  case TAG_SHUTDOWN:
    post(server, tag, success);
    break;
  }
}

/* Loop: starts the next send batch of a call if one is due and none is in flight. */
static void pump(fsdp_rpc_call_t *call) {
  if (call->batch_in_flight || call->status_sent)
    return;
  grpc_op ops[3];
  size_t n = 0;
  memset(ops, 0, sizeof ops);
  pending_message_t *m = call->queue_head;
  bool final = call->status_queued && (!m || !m->next);
  if (!m && !final)
    return;
  if (!call->initial_metadata_sent) {
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    call->initial_metadata_sent = true;
  }
  if (m) {
    call->queue_head = m->next;
    if (!call->queue_head)
      call->queue_tail = NULL;
    call->sending = m->buffer;
    free(m);
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = call->sending;
  }
  if (final) {
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = call->status;
    ops[n++].data.send_status_from_server.status_details = &call->status_details;
    call->status_sent = true;
  }
  call->batch_in_flight = true;
  call_ref(call);
  grpc_call_error e = grpc_call_start_batch(call->call, ops, n, &call->send_tag, NULL);
  if (e != GRPC_CALL_OK) {
    /* Only misuse of the API fails here; treat it as a failed send so the call still ends. */
    log_error("%s: cannot start a send batch: gRPC error %d", call->path, e);
    post(call->server, &call->send_tag, false);
  }
}

static void finish(fsdp_rpc_call_t *call, grpc_status_code status, const char *details) {
  if (call->status_queued) {
    log_error("%s: answered twice; the second answer (%s) is dropped", call->path, details);
    return;
  }
  call->status_queued = true;
  call->status = status;
  call->status_details = grpc_slice_from_copied_string(details);
  if (status != GRPC_STATUS_OK) {
    call->server->calls_failed++;
    log_debug("%s: %s", call->path, details);
  }
  pump(call);
}

/* Queues one message; with start, sends it now. A unary reply queues its message and then
 * its status, so that both leave in one batch instead of two trips through the CQ thread. */
static int enqueue(fsdp_rpc_call_t *call, const ProtobufCMessage *message, bool start) {
  if (call->status_queued)
    return -EALREADY;
  if (call->cancel_seen)
    return -ECANCELED;
  pending_message_t *m = calloc(1, sizeof *m);
  if (!m)
    return -ENOMEM;
  int r = fsdp_wire_encode(message, &m->buffer);
  if (r < 0) {
    free(m);
    return r;
  }
  if (call->queue_tail)
    call->queue_tail->next = m;
  else
    call->queue_head = m;
  call->queue_tail = m;
  if (start)
    pump(call);
  return 0;
}

void fsdp_rpc_call_reply(fsdp_rpc_call_t *call, const ProtobufCMessage *reply) {
  int r = enqueue(call, reply, false);
  if (r == -EALREADY) {
    log_error("%s: reply after the call ended; dropped", call->path);
    return;
  }
  if (r < 0 && r != -ECANCELED) {
    finish(call, fsdp_wire_status_from_error(r), "cannot encode the reply");
    return;
  }
  finish(call, GRPC_STATUS_OK, "");
}

int fsdp_rpc_call_send(fsdp_rpc_call_t *call, const ProtobufCMessage *message) {
  if (!call->method || !call->method->streaming) {
    log_error("%s: a unary method cannot stream; message dropped", call->path);
    return -EINVAL;
  }
  return enqueue(call, message, true);
}

void fsdp_rpc_call_fail_status(fsdp_rpc_call_t *call, const fsdp_status_t *st) {
  finish(call, fsdp_wire_status_from_error(st->code), st->message);
}

void fsdp_rpc_call_fail(fsdp_rpc_call_t *call, int err, const char *fmt, ...) {
  fsdp_status_t st;
  va_list ap;
  va_start(ap, fmt);
  fsdp_status_setv(&st, err, fmt, ap);
  va_end(ap);
  fsdp_rpc_call_fail_status(call, &st);
}

void fsdp_rpc_call_peer_name(const fsdp_rpc_call_t *call, char *buf, size_t size) {
  /* gRPC knows a relayed connection only as the socket pair's "fd:N". A call's connection
   * keeps its descriptor open while the call exists, so the slot still names its client. */
  const char *name = call->conn_fd >= 0 ? call->server->conns[call->conn_fd].name : NULL;
  if (name) {
    snprintf(buf, size, "%s", name);
    return;
  }
  char *peer = grpc_call_get_peer(call->call);
  snprintf(buf, size, "%s", peer ? peer : "an unknown peer");
  gpr_free(peer);
}

void fsdp_rpc_call_on_cancel(fsdp_rpc_call_t *call, fsdp_rpc_cancel_fn cancel, void *data) {
  call->on_cancel = cancel;
  call->cancel_data = data;
}

const char *fsdp_rpc_call_method(const fsdp_rpc_call_t *call) {
  return call->path;
}

int fsdp_rpc_call_peer_fd(const fsdp_rpc_call_t *call) {
  return call->conn_fd >= 0 ? call->conn_fd : peer_fd(call->call);
}

int64_t fsdp_rpc_call_deadline_ms(const fsdp_rpc_call_t *call) {
  if (gpr_time_cmp(call->deadline, gpr_inf_future(call->deadline.clock_type)) == 0)
    return INT64_MAX;
  gpr_timespec left = gpr_time_sub(gpr_convert_clock_type(call->deadline, GPR_CLOCK_MONOTONIC),
                                   gpr_now(GPR_CLOCK_MONOTONIC));
  return gpr_time_to_millis(left);
}

static void active_link(fsdp_rpc_server_t *server, fsdp_rpc_call_t *call) {
  fsdp_list_push_front(&server->active, &call->active);
  server->inflight++;
  call->endpoint->inflight++;
  call->endpoint->held[call->budget]++;
}

static void count_work(fsdp_rpc_server_t *server, fsdp_rpc_call_t *call) {
  call->is_work = true;
  server->work++;
}

static void active_unlink(fsdp_rpc_server_t *server, fsdp_rpc_call_t *call) {
  fsdp_list_remove(&call->active);
  server->inflight--;
  call->endpoint->inflight--;
  call->endpoint->held[call->budget]--;
  if (call->is_work)
    server->work--;
}

/* Ends a call whose client is gone or whose server is stopping: its owner hears first. */
static void cancel_call(fsdp_rpc_call_t *call, grpc_status_code status, const char *why) {
  if (call->status_queued)
    return;
  if (call->on_cancel)
    call->on_cancel(call, call->cancel_data);
  if (!call->status_queued)
    finish(call, status, why);
}

/* Compares in time that depends only on the lengths, so that a caller cannot learn the
 * token a byte at a time from how long refusals take. */
static bool same_secret(const uint8_t *a, size_t a_len, const char *b) {
  size_t b_len = strlen(b);
  unsigned char diff = a_len != b_len;
  for (size_t i = 0; i < b_len; i++)
    diff |= (unsigned char)(b[i] ^ (i < a_len ? a[i] : 0));
  return diff == 0;
}

/* The endpoint's token check; fails the call and returns false when it does not pass. */
static bool authenticated(fsdp_rpc_call_t *call, const char *path) {
  fsdp_rpc_endpoint_t *ep = call->endpoint;
  if (!ep->auth_expected)
    return true;
  const grpc_metadata *found = NULL;
  for (size_t i = 0; i < call->request_metadata.count; i++)
    if (grpc_slice_str_cmp(call->request_metadata.metadata[i].key, "authorization") == 0)
      found = &call->request_metadata.metadata[i];
  if (found && same_secret(GRPC_SLICE_START_PTR(found->value), GRPC_SLICE_LENGTH(found->value),
                           ep->auth_expected)) {
    if (call->conn_fd >= 0)
      atomic_store(&call->server->conns[call->conn_fd].authenticated, true);
    return true;
  }
  uint64_t now = uv_now(call->server->loop);
  if (ep->auth_logged_ms && now - ep->auth_logged_ms < AUTH_LOG_INTERVAL_MS) {
    ep->auth_unlogged++;
  } else {
    char peer[128];
    fsdp_rpc_call_peer_name(call, peer, sizeof peer);
    log_warning("%s endpoint: %s from %s refused: %s (%lu more refused since the last such "
                "message)",
                ep->name, path, peer, found ? "wrong token" : "no 'authorization' metadata",
                ep->auth_unlogged);
    ep->auth_logged_ms = now;
    ep->auth_unlogged = 0;
  }
  if (!found)
    fsdp_rpc_call_fail(call, FSDP_E_UNAUTHENTICATED,
                       "%s: the %s endpoint requires 'authorization: Bearer <token>' metadata "
                       "with the token of %s; the call carried none",
                       path, ep->name, ep->auth_name);
  else
    fsdp_rpc_call_fail(call, FSDP_E_UNAUTHENTICATED,
                       "%s: the 'authorization' metadata does not carry the token of %s that "
                       "the %s endpoint requires ('Bearer <token>')",
                       path, ep->auth_name, ep->name);
  return false;
}

static budget_t budget_of(const method_t *method) {
  if (method && method->streaming)
    return BUDGET_STREAMS;
  return method && !method->while_draining ? BUDGET_WORK : BUDGET_CONTROL;
}

/* The limit of a budget on the endpoint, and how refusals name it. */
static unsigned budget_limit(const fsdp_rpc_endpoint_t *ep, budget_t budget,
                             const char **ret_name) {
  if (budget == BUDGET_STREAMS) {
    *ret_name = ep->options.streams_limit_name;
    return ep->options.max_streams;
  }
  *ret_name = ep->options.limit_name;
  return ep->options.max_inflight_calls;
}

static void dispatch(fsdp_rpc_call_t *call) {
  fsdp_rpc_server_t *server = call->server;
  method_t *method = call->method;
  server->calls_total++;
  /* Calls of a cut connection are refused without work and count against no budget. */
  call->budget = call->conn_cut ? BUDGET_REFUSED : budget_of(method);
  active_link(server, call);

  if (call->conn_cut) {
    char *path = grpc_slice_to_c_string(call->details.method);
    snprintf(call->path, sizeof call->path, "%s", method ? method->path : path);
    gpr_free(path);
    if (call->conn_logs_cut)
      log_warning("%s endpoint: connection fd:%d held more than its %u streams in calls at "
                  "once (streams reset and reopened?); closed it",
                  call->endpoint->name, call->conn_fd,
                  call->endpoint->max_streams_per_connection);
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED,
                       "%s: the connection held more than its %u streams in calls at once; "
                       "the %s endpoint closed it",
                       call->path, call->endpoint->max_streams_per_connection,
                       call->endpoint->name);
    return;
  }

  if (call->endpoint->options.refuse) {
    char *path = grpc_slice_to_c_string(call->details.method);
    snprintf(call->path, sizeof call->path, "%s", path);
    gpr_free(path);
    char why[256];
    call->endpoint->options.refuse(call->endpoint->options.refuse_data, call->conn_fd, why,
                                   sizeof why);
    fsdp_rpc_call_fail(call, FSDP_E_PERMISSION_DENIED, "%s: %s", call->path, why);
    return;
  }

  {
    /* Before anything else: an unauthenticated caller learns nothing, not even which
     * methods exist. */
    char *path = method ? NULL : grpc_slice_to_c_string(call->details.method);
    bool ok = authenticated(call, method ? method->path : path);
    if (!ok)
      snprintf(call->path, sizeof call->path, "%s", method ? method->path : path);
    gpr_free(path);
    if (!ok)
      return;
  }

  if (!method) {
    char *path = grpc_slice_to_c_string(call->details.method);
    snprintf(call->path, sizeof call->path, "%s", path);
    call->deadline = call->details.deadline;
    fsdp_rpc_call_fail(call, FSDP_E_UNIMPLEMENTED, "unknown method '%s' on the %s endpoint",
                       path, call->endpoint->name);
    gpr_free(path);
    return;
  }
  memcpy(call->path, method->path, sizeof call->path);
  fsdp_rpc_endpoint_t *ep = call->endpoint;
  const char *limit_name;
  unsigned limit = budget_limit(ep, call->budget, &limit_name);
  if (ep->held[call->budget] > limit) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED,
                       "%s: the %s endpoint already holds %u %s (%s = %u)", call->path, ep->name,
                       ep->held[call->budget] - 1, budget_names[call->budget], limit_name, limit);
    return;
  }
  if (fsdp_rpc_call_deadline_ms(call) <= 0) {
    fsdp_rpc_call_fail(call, FSDP_E_DEADLINE_EXCEEDED, "%s: deadline passed before dispatch",
                       call->path);
    return;
  }
  /* Before decoding, which costs the loop time in proportion to the bytes. */
  size_t size = call->request_payload ? grpc_byte_buffer_length(call->request_payload) : 0;
  if (size > method->max_request) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED,
                       "%s: request of %zu bytes, more than the %zu bytes this method takes",
                       call->path, size, method->max_request);
    return;
  }
  /* A bad request is reported as such even by a method this release does not implement. */
  const ProtobufCMethodDescriptor *md = &method->service->descriptor->methods[method->index];
  fsdp_status_t st;
  ProtobufCMessage *request;
  if (fsdp_wire_decode_request(md->input, call->request_payload, &request, &st) < 0) {
    fsdp_rpc_call_fail(call, st.code, "%s: %s", call->path, st.message);
    return;
  }
  if (!method->handler) {
    fsdp_rpc_call_fail(call, FSDP_E_UNIMPLEMENTED, "%s is not implemented in fsdpd %s",
                       call->path, FSDP_VERSION_STRING);
  } else if (server->draining && !method->while_draining) {
    fsdp_rpc_call_fail(call, FSDP_E_UNAVAILABLE, "%s: fsdpd is draining and takes no new work",
                       call->path);
  } else {
    if (!method->while_draining)
      count_work(server, call);
    method->handler(call, request, method->service->data);
  }
  protobuf_c_message_free_unpacked(request, NULL);
}

static void on_sent(fsdp_rpc_call_t *call, bool success) {
  call->batch_in_flight = false;
  if (call->sending) {
    grpc_byte_buffer_destroy(call->sending);
    call->sending = NULL;
  }
  if (!success && !call->status_sent) {
    /* The stream broke under us (client gone); end it instead of sending into the void. */
    call->cancel_seen = true;
    cancel_call(call, GRPC_STATUS_CANCELLED, "stream broken");
  }
  if (call->status_sent && !call->batch_in_flight) {
    active_unlink(call->server, call);
    call_unref(call); /* the loop's reference, held since arrival */
    return;
  }
  pump(call);
}

static void maybe_close(fsdp_rpc_server_t *server);
static void endpoint_free(fsdp_rpc_endpoint_t *ep);

/* The loop's side of on_cq_event. */
static void on_event(void *data, void *t, bool success) {
  (void)data;
  tag_t *tag = t;
  fsdp_rpc_call_t *call = tag->owner;
  switch (tag->kind) {
  case TAG_REQUEST:
    dispatch(call); /* the event's reference becomes the loop's */
    break;
  case TAG_RECV_CLOSE:
    call->cancel_seen = true;
    cancel_call(call, GRPC_STATUS_CANCELLED, "cancelled: the client went away or its deadline passed");
    call_unref(call);
    break;
  case TAG_SEND:
    on_sent(call, success);
    call_unref(call);
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
    grpc_server_shutdown_and_notify(ep->grpc, queue(server), &ep->shutdown_tag);
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
      cancel_call(call, GRPC_STATUS_UNAVAILABLE, "fsdpd is shutting down");
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
    endpoint_free(ep);
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

static void endpoint_free(fsdp_rpc_endpoint_t *ep) {
  if (ep->credentials)
    grpc_server_credentials_release(ep->credentials);
  if (ep->auth_expected) {
    explicit_bzero(ep->auth_expected, strlen(ep->auth_expected));
    free(ep->auth_expected);
  }
  free(ep->methods);
  free(ep);
}

/* The endpoint's own credentials and token, from its options. */
static int endpoint_security(fsdp_rpc_endpoint_t *ep, const fsdp_rpc_endpoint_options_t *o) {
  ep->options.auth_token = ep->options.auth_name = NULL;
  ep->options.tls_cert_pem = ep->options.tls_key_pem = ep->options.tls_ca_pem = NULL;
  if (o->auth_token) {
    size_t n = strlen(o->auth_token) + sizeof "Bearer ";
    if (!(ep->auth_expected = malloc(n)))
      return -ENOMEM;
    snprintf(ep->auth_expected, n, "Bearer %s", o->auth_token);
    snprintf(ep->auth_name, sizeof ep->auth_name, "%s", o->auth_name ? o->auth_name : "the endpoint");
  }
  if (o->tls_cert_pem || o->tls_key_pem || o->tls_ca_pem) {
    if (!o->tls_cert_pem || !o->tls_key_pem || !o->tls_ca_pem)
      return -EINVAL;
    grpc_ssl_pem_key_cert_pair pair = {o->tls_key_pem, o->tls_cert_pem};
    ep->credentials = grpc_ssl_server_credentials_create_ex(
        o->tls_ca_pem, &pair, 1, GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, NULL);
    if (!ep->credentials)
      return -EINVAL;
  }
  return 0;
}

int fsdp_rpc_server_add_endpoint(fsdp_rpc_server_t *server, const char *name,
                                 const fsdp_rpc_service_t *services, size_t n_services,
                                 const fsdp_rpc_endpoint_options_t *options,
                                 fsdp_rpc_endpoint_t **ret_endpoint) {
  fsdp_rpc_endpoint_t *ep = calloc(1, sizeof *ep);
  if (!ep)
    return -ENOMEM;
  ep->server = server;
  ep->options = *options;
  snprintf(ep->name, sizeof ep->name, "%s", name);
  ep->shutdown_tag = (tag_t){TAG_SHUTDOWN, ep};
  for (size_t s = 0; s < n_services; s++)
    ep->n_methods += services[s].descriptor->n_methods;
  ep->methods = calloc(ep->n_methods ? ep->n_methods : 1, sizeof *ep->methods);
  int r = ep->methods ? endpoint_security(ep, options) : -ENOMEM;
  if (r < 0) {
    endpoint_free(ep);
    return r;
  }
  /* gRPC refuses a message larger than the largest any method here takes before it has
   * buffered it: a port that serves only Health takes only names. */
  size_t max_request = FSDP_WIRE_HEALTH_REQUEST_MAX; /* a name, even with no method here */
  for (size_t s = 0; s < n_services; s++)
    for (unsigned i = 0; i < services[s].descriptor->n_methods; i++) {
      size_t m = fsdp_wire_method_max_request(services[s].descriptor, i,
                                              server->options.max_message_size);
      max_request = m > max_request ? m : max_request;
    }
  /* Requests whose message has not arrived yet are held by gRPC, not counted by us;
   * this bounds them per connection. At the in-flight limit itself, HTTP/2 clients
   * would queue quietly instead of hearing RESOURCE_EXHAUSTED from us: hence twice. */
  ep->max_streams_per_connection = 2 * options->max_inflight_calls + options->max_streams;
  grpc_arg args[] = {
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, {.integer = (int)max_request}},
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, {.integer = -1}},
      /* gRPC allows SO_REUSEPORT by default: two daemons would then share one port. */
      {GRPC_ARG_INTEGER, GRPC_ARG_ALLOW_REUSEPORT, {.integer = 0}},
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_CONCURRENT_STREAMS,
       {.integer = (int)ep->max_streams_per_connection}},
      /* A connection without a call for this long is closed (GOAWAY; clients reconnect when
       * they call again): idle connections cannot pile up. */
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_CONNECTION_IDLE_MS,
       {.integer = options->idle_ms ? (int)options->idle_ms : INT32_MAX}},
      /* A TLS handshake that does not finish in time is dropped too. */
      {GRPC_ARG_INTEGER, GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
       {.integer = options->idle_ms ? (int)options->idle_ms : INT32_MAX}},
  };
  grpc_channel_args channel_args = {sizeof args / sizeof args[0], args};
  ep->grpc = grpc_server_create(&channel_args, NULL);
  grpc_server_register_completion_queue(ep->grpc, queue(server), NULL);

  size_t k = 0;
  for (size_t s = 0; s < n_services; s++) {
    const ProtobufCServiceDescriptor *sd = services[s].descriptor;
    size_t first = k;
    for (size_t h = 0; h < services[s].n_handlers; h++) {
      const ProtobufCMethodDescriptor *md =
          protobuf_c_service_descriptor_get_method_by_name(sd, services[s].handlers[h].method);
      if (!md) {
        log_error("%s has no method '%s' to handle", sd->name, services[s].handlers[h].method);
        goto fail;
      }
      method_t *m = &ep->methods[first + (size_t)(md - sd->methods)];
      m->handler = services[s].handlers[h].fn;
      m->while_draining = services[s].handlers[h].while_draining;
    }
    for (unsigned i = 0; i < sd->n_methods; i++, k++) {
      method_t *m = &ep->methods[k];
      m->endpoint = ep;
      m->service = &services[s];
      m->index = i;
      m->streaming = fsdp_wire_method_is_server_streaming(sd, i);
      m->max_request = fsdp_wire_method_max_request(sd, i, server->options.max_message_size);
      fsdp_wire_method_path(sd, i, m->path, sizeof m->path);
      m->registration = grpc_server_register_method(
          ep->grpc, m->path, NULL, GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
      if (!m->registration) {
        log_error("cannot register %s on the %s endpoint", m->path, name);
        goto fail;
      }
    }
  }
  ep->next = server->endpoints;
  server->endpoints = ep;
  *ret_endpoint = ep;
  return 0;

fail:
  grpc_server_destroy(ep->grpc);
  endpoint_free(ep);
  return -EINVAL;
}

int fsdp_rpc_endpoint_listen(fsdp_rpc_endpoint_t *endpoint, const char *address,
                             int *ret_port, fsdp_status_t *st) {
  int port = grpc_server_add_http2_port(endpoint->grpc, address,
                                        endpoint->credentials ? endpoint->credentials
                                                              : endpoint->server->credentials);
  if (port <= 0)
    return fsdp_status_set(st, -EADDRINUSE,
                           "cannot listen on %s for the %s endpoint: address in use or invalid",
                           address, endpoint->name);
  *ret_port = port;
  return 0;
}

void fsdp_rpc_endpoint_adopt(fsdp_rpc_endpoint_t *endpoint, int fd, const char *peer_name) {
  server_state_t state = endpoint->server->state;
  if (state != SERVER_RUNNING && state != SERVER_STOP_DRAINING) {
    close(fd);
    return;
  }
  struct stat sb;
  if ((size_t)fd < endpoint->server->n_conns && fstat(fd, &sb) == 0) {
    conn_slot_t *slot = &endpoint->server->conns[fd];
    atomic_store(&slot->ino, sb.st_ino);
    atomic_store(&slot->cut, false);
    atomic_store(&slot->proven, false);
    atomic_store(&slot->authenticated, false);
    free(slot->name);
    slot->name = peer_name ? strdup(peer_name) : NULL;
  }
  grpc_server_add_channel_from_fd(endpoint->grpc, fd, endpoint->server->credentials);
}

unsigned fsdp_rpc_endpoint_max_streams_per_connection(const fsdp_rpc_endpoint_t *endpoint) {
  return endpoint->max_streams_per_connection;
}

unsigned fsdp_rpc_endpoint_connection_calls(const fsdp_rpc_endpoint_t *endpoint, int fd) {
  const fsdp_rpc_server_t *server = endpoint->server;
  return fd >= 0 && (size_t)fd < server->n_conns ? atomic_load(&server->conns[fd].calls) : 0;
}

bool fsdp_rpc_endpoint_connection_proven(const fsdp_rpc_endpoint_t *endpoint, int fd) {
  const fsdp_rpc_server_t *server = endpoint->server;
  return fd >= 0 && (size_t)fd < server->n_conns && atomic_load(&server->conns[fd].proven);
}

bool fsdp_rpc_endpoint_connection_authenticated(const fsdp_rpc_endpoint_t *endpoint, int fd) {
  const fsdp_rpc_server_t *server = endpoint->server;
  return fd >= 0 && (size_t)fd < server->n_conns &&
         atomic_load(&server->conns[fd].authenticated);
}

bool fsdp_rpc_endpoint_connection_trusted(const fsdp_rpc_endpoint_t *endpoint, int fd) {
  return endpoint->auth_expected ? fsdp_rpc_endpoint_connection_authenticated(endpoint, fd)
                                 : fsdp_rpc_endpoint_connection_proven(endpoint, fd);
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
        request_call(ep, &ep->methods[i]);
    request_call(ep, NULL);
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

void fsdp_rpc_endpoint_set_max_inflight(fsdp_rpc_endpoint_t *endpoint,
                                        unsigned max_inflight_calls) {
  endpoint->options.max_inflight_calls = max_inflight_calls;
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
