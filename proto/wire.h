/* The wire codec: protobuf-c messages in and out of gRPC byte buffers, request validation,
 * and the one table that maps fsdp error codes to gRPC status codes and back.
 *
 * Both ends of every RPC use it: the daemon's server adapter and the client library. All
 * functions are pure (no shared state) and safe from any thread. Messages returned by the
 * decoders are the caller's, freed with protobuf_c_message_free_unpacked(msg, NULL). */
#ifndef FSDP_WIRE_H
#define FSDP_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <protobuf-c/protobuf-c.h>

#include "common/status.h"
#include "proto/limits.h"

/* Longest method path we build: "/" service "/" method. */
#define FSDP_WIRE_PATH_MAX 128

/* Writes "/<package>.<Service>/<Method>" for method index `method` of `service`. */
int fsdp_wire_method_path(const ProtobufCServiceDescriptor *service, unsigned method, char *buf,
                          size_t size);

/* Whether a method streams its replies. protobuf-c descriptors do not record streaming,
 * so the few streaming methods are listed here, where the wire is defined. */
bool fsdp_wire_method_is_server_streaming(const ProtobufCServiceDescriptor *service,
                                          unsigned method);

/* What a request may cost to decode. A health request is a service name; most others are
 * a few ids and names; the few that carry lists (RegisterUnit, SetSchedule) may take all of
 * rpc.max_message_size. Its fields (each element of a list, and fields the message does not
 * know, many of which protobuf-c allocates one by one) are counted at every level in the
 * wire bytes before anything is unpacked: at most FSDP_WIRE_MAX_FIELDS, except that a
 * RegisterUnit may also hold FSDP_WIRE_PARAM_FIELDS for each of the FSDP_UNIT_MAX_PARAMS
 * parameters the API promises (the entry, its name, its packed shape, dtype and
 * requires_grad), so that the unit's own check names a count past that limit. */
#define FSDP_WIRE_HEALTH_REQUEST_MAX 1024
#define FSDP_WIRE_SMALL_REQUEST_MAX 65536
#define FSDP_WIRE_MAX_FIELDS 65536
#define FSDP_WIRE_PARAM_FIELDS 5
#define FSDP_WIRE_REGISTER_UNIT_MAX_FIELDS \
  (FSDP_WIRE_MAX_FIELDS + FSDP_WIRE_PARAM_FIELDS * FSDP_UNIT_MAX_PARAMS)
/* A job's flight record as fsdpctl reads it from a file a timeout left (a TraceReply): at
 * most trace.ops' largest count of records, each itself and its fields. */
#define FSDP_WIRE_TRACE_RECORDS_MAX 65536
#define FSDP_WIRE_OP_RECORD_FIELDS 11
#define FSDP_WIRE_TRACE_MAX_FIELDS \
  (FSDP_WIRE_MAX_FIELDS + FSDP_WIRE_OP_RECORD_FIELDS * FSDP_WIRE_TRACE_RECORDS_MAX)

/* The most fields a request of type desc may hold, at every level. */
unsigned fsdp_wire_request_max_fields(const ProtobufCMessageDescriptor *desc);

/* The most bytes a request of method index `method` of `service` may have, given the
 * configured maximum max_message_size (which it never exceeds). */
size_t fsdp_wire_method_max_request(const ProtobufCServiceDescriptor *service, unsigned method,
                                    size_t max_message_size);

/* Packs msg into a new byte buffer that the caller destroys (after the batch using it). */
int fsdp_wire_encode(const ProtobufCMessage *msg, grpc_byte_buffer **ret_buffer);

/* Unpacks and validates a message of type desc (fsdp_wire_validate, and no string holding a
 * NUL byte, which a C string would cut short). On failure st names the type or the field
 * and why. A NULL buffer is an empty message (gRPC sends no bytes for one). */
int fsdp_wire_decode(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *buffer,
                     ProtobufCMessage **ret_msg, fsdp_status_t *st);
/* The same for a request a server received, which must first hold at most
 * fsdp_wire_request_max_fields(desc) fields at all levels (RESOURCE_EXHAUSTED naming the
 * field where the count passed it). */
int fsdp_wire_decode_request(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *buffer,
                             ProtobufCMessage **ret_msg, fsdp_status_t *st);
int fsdp_wire_decode_request_bytes(const ProtobufCMessageDescriptor *desc, const uint8_t *data,
                                   size_t len, ProtobufCMessage **ret_msg, fsdp_status_t *st);
int fsdp_wire_decode_bytes(const ProtobufCMessageDescriptor *desc, const uint8_t *data,
                           size_t len, ProtobufCMessage **ret_msg, fsdp_status_t *st);

/* Checks what protobuf-c accepts but a proto3 peer must not send: enum values outside the
 * enum, strings that are not UTF-8, and field number 0. st names the field path and value. */
int fsdp_wire_validate(const ProtobufCMessage *msg, fsdp_status_t *st);

/* Memory-channel frames (fsdp/v1/channel.proto): exactly this many bytes, a little-endian
 * uint32 length, the message, zeros. */
#define FSDP_CHANNEL_FRAME_BYTES 4096

/* Packs msg into frame (FSDP_CHANNEL_FRAME_BYTES); -EMSGSIZE if it does not fit. */
int fsdp_wire_frame_encode(const ProtobufCMessage *msg, uint8_t *frame);
/* Unpacks and validates a frame of `len` bytes as a message of type desc. */
int fsdp_wire_frame_decode(const ProtobufCMessageDescriptor *desc, const uint8_t *frame,
                           size_t len, ProtobufCMessage **ret_msg, fsdp_status_t *st);

/* The status table. Unknown or positive errors map to INTERNAL / OK. */
grpc_status_code fsdp_wire_status_from_error(int err);
int fsdp_wire_error_from_status(grpc_status_code code);
/* A gRPC status code's name as gRPC spells it ("NOT_FOUND"); "UNKNOWN" for a value gRPC
 * does not define. fsdp_error_status_name (include/fsdp/fsdp_error.h) is the table and this
 * together, for libfsdp's users. */
const char *fsdp_wire_status_name(grpc_status_code code);

/* A peer's state as operators read it: "JOINED" for PEER_STATE_JOINED; "UNSPECIFIED" for a
 * value the enum does not have. */
const char *fsdp_wire_peer_state_name(int state);

#endif
