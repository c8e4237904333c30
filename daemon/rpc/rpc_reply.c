/* A call's replies: the queue of messages a handler sends (several on a streaming call, one
 * on a unary one), the send batches that carry them with the final status, one at a time,
 * and the end of a call its client left or a stop cut. Loop thread. Apart from the dispatch
 * because a reply may leave long after the handler returned. */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/grpc.h>

#include "common/log.h"
#include "common/status.h"
#include "daemon/rpc/rpc_internal.h"
#include "proto/wire.h"

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
  rpc_call_ref(call);
  grpc_call_error e = grpc_call_start_batch(call->call, ops, n, &call->send_tag, NULL);
  if (e != GRPC_CALL_OK) {
    /* Only misuse of the API fails here; treat it as a failed send so the call still ends. */
    log_error("%s: cannot start a send batch: gRPC error %d", call->path, e);
    rpc_post(call->server, &call->send_tag, false);
  }
}

static void finish(fsdp_rpc_call_t *call, grpc_status_code status, const char *details) {
  if (call->status_queued) {
    log_error("%s: answered twice; the second answer (%s) is dropped", call->path, details);
    return;
  }
  call->status_queued = true;
  call->status = status;
  if (call->method && (unsigned)status < FSDP_RPC_CODES)
    call->method->ended[status]++;
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

/* Ends a call whose client is gone or whose server is stopping: its owner hears first. */
void rpc_call_cancel(fsdp_rpc_call_t *call, grpc_status_code status, const char *why) {
  if (call->status_queued)
    return;
  if (call->on_cancel)
    call->on_cancel(call, call->cancel_data);
  if (!call->status_queued)
    finish(call, status, why);
}

void rpc_call_sent(fsdp_rpc_call_t *call, bool success) {
  call->batch_in_flight = false;
  if (call->sending) {
    grpc_byte_buffer_destroy(call->sending);
    call->sending = NULL;
  }
  if (!success && !call->status_sent) {
    /* The stream broke under us (client gone); end it instead of sending into the void. */
    call->cancel_seen = true;
    rpc_call_cancel(call, GRPC_STATUS_CANCELLED, "stream broken");
  }
  if (call->status_sent && !call->batch_in_flight) {
    rpc_active_unlink(call->server, call);
    rpc_call_unref(call); /* the loop's reference, held since arrival */
    return;
  }
  pump(call);
}
