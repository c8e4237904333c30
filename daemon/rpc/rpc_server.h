/* The daemon's RPC server: one generic adapter between protobuf-c service descriptors and
 * the gRPC C core.
 *
 * A service is registered as its protobuf-c descriptor plus a table of handlers, one per
 * method. For every method the adapter does the plumbing: it registers the path, keeps
 * requests outstanding, decodes and validates the request (INVALID_ARGUMENT naming the
 * method and the field on failure), enforces the in-flight limit, calls the handler, packs
 * the reply and maps fsdp error codes to gRPC status codes (proto/wire.h). Unknown methods
 * get UNIMPLEMENTED naming the path; methods without a handler get UNIMPLEMENTED saying so.
 *
 * Threads: the completion queue is drained onto the libuv loop by daemon/rpc/cq_bridge.h,
 * whose thread only re-arms requests and counts connections. Handlers, replies, cancellation callbacks
 * and the stop callback all run on the loop thread, which owns every object here.
 *
 * Endpoints: each endpoint is its own gRPC server with its own set of services, so the
 * health port on TCP serves Health and nothing else, while the unix socket serves all.
 *
 * Draining: while the server drains, calls to methods not marked while_draining get
 * UNAVAILABLE at once; the calls of those methods already held are the work a stop waits
 * for.
 *
 * Calls: a handler must end its call with fsdp_rpc_call_reply() or fsdp_rpc_call_fail(),
 * at once or later. A handler that parks a call registers a cancel callback; it fires when
 * the client goes away, the deadline passes or the server stops, after which the call is
 * ended by the adapter and must not be touched again. */
#ifndef FSDP_RPC_SERVER_H
#define FSDP_RPC_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>
#include <uv.h>

#include "common/log.h"
#include "common/status.h"

typedef struct fsdp_rpc_server fsdp_rpc_server_t;
typedef struct fsdp_rpc_endpoint fsdp_rpc_endpoint_t;
typedef struct fsdp_rpc_call fsdp_rpc_call_t;

/* The request is valid only during the handler; copy what must outlive it. */
typedef void (*fsdp_rpc_handler_fn)(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                                    void *data);
typedef void (*fsdp_rpc_cancel_fn)(fsdp_rpc_call_t *call, void *data);

typedef struct fsdp_rpc_handler {
  const char *method; /* the method's name in the .proto, e.g. "Status" */
  fsdp_rpc_handler_fn fn;
  bool while_draining; /* still served while draining (health, status); not work to drain */
} fsdp_rpc_handler_t;

/* Methods of the descriptor that have no handler answer UNIMPLEMENTED; a handler naming a
 * method the descriptor lacks fails fsdp_rpc_server_add_endpoint(). */
typedef struct fsdp_rpc_service {
  const ProtobufCServiceDescriptor *descriptor;
  const fsdp_rpc_handler_t *handlers;
  size_t n_handlers;
  void *data; /* passed to every handler */
} fsdp_rpc_service_t;

typedef struct fsdp_rpc_server_options {
  size_t max_message_size; /* larger requests get RESOURCE_EXHAUSTED from gRPC */
} fsdp_rpc_server_options_t;

/* Each endpoint has its own budget, so that clients of one (anyone on the host can reach
 * the TCP health port) cannot use up another's. */
