/* The loop's side of an arrived call: it is counted against its endpoint's budgets, then
 * refused (cut connection, refused uid, missing token, unknown method, over budget, passed
 * deadline, oversized or bad request, draining) or handed to its method's handler. Loop
 * thread. Apart from the server because it is the policy every call meets, not plumbing. */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/support/alloc.h>

#include <fsdp/fsdp_version.h>

#include "common/list.h"
#include "common/log.h"
#include "daemon/rpc/rpc_internal.h"
#include "proto/wire.h"

static const char *const budget_names[BUDGET_COUNT] = {
    "health and operator calls", "calls of work", "streams", "refused calls"};

#define AUTH_LOG_INTERVAL_MS 1000

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

void rpc_active_unlink(fsdp_rpc_server_t *server, fsdp_rpc_call_t *call) {
  fsdp_list_remove(&call->active);
  server->inflight--;
  call->endpoint->inflight--;
  call->endpoint->held[call->budget]--;
  if (call->is_work)
    server->work--;
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

/* The call came on a connection cut for holding more calls than its streams. */
static void refuse_cut_connection(fsdp_rpc_call_t *call) {
  char *path = grpc_slice_to_c_string(call->details.method);
  snprintf(call->path, sizeof call->path, "%s", call->method ? call->method->path : path);
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
}

/* The endpoint serves no one (a uid not let in): every call hears why. */
static void refuse_caller(fsdp_rpc_call_t *call) {
  char *path = grpc_slice_to_c_string(call->details.method);
  snprintf(call->path, sizeof call->path, "%s", path);
  gpr_free(path);
  char why[256];
  call->endpoint->options.refuse(call->endpoint->options.refuse_data, call->conn_fd, why,
                                 sizeof why);
  fsdp_rpc_call_fail(call, FSDP_E_PERMISSION_DENIED, "%s: %s", call->path, why);
}

/* authenticated() for any call, registered or not; false when it failed the call. */
static bool token_passes(fsdp_rpc_call_t *call) {
  method_t *method = call->method;
  char *path = method ? NULL : grpc_slice_to_c_string(call->details.method);
  bool ok = authenticated(call, method ? method->path : path);
  if (!ok)
    snprintf(call->path, sizeof call->path, "%s", method ? method->path : path);
  gpr_free(path);
  return ok;
}

static void refuse_unknown_method(fsdp_rpc_call_t *call) {
  char *path = grpc_slice_to_c_string(call->details.method);
  snprintf(call->path, sizeof call->path, "%s", path);
  call->deadline = call->details.deadline;
  fsdp_rpc_call_fail(call, FSDP_E_UNIMPLEMENTED, "unknown method '%s' on the %s endpoint",
                     path, call->endpoint->name);
  gpr_free(path);
}

/* The budget, the deadline and the request's size, checked before decoding, which costs
 * the loop time in proportion to the bytes; false when it failed the call. */
static bool within_limits(fsdp_rpc_call_t *call, const method_t *method) {
  fsdp_rpc_endpoint_t *ep = call->endpoint;
  const char *limit_name;
  unsigned limit = budget_limit(ep, call->budget, &limit_name);
  if (ep->held[call->budget] > limit) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED,
                       "%s: the %s endpoint already holds %u %s (%s = %u)", call->path, ep->name,
                       ep->held[call->budget] - 1, budget_names[call->budget], limit_name, limit);
    return false;
  }
  if (fsdp_rpc_call_deadline_ms(call) <= 0) {
    fsdp_rpc_call_fail(call, FSDP_E_DEADLINE_EXCEEDED, "%s: deadline passed before dispatch",
                       call->path);
    return false;
  }
  size_t size = call->request_payload ? grpc_byte_buffer_length(call->request_payload) : 0;
  if (size > method->max_request) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED,
                       "%s: request of %zu bytes, more than the %zu bytes this method takes",
                       call->path, size, method->max_request);
    return false;
  }
  return true;
}

/* Decodes the request and hands it to the method's handler, unless the method has none or
 * the server drains. */
static void run_handler(fsdp_rpc_call_t *call, method_t *method) {
  fsdp_rpc_server_t *server = call->server;
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

void rpc_dispatch(fsdp_rpc_call_t *call) {
  fsdp_rpc_server_t *server = call->server;
  method_t *method = call->method;
  server->calls_total++;
  /* Calls of a cut connection are refused without work and count against no budget. */
  call->budget = call->conn_cut ? BUDGET_REFUSED : budget_of(method);
  active_link(server, call);
  if (call->conn_cut) {
    refuse_cut_connection(call);
    return;
  }
  if (call->endpoint->options.refuse) {
    refuse_caller(call);
    return;
  }
  /* Before anything else: an unauthenticated caller learns nothing, not even which
   * methods exist. */
  if (!token_passes(call))
    return;
  if (!method) {
    refuse_unknown_method(call);
    return;
  }
  memcpy(call->path, method->path, sizeof call->path);
  if (within_limits(call, method))
    run_handler(call, method);
}
