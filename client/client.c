/* The fsdpd client: one gRPC channel and one pluck completion queue per client, blocking
 * unary calls with deadlines, unary calls started now and finished later (each batch tagged
 * with its own state, so several may wait on the queue), and the translation of gRPC statuses
 * into fsdp error codes and last-error messages. gRPC types stay inside this file; callers see
 * fsdp codes. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include <fsdp/fsdp_client.h>

#include "client/client_rpc.h"
#include "grpc/health/v1/health.pb-c.h"
#include "proto/wire.h"

/* Local failures and the daemon's messages both land here; long daemon messages are cut. */
#define LAST_ERROR_MAX 1024

/* How long past a call's own deadline we wait for gRPC to report it, before cancelling the
 * call ourselves. gRPC enforces the deadline, so this only guards against a stuck core. */
#define PLUCK_GRACE_MS 2000

/* Reconnect backoff. gRPC's defaults (1 s growing to 120 s) suit remote servers; the daemon
 * is local, a reconnect costs a connect(2), and a trainer whose daemon restarted should not
 * wait minutes to notice it is back. GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is deliberately left
 * alone: despite its name it is also the connect timeout, HTTP/2 handshake included, and a
 * small value makes a busy daemon look unreachable (test_slow_handshake_is_not_unavailable). */
#define RECONNECT_INITIAL_MS 100
#define RECONNECT_MAX_MS 2000

struct fsdp_client {
  grpc_channel *channel;
  grpc_completion_queue *cq;
  char *target;
  int timeout_ms;
  bool wait_for_ready;
  bool grpc_initialized;
  bool peer_message; /* last_error is the daemon's own status message */
  char last_error[LAST_ERROR_MAX];
};

__attribute__((format(printf, 3, 0))) static int set_error_v(fsdp_client_t *client, int code,
                                                             const char *fmt, va_list ap) {
  client->peer_message = false;
  vsnprintf(client->last_error, sizeof client->last_error, fmt, ap);
  return code;
}

__attribute__((format(printf, 3, 4))) static int set_error(fsdp_client_t *client, int code,
                                                           const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_error_v(client, code, fmt, ap);
  va_end(ap);
  return code;
}

static void clear_error(fsdp_client_t *client) {
  client->last_error[0] = '\0';
  client->peer_message = false;
}

const char *fsdp_health_status_name(fsdp_health_status_t status) {
  switch (status) {
  case FSDP_HEALTH_UNKNOWN:
    return "UNKNOWN";
  case FSDP_HEALTH_SERVING:
    return "SERVING";
  case FSDP_HEALTH_NOT_SERVING:
    return "NOT_SERVING";
  case FSDP_HEALTH_SERVICE_UNKNOWN:
    return "SERVICE_UNKNOWN";
  }
  return "UNKNOWN";
}

int fsdp_client_connect(const char *target, const fsdp_client_options_t *opts,
                        fsdp_client_t **ret_client) {
  static const fsdp_client_options_t defaults = FSDP_CLIENT_OPTIONS_INIT;
  if (!opts)
    opts = &defaults;
  if (!target || !*target || !ret_client || opts->timeout_ms < 0 || opts->max_message_bytes < 0)
    return -EINVAL;

  fsdp_client_t *client = calloc(1, sizeof *client);
  if (!client)
    return -ENOMEM;
  client->target = strdup(target);
  if (!client->target) {
    free(client);
    return -ENOMEM;
  }
  client->timeout_ms = opts->timeout_ms > 0 ? opts->timeout_ms : FSDP_CLIENT_DEFAULT_TIMEOUT_MS;
  client->wait_for_ready = opts->wait_for_ready;
  int max_message =
      opts->max_message_bytes > 0 ? opts->max_message_bytes : FSDP_CLIENT_DEFAULT_MAX_MESSAGE_BYTES;

  /* Each client holds one reference on the library, so clients may come and go in any
   * order and the last close shuts gRPC down. */
  grpc_init();
  client->grpc_initialized = true;

  grpc_arg args[] = {
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, {.integer = max_message}},
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, {.integer = max_message}},
      {GRPC_ARG_INTEGER, GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, {.integer = RECONNECT_INITIAL_MS}},
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, {.integer = RECONNECT_MAX_MS}},
  };
  grpc_channel_args channel_args = {sizeof args / sizeof args[0], args};
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  if (!creds)
    goto err_client;
  client->channel = grpc_channel_create(client->target, creds, &channel_args);
  grpc_channel_credentials_release(creds);
  /* gRPC returns a "lame" channel rather than NULL for a target it cannot parse; its calls
   * then fail with a message naming the target, which is the error we want to show. */
  if (!client->channel)
    goto err_client;
  client->cq = grpc_completion_queue_create_for_pluck(NULL);
  if (!client->cq)
    goto err_client;

  *ret_client = client;
  return 0;

