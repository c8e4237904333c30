/* fsdp_client: the C client of fsdpd, linked by trainers and tools.
 *
 * A client owns one gRPC channel to one daemon endpoint and one completion queue; each call
 * is a blocking unary RPC with a deadline, so nothing waits forever. Connecting is lazy: the
 * first call opens the connection, and a daemon that restarts is reconnected to on the next
 * call.
 *
 * Threads: a client is used by one thread at a time (calls and last_error share its state).
 * Different clients may be used from different threads at once. Do not fork after
 * connecting (gRPC's rule).
 *
 * Errors: every fallible function returns >= 0 on success and a negative code on failure, a
 * domain code from <fsdp/fsdp_error.h> or -errno; fsdp_strerror() describes it, and
 * fsdp_client_last_error() gives the message that came with it. A daemon-side error arrives
 * as the code the daemon raised (through the RPC status table): an unknown health service
 * is FSDP_E_NOT_FOUND, a daemon that cannot be reached FSDP_E_UNAVAILABLE, a call that ran
 * out of time FSDP_E_DEADLINE_EXCEEDED. */
#ifndef FSDP_CLIENT_H
#define FSDP_CLIENT_H

#include <stdbool.h>
#include <stddef.h>

#include <fsdp/fsdp_error.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fsdp_client fsdp_client_t;

/* Defaults for the fields of fsdp_client_options_t left at zero. */
#define FSDP_CLIENT_DEFAULT_TIMEOUT_MS 5000
#define FSDP_CLIENT_DEFAULT_MAX_MESSAGE_BYTES (64 << 20)

typedef struct fsdp_client_options {
  /* Deadline of a call that passes timeout_ms <= 0. 0: FSDP_CLIENT_DEFAULT_TIMEOUT_MS. */
  int timeout_ms;
  /* Largest message sent or received, in bytes. gRPC's own default is 4 MiB, too small for
   * shard metadata. 0: FSDP_CLIENT_DEFAULT_MAX_MESSAGE_BYTES. */
  int max_message_bytes;
  /* false (the default): a call fails at once with FSDP_E_UNAVAILABLE while the daemon
   * cannot be reached. true: a call waits for the daemon to come up, until its deadline
   * (FSDP_E_DEADLINE_EXCEEDED); trainers that ride out a daemon restart want this. */
  bool wait_for_ready;
} fsdp_client_options_t;

/* All defaults. */
#define FSDP_CLIENT_OPTIONS_INIT {0, 0, false}

/* Serving status of the standard gRPC health protocol (grpc.health.v1); the values match it. */
typedef enum fsdp_health_status {
  FSDP_HEALTH_UNKNOWN = 0,
  FSDP_HEALTH_SERVING = 1,
  FSDP_HEALTH_NOT_SERVING = 2,
  FSDP_HEALTH_SERVICE_UNKNOWN = 3,
} fsdp_health_status_t;

/* "UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"; never NULL. */
const char *fsdp_health_status_name(fsdp_health_status_t status);

/* Makes a client for a gRPC target: "unix:/abs/path", "unix:relative/path" or "host:port".
 * opts is borrowed (NULL: all defaults). Fails with -EINVAL for a NULL or empty target or a
 * negative option; nothing is contacted yet. */
int fsdp_client_connect(const char *target, const fsdp_client_options_t *opts,
                        fsdp_client_t **ret_client);

/* Closes the channel and frees the client. NULL is a no-op. No call may be in progress. */
void fsdp_client_close(fsdp_client_t *client);

/* The message of the last failed call: the daemon's status message, or a local one when the
 * failure happened on this side (unreachable daemon, deadline, malformed reply). "" after a
 * successful call and for a NULL client. Valid until the next call on this client. */
const char *fsdp_client_last_error(const fsdp_client_t *client);

/* grpc.health.v1.Health/Check for service ("" or NULL: the daemon as a whole). timeout_ms
 * <= 0 uses the client's default. A service the daemon does not know fails with
 * FSDP_E_NOT_FOUND. *ret_status is written only on success. */
int fsdp_client_health_check(fsdp_client_t *client, const char *service, int timeout_ms,
                             fsdp_health_status_t *ret_status);

#ifdef __cplusplus
}
#endif
#endif
