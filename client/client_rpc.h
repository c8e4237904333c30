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

/* The client's default deadline in milliseconds (from its options). */
int fsdp_client_default_timeout_ms(const fsdp_client_t *client);

#endif