err_client:
  fsdp_client_close(client);
  return -ENOMEM;
}

void fsdp_client_close(fsdp_client_t *client) {
  if (!client)
    return;
  if (client->channel)
    grpc_channel_destroy(client->channel);
  if (client->cq) {
    /* Every blocking call has completed before its function returned, and every started
     * call was finished or cancelled (the contract), so the queue is empty and the pluck
     * returns GRPC_QUEUE_SHUTDOWN at once; the deadline only bounds the impossible. */
    grpc_completion_queue_shutdown(client->cq);
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                         gpr_time_from_millis(PLUCK_GRACE_MS, GPR_TIMESPAN));
    grpc_event ev;
    do {
      ev = grpc_completion_queue_pluck(client->cq, NULL, deadline, NULL);
    } while (ev.type == GRPC_OP_COMPLETE);
    grpc_completion_queue_destroy(client->cq);
  }
  if (client->grpc_initialized)
    grpc_shutdown();
  free(client->target);
  free(client);
}

const char *fsdp_client_last_error(const fsdp_client_t *client) {
  return client ? client->last_error : "";
}

int fsdp_client_default_timeout_ms(const fsdp_client_t *client) {
  return client ? client->timeout_ms : FSDP_CLIENT_DEFAULT_TIMEOUT_MS;
}

/* Turns a failed status into the client's last error and returns its fsdp code. The daemon's
 * own message is kept verbatim; failures gRPC raised on this side (no connection, deadline)
 * get the target and the time limit added, which is what a user needs to act. gRPC's
 * error_string is a debug dump (file, line, timestamps), not a message for people. */
static int record_status(fsdp_client_t *client, grpc_status_code status, grpc_slice details,
                         int timeout_ms) {
  int code = fsdp_wire_error_from_status(status);
  int len = (int)GRPC_SLICE_LENGTH(details);
  const char *text = (const char *)GRPC_SLICE_START_PTR(details);

  if (status == GRPC_STATUS_DEADLINE_EXCEEDED) {
    bool generic = len == 0 || (len == 17 && memcmp(text, "Deadline Exceeded", 17) == 0);
    if (generic)
      return set_error(client, code, "no reply from %s within %d ms", client->target,
                       timeout_ms);
    return set_error(client, code, "%.*s (%s, %d ms)", len, text, client->target, timeout_ms);
  }
  if (status == GRPC_STATUS_UNAVAILABLE &&
      grpc_channel_check_connectivity_state(client->channel, 0) != GRPC_CHANNEL_READY) {
    /* Without a connection the message is gRPC's, not the daemon's. */
    return set_error(client, code, "cannot reach fsdpd at %s: %.*s", client->target, len, text);
  }
  if (len == 0)
    return set_error(client, code, "%s (gRPC status %d without a message)", fsdp_strerror(code),
                     (int)status);
  set_error(client, code, "%.*s", len, text);
  client->peer_message = true;
  return code;
}

