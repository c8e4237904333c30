/* A call's context: made when a request is armed, reference-counted while gRPC, the
 * hand-off queue or the loop holds it, and what a handler may ask of it (its method, peer,
 * deadline, cancel callback). Apart from the server because it is one object's lifetime.
 *
 * Call lifetime. A call context is reference-counted: one reference per outstanding gRPC tag
 * (the request, RECV_CLOSE_ON_SERVER, a send batch), one per queued hand-off event, and one
 * held by the loop from arrival until the final status has been sent. Whichever thread drops
 * the last reference frees it; gRPC's call functions are safe from any thread. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "common/list.h"
#include "common/log.h"
#include "daemon/rpc/rpc_internal.h"

void rpc_call_ref(fsdp_rpc_call_t *call) {
  atomic_fetch_add(&call->refs, 1);
}

void rpc_call_unref(fsdp_rpc_call_t *call) {
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
void rpc_request_call(fsdp_rpc_endpoint_t *endpoint, method_t *method) {
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
                                            &call->request_payload, rpc_queue(server), rpc_queue(server),
                                            &call->request_tag);
  else
    e = grpc_server_request_call(endpoint->grpc, &call->call, &call->details,
                                 &call->request_metadata, rpc_queue(server), rpc_queue(server),
                                 &call->request_tag);
  if (e != GRPC_CALL_OK) {
    log_error("cannot request calls for %s: gRPC error %d", method ? method->path : "*", e);
    rpc_call_unref(call);
  }
}

/* gRPC names a connection made from a file descriptor "fd:N"; -1 for any other. */
int rpc_peer_fd(grpc_call *call) {
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
  return call->conn_fd >= 0 ? call->conn_fd : rpc_peer_fd(call->call);
}

int64_t fsdp_rpc_call_deadline_ms(const fsdp_rpc_call_t *call) {
  if (gpr_time_cmp(call->deadline, gpr_inf_future(call->deadline.clock_type)) == 0)
    return INT64_MAX;
  gpr_timespec left = gpr_time_sub(gpr_convert_clock_type(call->deadline, GPR_CLOCK_MONOTONIC),
                                   gpr_now(GPR_CLOCK_MONOTONIC));
  return gpr_time_to_millis(left);
}
