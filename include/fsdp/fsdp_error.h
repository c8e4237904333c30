/* Error codes of the fsdp libraries and the daemon.
 *
 * A fallible function returns int: >= 0 on success, a negative value on failure: either
 * -errno for a system error, or one of the domain codes below. The domain codes carry the
 * meaning a caller acts on (retry, fix the request, give up); the RPC layer maps each to a
 * gRPC status in one table, and back, so a code survives the trip from daemon to client.
 * fsdp_strerror() works for both kinds and is safe from any thread. */
#ifndef FSDP_ERROR_H
#define FSDP_ERROR_H

#ifdef __cplusplus
extern "C" {
#endif

/* X(name, value, description). Values stay below -4095 so they never collide with -errno. */
#define FSDP_ERROR_LIST(X)                                                         \
  X(FSDP_E_INVALID_ARGUMENT, -5001, "invalid argument")                            \
  X(FSDP_E_NOT_FOUND, -5002, "not found")                                          \
  X(FSDP_E_ALREADY_EXISTS, -5003, "already exists")                                \
  X(FSDP_E_PERMISSION_DENIED, -5004, "permission denied")                          \
  X(FSDP_E_RESOURCE_EXHAUSTED, -5005, "resource exhausted")                        \
  X(FSDP_E_FAILED_PRECONDITION, -5006, "failed precondition")                      \
  X(FSDP_E_ABORTED, -5007, "aborted")                                              \
  X(FSDP_E_OUT_OF_RANGE, -5008, "out of range")                                    \
  X(FSDP_E_UNIMPLEMENTED, -5009, "not implemented")                                \
  X(FSDP_E_UNAVAILABLE, -5010, "unavailable")                                      \
  X(FSDP_E_DEADLINE_EXCEEDED, -5011, "deadline exceeded")                          \
  X(FSDP_E_CANCELLED, -5012, "cancelled")                                          \
  X(FSDP_E_UNAUTHENTICATED, -5013, "unauthenticated")                              \
  X(FSDP_E_DATA_LOSS, -5014, "data loss")                                          \
  X(FSDP_E_INTERNAL, -5015, "internal error")                                      \
  X(FSDP_E_UNKNOWN, -5016, "unknown error")                                        \
  X(FSDP_E_PROTOCOL_VERSION, -5017, "protocol version mismatch")                   \
  X(FSDP_E_CONFIG, -5018, "invalid configuration")

enum fsdp_error {
#define FSDP_ERROR_ENUM(name, value, text) name = value,
  FSDP_ERROR_LIST(FSDP_ERROR_ENUM)
#undef FSDP_ERROR_ENUM
};

/* A static description of err (a domain code or -errno); never NULL. */
const char *fsdp_strerror(int err);

/* The name of a domain code ("FSDP_E_NOT_FOUND"), or NULL for anything else. */
const char *fsdp_error_name(int err);

/* The gRPC status err travels as between daemon and client, by name ("NOT_FOUND"; "OK" for
 * err >= 0, "INTERNAL" for an error the RPC layer's table does not map): the table itself,
 * for bindings that would otherwise keep a copy of it. Static, never NULL. */
const char *fsdp_error_status_name(int err);

#ifdef __cplusplus
}
#endif
#endif