/* One call in flight and everything its batch borrows. It lives on the stack for a blocking
 * call (unary) and on the heap for a started one; its address is the batch's tag, unique
 * while the call is on the queue. */
typedef struct call_state {
  grpc_call *call;
  gpr_timespec deadline;
  int timeout_ms;
  grpc_metadata_array initial_md, trailing_md;
  grpc_byte_buffer *recv;
  grpc_status_code status;
  grpc_slice details;
  const char *error_string;
  grpc_op ops[6];
} call_state_t;

struct fsdp_client_started {
  call_state_t cs;
  grpc_byte_buffer *send; /* the batch borrows it until the call completes */
  char method[FSDP_WIRE_PATH_MAX];
};

static void call_state_cleanup(call_state_t *cs) {
  grpc_metadata_array_destroy(&cs->initial_md);
  grpc_metadata_array_destroy(&cs->trailing_md);
  grpc_slice_unref(cs->details);
  gpr_free((void *)cs->error_string);
  if (cs->recv)
    grpc_byte_buffer_destroy(cs->recv);
  if (cs->call)
    grpc_call_unref(cs->call);
}

/* Creates a call with its deadline and starts its one batch, tagged cs. send is borrowed
 * until the call completes and may be NULL (no message). On failure cs is cleaned up. */
static int call_begin(fsdp_client_t *client, const char *method, grpc_byte_buffer *send,
                      int timeout_ms, call_state_t *cs) {
  memset(cs, 0, sizeof *cs);
  grpc_metadata_array_init(&cs->initial_md);
  grpc_metadata_array_init(&cs->trailing_md);
  cs->status = GRPC_STATUS_UNKNOWN;
  cs->details = grpc_empty_slice();
  cs->timeout_ms = timeout_ms > 0 ? timeout_ms : client->timeout_ms;
  cs->deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                              gpr_time_from_millis(cs->timeout_ms, GPR_TIMESPAN));

  /* create_call takes its own reference on the method slice. */
  grpc_slice method_slice = grpc_slice_from_copied_string(method);
  cs->call = grpc_channel_create_call(client->channel, NULL, GRPC_PROPAGATE_DEFAULTS,
                                      client->cq, method_slice, NULL, cs->deadline, NULL);
  grpc_slice_unref(method_slice);
  if (!cs->call) {
    call_state_cleanup(cs);
    return set_error(client, -ENOMEM, "%s: could not create a call on %s", method,
                     client->target);
  }

  grpc_op *ops = cs->ops;
  size_t n = 0;
  ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (client->wait_for_ready)
    ops[n].flags =
        GRPC_INITIAL_METADATA_WAIT_FOR_READY | GRPC_INITIAL_METADATA_WAIT_FOR_READY_EXPLICITLY_SET;
  n++;
  if (send) {
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = send;
    n++;
  }
  ops[n++].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[n++].data.recv_initial_metadata.recv_initial_metadata = &cs->initial_md;
  ops[n].op = GRPC_OP_RECV_MESSAGE;
  ops[n++].data.recv_message.recv_message = &cs->recv;
  ops[n].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[n].data.recv_status_on_client.trailing_metadata = &cs->trailing_md;
  ops[n].data.recv_status_on_client.status = &cs->status;
  ops[n].data.recv_status_on_client.status_details = &cs->details;
  ops[n].data.recv_status_on_client.error_string = &cs->error_string;
  n++;

  grpc_call_error ce = grpc_call_start_batch(cs->call, ops, n, cs, NULL);
  if (ce != GRPC_CALL_OK) {
    call_state_cleanup(cs);
    return set_error(client, FSDP_E_INTERNAL, "%s: grpc_call_start_batch failed (%d)", method,
                     (int)ce);
  }
  return 0;
}

/* Waits for a begun call until wait_until and ends it (cs is cleaned up in every case). A
 * wait that runs out cancels the call and reports DEADLINE_EXCEEDED after waited_ms. On
 * success *ret_recv is the reply buffer (NULL when the server sent none), the caller's. */
