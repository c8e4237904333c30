/* The RPC server's rooms share these: the server (daemon/rpc/rpc_lifecycle.c: set-up, the
 * completion queue's events, the stop), its endpoints and their connections
 * (rpc_endpoint.c), the dispatch of an arrived call (rpc_dispatch.c), a call's context
 * (rpc_call.c) and its replies (rpc_reply.c). Nothing outside daemon/rpc/rpc_*.c includes
 * it: the server's contract is daemon/rpc/rpc_server.h, which no rpc_server.c implements
 * alone (such a file including this header, which includes the contract, would make the
 * module reach itself).
 *
 * Threads: the fields say which thread owns them; what the completion queue's thread
 * touches is atomic. */
#ifndef FSDP_RPC_INTERNAL_H
#define FSDP_RPC_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <grpc/grpc.h>
#include <uv.h>

#include "common/list.h"
#include "daemon/rpc/cq_bridge.h"
#include "daemon/rpc/rpc_server.h"
#include "proto/wire.h"

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

typedef struct method {
  fsdp_rpc_endpoint_t *endpoint;
  const fsdp_rpc_service_t *service;
  unsigned index;
  fsdp_rpc_handler_fn handler; /* NULL: not implemented */
  bool while_draining;
  bool streaming;
  size_t max_request; /* bytes; larger requests are refused before they are decoded */
  uint64_t ended[FSDP_RPC_CODES]; /* calls that ended, by gRPC status code */
  void *registration;
  char path[FSDP_WIRE_PATH_MAX];
} method_t;

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


/* rpc_lifecycle.c: hands a completed tag to the loop (its on_event); the completion queue. */
void rpc_post(fsdp_rpc_server_t *server, tag_t *tag, bool success);
grpc_completion_queue *rpc_queue(const fsdp_rpc_server_t *server);

/* rpc_call.c: a call context's references, and the request that makes one. */
void rpc_call_ref(fsdp_rpc_call_t *call);
void rpc_call_unref(fsdp_rpc_call_t *call);
void rpc_request_call(fsdp_rpc_endpoint_t *endpoint, method_t *method);
int rpc_peer_fd(grpc_call *call);

/* rpc_endpoint.c */
void rpc_count_connection_call(fsdp_rpc_call_t *call);
void rpc_endpoint_free(fsdp_rpc_endpoint_t *ep);

/* rpc_dispatch.c: the loop's side of an arrived call; a call's end takes it off the
 * server's active list. */
void rpc_dispatch(fsdp_rpc_call_t *call);
void rpc_active_unlink(fsdp_rpc_server_t *server, fsdp_rpc_call_t *call);

/* rpc_reply.c: a send batch completed; a call ended by its client or a stop. */
void rpc_call_sent(fsdp_rpc_call_t *call, bool success);
void rpc_call_cancel(fsdp_rpc_call_t *call, grpc_status_code status, const char *why);

#endif