typedef struct fsdp_rpc_endpoint_options {
  /* Unary calls held at once, counted apart for work (methods not served while draining)
   * and for the rest (health Checks, operators); beyond it RESOURCE_EXHAUSTED. */
  unsigned max_inflight_calls;
  const char *limit_name; /* how refusals name the limit, e.g. the config key */
  /* Streams (Health.Watch) held at once, a budget of their own. */
  unsigned max_streams;
  const char *streams_limit_name;
  /* Milliseconds a connection may go without a call before it is closed; 0: no limit. */
  unsigned idle_ms;
  /* Non-NULL: every call on the endpoint, whatever its method, must carry the metadata
   * "authorization: Bearer <auth_token>", or it gets UNAUTHENTICATED before anything else
   * (the message never shows the token). Copied. auth_name names where the token comes
   * from in that message (e.g. "peer.token_file"). */
  const char *auth_token;
  const char *auth_name;
  /* All three non-NULL (PEM text, copied): fsdp_rpc_endpoint_listen() serves TLS with this
   * certificate and requires and verifies a client certificate chaining to tls_ca_pem
   * (mutual TLS). All NULL: plaintext. Adopted descriptors are always plaintext. */
  const char *tls_cert_pem, *tls_key_pem, *tls_ca_pem;
  /* Non-NULL: the endpoint serves no one. Every call on it gets PERMISSION_DENIED with the
   * reason refuse() writes for its connection (the adopted descriptor), so that a client
   * let in only to hear it is refused can show why. */
  void (*refuse)(void *data, int fd, char *buf, size_t size);
  void *refuse_data;
} fsdp_rpc_endpoint_options_t;

/* gRPC's status codes, OK (0) to UNAUTHENTICATED (16). */
#define FSDP_RPC_CODES 17

/* Calls each method of an endpoint served that ended, by status code: fn once per method of
 * each endpoint, with the endpoint's name, the method's path and its counts (indexed by
 * code). Calls of paths nobody serves are not counted. */
void fsdp_rpc_server_each_method(const fsdp_rpc_server_t *server,
                                 void (*fn)(void *data, const char *endpoint, const char *path,
                                            const uint64_t ended[FSDP_RPC_CODES]),
                                 void *data);

typedef struct fsdp_rpc_stats {
  uint64_t calls_total;  /* calls that reached the adapter */
  uint64_t calls_failed; /* calls that ended with a status other than OK */
  unsigned calls_inflight;
  unsigned work_inflight; /* of those, calls a drain waits for */
} fsdp_rpc_stats_t;

int fsdp_rpc_server_new(uv_loop_t *loop, const fsdp_rpc_server_options_t *options,
                        fsdp_rpc_server_t **ret_server);
/* Frees a server that was never started or whose stop callback has run. NULL-safe. */
void fsdp_rpc_server_free(fsdp_rpc_server_t *server);

/* Adds an endpoint serving `services` (borrowed; they must outlive the server). Before start.
 * HTTP/2 streams per connection are capped at twice the endpoint's in-flight limit as it is
 * here, plus its streams: requests whose message has not arrived are held by gRPC, not
 * counted by us. A connection handed over with fsdp_rpc_endpoint_adopt() that comes to hold
 * more calls than that at once (streams reset and reopened faster than they are answered) is
 * shut down. Requests larger than their method takes (fsdp_wire_method_max_request) get
 * RESOURCE_EXHAUSTED before they are decoded. */
int fsdp_rpc_server_add_endpoint(fsdp_rpc_server_t *server, const char *name,
                                 const fsdp_rpc_service_t *services, size_t n_services,
                                 const fsdp_rpc_endpoint_options_t *options,
                                 fsdp_rpc_endpoint_t **ret_endpoint);
/* A new in-flight limit (reload); the per-connection stream cap keeps its start value. */
void fsdp_rpc_endpoint_set_max_inflight(fsdp_rpc_endpoint_t *endpoint,
                                        unsigned max_inflight_calls);
/* Listens on a TCP address "host:port" (port 0 picks one, returned). Before start. */
int fsdp_rpc_endpoint_listen(fsdp_rpc_endpoint_t *endpoint, const char *address,
                             int *ret_port, fsdp_status_t *st);
/* Hands a connected, non-blocking socket to the endpoint; takes ownership of fd. After start.
 * peer_name (copied; NULL: gRPC's "fd:N") is what fsdp_rpc_call_peer_name() gives for its
 * calls: the relay's client address, in gRPC's form ("ipv4:127.0.0.1:41234"). */