static int call_end(fsdp_client_t *client, const char *method, call_state_t *cs,
                    gpr_timespec wait_until, int waited_ms, grpc_byte_buffer **ret_recv) {
  int r;
  grpc_event ev = grpc_completion_queue_pluck(client->cq, cs, wait_until, NULL);
  if (ev.type == GRPC_QUEUE_TIMEOUT) {
    /* The batch still owns our buffers, so it must finish before we free them; a cancelled
     * call completes promptly, which bounds this second wait. Its "Cancelled" details would
     * hide why: the time ran out. */
    grpc_call_cancel(cs->call, NULL);
    ev = grpc_completion_queue_pluck(client->cq, cs, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    cs->status = GRPC_STATUS_DEADLINE_EXCEEDED;
    grpc_slice_unref(cs->details);
    cs->details = grpc_empty_slice();
  }
  if (ev.type != GRPC_OP_COMPLETE) {
    r = set_error(client, FSDP_E_INTERNAL, "%s: completion queue of %s shut down", method,
                  client->target);
    goto out;
  }
  /* With RECV_STATUS_ON_CLIENT in the batch, the batch succeeds even when the RPC fails: the
   * outcome is in status. */
  if (cs->status != GRPC_STATUS_OK) {
    r = record_status(client, cs->status, cs->details, waited_ms);
    goto out;
  }
  *ret_recv = cs->recv;
  cs->recv = NULL;
  clear_error(client);
  r = 0;

out:
  call_state_cleanup(cs);
  return r;
}

/* One blocking unary call: send is borrowed and may be NULL (no message). On success
 * *ret_recv is the reply buffer (NULL when the server sent none), which the caller destroys. */
static int unary(fsdp_client_t *client, const char *method, grpc_byte_buffer *send,
                 int timeout_ms, grpc_byte_buffer **ret_recv) {
  call_state_t cs;
  int r = call_begin(client, method, send, timeout_ms, &cs);
  if (r < 0)
    return r;
  /* gRPC enforces the deadline; the grace only guards against a stuck core. */
  gpr_timespec wait_until =
      gpr_time_add(cs.deadline, gpr_time_from_millis(PLUCK_GRACE_MS, GPR_TIMESPAN));
  return call_end(client, method, &cs, wait_until, cs.timeout_ms, ret_recv);
}

/* Decodes a reply buffer (borrowed) as reply_desc. */
static int decode_reply(fsdp_client_t *client, const char *method_path, grpc_byte_buffer *recv,
                        const ProtobufCMessageDescriptor *reply_desc,
                        ProtobufCMessage **ret_reply) {
  fsdp_status_t st = FSDP_STATUS_INIT;
  ProtobufCMessage *reply = NULL;
  if (fsdp_wire_decode(reply_desc, recv, &reply, &st) < 0)
    /* The daemon sent bytes this client cannot read: a version skew or a bug on one side,
     * not a bad argument of our caller. */
    return set_error(client, FSDP_E_INTERNAL, "%s: reply from %s: %s", method_path,
                     client->target, st.message);
  *ret_reply = reply;
  return 0;
}

int fsdp_client_call(fsdp_client_t *client, const char *method_path,
                     const ProtobufCMessage *request, const ProtobufCMessageDescriptor *reply_desc,
                     int timeout_ms, ProtobufCMessage **ret_reply) {
  if (!client)
    return -EINVAL;
  if (!method_path || method_path[0] != '/' || !request || !reply_desc || !ret_reply)
    return set_error(client, -EINVAL, "fsdp_client_call: method path, request, reply type "
                                      "and reply pointer are required");
  grpc_byte_buffer *send = NULL;
  int r = fsdp_wire_encode(request, &send);
  if (r < 0)
    return set_error(client, r, "%s: could not encode %s", method_path,
                     request->descriptor->name);
  grpc_byte_buffer *recv = NULL;
  r = unary(client, method_path, send, timeout_ms, &recv);
  grpc_byte_buffer_destroy(send);
  if (r < 0)
    return r;
  r = decode_reply(client, method_path, recv, reply_desc, ret_reply);
  if (recv)
    grpc_byte_buffer_destroy(recv);
  return r;
}

int fsdp_client_call_start(fsdp_client_t *client, const char *method_path,
                           const ProtobufCMessage *request, int timeout_ms,
                           fsdp_client_started_t **ret_started) {
  if (!client)
    return -EINVAL;
  if (!method_path || method_path[0] != '/' || strlen(method_path) >= FSDP_WIRE_PATH_MAX ||
      !request || !ret_started)
    return set_error(client, -EINVAL, "fsdp_client_call_start: method path (shorter than %d "
                                      "bytes), request and started pointer are required",
                     FSDP_WIRE_PATH_MAX);
  fsdp_client_started_t *started = calloc(1, sizeof *started);
  if (!started)
    return set_error(client, -ENOMEM, "%s: out of memory for a started call", method_path);
  snprintf(started->method, sizeof started->method, "%s", method_path);
  int r = fsdp_wire_encode(request, &started->send);
  if (r < 0) {
    free(started);
    return set_error(client, r, "%s: could not encode %s", method_path,
                     request->descriptor->name);
  }
  r = call_begin(client, method_path, started->send, timeout_ms, &started->cs);
  if (r < 0) {
    grpc_byte_buffer_destroy(started->send);
    free(started);
    return r;
  }
  clear_error(client);
  *ret_started = started;
  return 0;
}

int fsdp_client_call_finish(fsdp_client_t *client, fsdp_client_started_t *started,
                            const ProtobufCMessageDescriptor *reply_desc, int wait_ms,
                            ProtobufCMessage **ret_reply) {
  if (!client || !started)
    return -EINVAL;
  if (!reply_desc || !ret_reply) {
    fsdp_client_call_cancel(client, started);
    return set_error(client, -EINVAL, "fsdp_client_call_finish: reply type and reply pointer "
                                      "are required");
  }
  /* The call's own deadline, plus the grace of a blocking call, or the caller's shorter wait. */
  gpr_timespec wait_until = gpr_time_add(started->cs.deadline,
                                         gpr_time_from_millis(PLUCK_GRACE_MS, GPR_TIMESPAN));
  int waited_ms = started->cs.timeout_ms;
  if (wait_ms > 0) {
    gpr_timespec mine = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                     gpr_time_from_millis(wait_ms, GPR_TIMESPAN));
    if (gpr_time_cmp(mine, wait_until) < 0) {
      wait_until = mine;
      waited_ms = wait_ms;
    }
  }
  grpc_byte_buffer *recv = NULL;
  int r = call_end(client, started->method, &started->cs, wait_until, waited_ms, &recv);
  if (r == 0) {
    r = decode_reply(client, started->method, recv, reply_desc, ret_reply);
    if (recv)
      grpc_byte_buffer_destroy(recv);
  }
  grpc_byte_buffer_destroy(started->send);
  free(started);
  return r;
}

