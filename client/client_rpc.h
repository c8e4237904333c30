/* client_rpc: generic unary calls on an fsdp_client_t, for the tools in this repository
 * (fsdpctl, benches, tests).
 *
 * Trainers use the typed functions of <fsdp/fsdp_client.h>; this header exposes protobuf-c
 * types, so it is not installed. The same contract holds: one thread at a time per client,
 * every call has a deadline (timeout_ms <= 0: the client's default), a failure returns the
 * negative code mapped from the gRPC status through the wire status table and records the
 * status message as the client's last error, and a success clears it. */
#ifndef FSDP_CLIENT_RPC_H
#define FSDP_CLIENT_RPC_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include <fsdp/fsdp_client.h>

/* One unary call to method_path ("/fsdp.v1.Operator/Status"). request is borrowed and
 * encoded with the wire codec; the reply is decoded as reply_desc and validated, and
 * *ret_reply is the caller's, freed with protobuf_c_message_free_unpacked(reply, NULL). A
 * reply that does not decode fails with FSDP_E_INTERNAL and names the type. */
int fsdp_client_call(fsdp_client_t *client, const char *method_path,
                     const ProtobufCMessage *request, const ProtobufCMessageDescriptor *reply_desc,
                     int timeout_ms, ProtobufCMessage **ret_reply);

/* The same call with the payload as raw bytes, so that tests and benches can send what the
 * codec never would (garbage, truncated messages). request == NULL sends no message at all
 * (the server sees a missing request); a non-NULL request of length 0 sends an empty one.
 * On success *ret_reply is a malloc'd copy of the reply (free() it), or NULL with
 * *ret_reply_len 0 when the server sent no message. */
int fsdp_client_call_raw(fsdp_client_t *client, const char *method_path, const void *request,
                         size_t request_len, int timeout_ms, uint8_t **ret_reply,
                         size_t *ret_reply_len);

/* A unary call started now and ended later, so that its caller can work meanwhile (the
 * trainer's prefetching Unshard). The call's deadline runs from fsdp_client_call_start
 * (timeout_ms <= 0: the client's default). Other calls, blocking or started, may be made on
 * the client while it is in flight, from the same thread. Every started call is ended by
 * exactly one fsdp_client_call_finish or fsdp_client_call_cancel, all of them before
 * fsdp_client_close. request is borrowed (it is encoded at once). */
typedef struct fsdp_client_started fsdp_client_started_t;

int fsdp_client_call_start(fsdp_client_t *client, const char *method_path,
                           const ProtobufCMessage *request, int timeout_ms,
                           fsdp_client_started_t **ret_started);

/* Waits for a started call's reply, at most wait_ms (<= 0: until the call's own deadline),
 * and ends it: takes ownership of started and frees it whatever the outcome. A wait that
 * runs out cancels the call and fails with FSDP_E_DEADLINE_EXCEEDED. Reply and errors as for
 * fsdp_client_call. */
int fsdp_client_call_finish(fsdp_client_t *client, fsdp_client_started_t *started,
                            const ProtobufCMessageDescriptor *reply_desc, int wait_ms,
                            ProtobufCMessage **ret_reply);

/* Cancels a started call, waits until gRPC lets go of it (promptly) and frees it. The last
 * error is left alone, so that a failure path can cancel without losing its message.
 * NULL-safe. */
void fsdp_client_call_cancel(fsdp_client_t *client, fsdp_client_started_t *started);

/* Records a failure found on the caller's side of the library (a memory channel, a reply
 * that does not fit) as the client's last error, formatted; returns code. A NULL client
 * records nothing. */
__attribute__((format(printf, 3, 4))) int fsdp_client_set_last_error(fsdp_client_t *client,
                                                                     int code, const char *fmt,
                                                                     ...);

/* The client's default deadline in milliseconds (from its options). */
int fsdp_client_default_timeout_ms(const fsdp_client_t *client);

#endif