void fsdp_rpc_endpoint_adopt(fsdp_rpc_endpoint_t *endpoint, int fd, const char *peer_name);
/* HTTP/2 streams one connection of the endpoint may hold open at once. */
unsigned fsdp_rpc_endpoint_max_streams_per_connection(const fsdp_rpc_endpoint_t *endpoint);
/* Calls in existence that came on the adopted connection fd (0: the connection is idle). Any
 * thread. */
unsigned fsdp_rpc_endpoint_connection_calls(const fsdp_rpc_endpoint_t *endpoint, int fd);
/* What the adopted connection fd has shown, any thread: proven, that a call came on it (a
 * client, not a connection left open); authenticated, that a call carried the endpoint's
 * token (a peer's own channel); trusted, the latter, or the former where the endpoint asks
 * no token. */
bool fsdp_rpc_endpoint_connection_proven(const fsdp_rpc_endpoint_t *endpoint, int fd);
bool fsdp_rpc_endpoint_connection_authenticated(const fsdp_rpc_endpoint_t *endpoint, int fd);
bool fsdp_rpc_endpoint_connection_trusted(const fsdp_rpc_endpoint_t *endpoint, int fd);

/* Starts serving: the completion-queue thread and outstanding requests for every method. */
int fsdp_rpc_server_start(fsdp_rpc_server_t *server);

/* Starts or ends draining: new work is refused with UNAVAILABLE, the rest is served. */
void fsdp_rpc_server_set_draining(fsdp_rpc_server_t *server, bool draining);

/* Begins a graceful stop: the server drains until it holds no work or drain_ms has passed
 * (held work then ends with UNAVAILABLE), then gRPC takes no more calls, and `done` runs on
 * the loop once every call and gRPC object is gone. Final replies get a short grace (50 to
 * 250 ms) taken out of drain_ms, so the stop as a whole fits in drain_ms when it is 200 ms
 * or more. */
void fsdp_rpc_server_stop(fsdp_rpc_server_t *server, uint64_t drain_ms,
                          void (*done)(void *data), void *data);

void fsdp_rpc_server_get_stats(const fsdp_rpc_server_t *server, fsdp_rpc_stats_t *ret_stats);

/* Replies and ends the call (a stream too: its last message, then OK), or sends one message
 * of a server-streaming method (-EINVAL on a unary one). The message is encoded at once;
 * the caller keeps ownership of it. */
void fsdp_rpc_call_reply(fsdp_rpc_call_t *call, const ProtobufCMessage *reply);
int fsdp_rpc_call_send(fsdp_rpc_call_t *call, const ProtobufCMessage *message);
/* Ends a call with an error (err < 0) or, for a stream, with OK (err == 0). */
__attribute__((format(printf, 3, 4))) void fsdp_rpc_call_fail(fsdp_rpc_call_t *call, int err,
                                                              const char *fmt, ...);
void fsdp_rpc_call_fail_status(fsdp_rpc_call_t *call, const fsdp_status_t *st);

void fsdp_rpc_call_on_cancel(fsdp_rpc_call_t *call, fsdp_rpc_cancel_fn cancel, void *data);
/* "/package.Service/Method" */
const char *fsdp_rpc_call_method(const fsdp_rpc_call_t *call);
/* The file descriptor of the connection the call came on, for connections handed over with
 * fsdp_rpc_endpoint_adopt(); -1 for those gRPC accepted itself (TCP). */
int fsdp_rpc_call_peer_fd(const fsdp_rpc_call_t *call);
/* The caller's name into buf, for messages: its TCP address ("ipv4:127.0.0.1:41234") on
 * a port gRPC accepted or the listener relayed, "fd:12" on the unix socket. */
void fsdp_rpc_call_peer_name(const fsdp_rpc_call_t *call, char *buf, size_t size);

/* Routes gRPC's own log lines through the daemon's log; its debug chatter is formatted only
 * at level debug, when someone will read it. Call at start and whenever the level changes. */
void fsdp_rpc_route_log(fsdp_log_level_t level);
/* Milliseconds until the client's deadline (<= 0 if passed); INT64_MAX without one. */
int64_t fsdp_rpc_call_deadline_ms(const fsdp_rpc_call_t *call);

#endif