void fsdp_client_call_cancel(fsdp_client_t *client, fsdp_client_started_t *started) {
  if (!client || !started)
    return;
  grpc_call_cancel(started->cs.call, NULL);
  /* The batch owns our buffers until it completes, which a cancelled call does promptly. */
  grpc_completion_queue_pluck(client->cq, &started->cs, gpr_inf_future(GPR_CLOCK_MONOTONIC),
                              NULL);
  call_state_cleanup(&started->cs);
  grpc_byte_buffer_destroy(started->send);
  free(started);
}

int fsdp_client_set_last_error(fsdp_client_t *client, int code, const char *fmt, ...) {
  if (!client)
    return code;
  va_list ap;
  va_start(ap, fmt);
  set_error_v(client, code, fmt, ap);
  va_end(ap);
  return code;
}

int fsdp_client_call_raw(fsdp_client_t *client, const char *method_path, const void *request,
                         size_t request_len, int timeout_ms, uint8_t **ret_reply,
                         size_t *ret_reply_len) {
  if (!client)
    return -EINVAL;
  if (!method_path || method_path[0] != '/' || (!request && request_len) || !ret_reply ||
      !ret_reply_len)
    return set_error(client, -EINVAL, "fsdp_client_call_raw: method path and reply pointers "
                                      "are required");
  grpc_byte_buffer *send = NULL;
  if (request) {
    grpc_slice slice = grpc_slice_from_copied_buffer(request, request_len);
    send = grpc_raw_byte_buffer_create(&slice, 1);
    grpc_slice_unref(slice);
    if (!send)
      return set_error(client, -ENOMEM, "%s: out of memory for %zu request bytes", method_path,
                       request_len);
  }
  grpc_byte_buffer *recv = NULL;
  int r = unary(client, method_path, send, timeout_ms, &recv);
  if (send)
    grpc_byte_buffer_destroy(send);
  if (r < 0)
    return r;

  uint8_t *bytes = NULL;
  size_t len = 0;
  if (recv) {
    grpc_byte_buffer_reader reader;
    if (!grpc_byte_buffer_reader_init(&reader, recv)) {
      grpc_byte_buffer_destroy(recv);
      return set_error(client, FSDP_E_INTERNAL, "%s: reply from %s could not be decompressed",
                       method_path, client->target);
    }
    grpc_slice all = grpc_byte_buffer_reader_readall(&reader);
    grpc_byte_buffer_reader_destroy(&reader);
    grpc_byte_buffer_destroy(recv);
    len = GRPC_SLICE_LENGTH(all);
    bytes = malloc(len ? len : 1);
    if (bytes)
      memcpy(bytes, GRPC_SLICE_START_PTR(all), len);
    grpc_slice_unref(all);
    if (!bytes)
      return set_error(client, -ENOMEM, "%s: out of memory for %zu reply bytes", method_path,
                       len);
  }
  *ret_reply = bytes;
  *ret_reply_len = len;
  return 0;
}

