/* The memory channel (proto/fsdp/v1/channel.proto): hands trainers the descriptors of their
 * job's shared memory, and tells the daemon at once when a trainer's process is gone.
 *
 * It accepts on the listener's SOCK_SEQPACKET socket through the same accept loop as the
 * gRPC socket (daemon/accept/acceptor.h): the same credentials are let in, and each uid may
 * hold rpc.max_connections_per_uid connections, of which those that have not said hello
 * are idle. It reads one ChannelHello within CHANNEL_HELLO_TIMEOUT_MS, asks the daemon for
 * the welcome (the `welcome` callback: status, memories and their descriptors), sends it, and
 * then holds the connection for the session: end of file, or anything more the trainer
 * sends, calls `closed` so the daemon ends the session. The daemon ends a connection when the
 * session ends for another reason (fsdp_channel_conn_close).
 *
 * Loop thread only. Connections are freed after their handle's close callback. */
#ifndef FSDP_CHANNEL_H
#define FSDP_CHANNEL_H

#include <stdint.h>

#include <uv.h>

#include "fsdp/v1/channel.pb-c.h"

#include "common/credentials.h"
#include "common/list.h"
#include "common/status.h"
#include "proto/limits.h"
#include "daemon/accept/acceptor.h"

#define FSDP_CHANNEL_HELLO_TIMEOUT_MS 5000
#define FSDP_CHANNEL_MAX_FDS 8
/* Connections that have not said hello yet, all uids together: beyond, the oldest such
 * connection of the uid holding the most is told why in a ChannelWelcome and closed. */
#define FSDP_CHANNEL_MAX_PENDING 64

typedef struct fsdp_channel_conn fsdp_channel_conn_t;

/* What the daemon answers a hello with. memories/fds are borrowed until the callback's
 * caller has sent them; a status other than 0 sends neither. fds[i] is memories[i]'s for
 * i < n; the n_fds - n after them are the fast path's doorbells (fast_path set). */
typedef struct fsdp_channel_welcome {
  fsdp_status_t status;
  Fsdp__V1__ChannelMemory memory[FSDP_CHANNEL_MAX_FDS];
  Fsdp__V1__ChannelMemory *memories[FSDP_CHANNEL_MAX_FDS]; /* &memory[i] */
  char names[FSDP_CHANNEL_MAX_FDS][96];
  int fds[FSDP_CHANNEL_MAX_FDS];
  size_t n;
  size_t n_fds;
  Fsdp__V1__FastPath fast_path_storage;
  Fsdp__V1__FastPath *fast_path; /* &fast_path_storage, or NULL */
  /* A job on a GPU: the session's events' handles (n_cuda_events of them). */
  unsigned char cuda_event_handles[FSDP_SESSION_CUDA_EVENTS][FSDP_CUDA_IPC_EVENT_BYTES];
  ProtobufCBinaryData cuda_events[FSDP_SESSION_CUDA_EVENTS];
  size_t n_cuda_events;
} fsdp_channel_welcome_t;

typedef struct fsdp_channel_callbacks {
  /* A valid hello arrived on conn from the process with credentials cred: fill *ret. On
   * success the connection is bound (fsdp_channel_conn_set_owner), else it is closed after
   * the answer. */
  void (*welcome)(void *data, fsdp_channel_conn_t *conn, const Fsdp__V1__ChannelHello *hello,
                  const fsdp_credentials_t *cred, fsdp_channel_welcome_t *ret);
  /* A bound connection ended from the trainer's side; `why` says how. The connection is
   * already closing: the owner (fsdp_channel_conn_set_owner) drops its pointer to it. */
  void (*closed)(void *data, void *owner, const char *why);
  void *data;
} fsdp_channel_callbacks_t;

typedef struct fsdp_channel {
  uv_loop_t *loop;
  /* Accepts on the listener's socket; its limit is set with the config
   * (rpc.max_connections_per_uid), before the loop runs. */
  fsdp_acceptor_t acceptor;
  unsigned pending; /* connections in the hello state */
  fsdp_channel_callbacks_t callbacks;
  fsdp_list_t conns; /* fsdp_channel_conn_t, newest first */
} fsdp_channel_t;

int fsdp_channel_start(fsdp_channel_t *channel, uv_loop_t *loop, int listen_fd,
                       const fsdp_channel_callbacks_t *callbacks);
/* Stops accepting and closes every connection (no callbacks). */
void fsdp_channel_stop(fsdp_channel_t *channel);

/* Closes connections that sent no hello in time; from the housekeeping timer. */
void fsdp_channel_expire(fsdp_channel_t *channel, uint64_t now_ms);

/* Binds a connection to the daemon's object for it (a session), handed back by `closed`. */
void fsdp_channel_conn_set_owner(fsdp_channel_conn_t *conn, void *owner);
/* Ends a connection from the daemon's side; no `closed` callback. */
void fsdp_channel_conn_close(fsdp_channel_conn_t *conn);

#endif