int fsdp_client_health_check(fsdp_client_t *client, const char *service, int timeout_ms,
                             fsdp_health_status_t *ret_status) {
  if (!client)
    return -EINVAL;
  if (!ret_status)
    return set_error(client, -EINVAL, "fsdp_client_health_check: ret_status is required");
  if (!service)
    service = "";

  const ProtobufCServiceDescriptor *sd = &grpc__health__v1__health__descriptor;
  const ProtobufCMethodDescriptor *md = protobuf_c_service_descriptor_get_method_by_name(sd, "Check");
  char path[FSDP_WIRE_PATH_MAX];
  int r = md ? fsdp_wire_method_path(sd, (unsigned)(md - sd->methods), path, sizeof path) : -ENOENT;
  if (r < 0)
    return set_error(client, FSDP_E_INTERNAL, "grpc.health.v1.Health has no method Check");

  Grpc__Health__V1__HealthCheckRequest request = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  request.service = (char *)service;
  ProtobufCMessage *reply = NULL;
  r = fsdp_client_call(client, path, &request.base,
                       &grpc__health__v1__health_check_response__descriptor, timeout_ms, &reply);
  if (r == FSDP_E_NOT_FOUND && !client->peer_message)
    set_error(client, r, "service '%s' is not known to fsdpd at %s", service, client->target);
  if (r < 0)
    return r;
  /* The decoder has checked that the value is one of the enum's. */
  *ret_status = (fsdp_health_status_t)((Grpc__Health__V1__HealthCheckResponse *)reply)->status;
  protobuf_c_message_free_unpacked(reply, NULL);
  return 0;
}
