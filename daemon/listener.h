/* The local listener: the run directory, its lock file and the unix socket trainers and
 * operators connect to.
 *
 * The daemon binds and accepts the socket itself instead of letting gRPC do it, for three
 * reasons: gRPC would unlink and re-bind a path that another live daemon is serving; the
 * socket's mode must be 0660 from the start; and every connection's peer credentials
 * (SO_PEERCRED) are checked before gRPC sees a byte. Accepted connections are handed to an
 * RPC endpoint.
 *
 * Safety rules for the run directory: it must be a real directory (not a symlink) owned by
 * the daemon's user, mode 0750; the lock file (flock) proves which daemon owns it, and only
 * the holder of the lock removes a stale socket.
 *
 * Loop thread only. */
#ifndef FSDP_LISTENER_H
#define FSDP_LISTENER_H

#include <stdbool.h>
#include <sys/types.h>

#include <uv.h>

#include "rpc_server.h"
#include "status.h"

#define FSDP_SOCKET_NAME "fsdpd.sock"
#define FSDP_CHANNEL_SOCKET_NAME "fsdpd.mem.sock"
#define FSDP_LOCK_NAME "fsdpd.lock"

/* Credentials of a connection, from SO_PEERCRED at accept. */
typedef struct fsdp_peer {
  pid_t pid;
  uid_t uid;
  gid_t gid;
} fsdp_peer_t;

typedef struct fsdp_listener {
  uv_poll_t poll;
  uv_timer_t retry; /* restarts accepting after running out of descriptors */
  bool polling;
  bool starved; /* out of descriptors: said once, until an accept works again */
  int lock_fd;
  int socket_fd;
  char run_dir[4096];
  char socket_path[108]; /* sun_path's size */
  int channel_fd;         /* the memory channel's listening socket (daemon/channel.h) */
  char channel_path[108];
  fsdp_rpc_endpoint_t *endpoint;
  unsigned long accepted, refused;
  /* Credentials by file descriptor of the accepted connection. A closed connection's entry
   * stays until its number is reused by the next accept: no call can come from it, because
   * gRPC keeps a connection's descriptor open while any of its calls is held. */
  fsdp_peer_t *peers;
  size_t n_peers;
} fsdp_listener_t;

/* Prepares the run dir, takes its lock and binds the sockets (mode 0660): the gRPC one, and
 * the memory channel's (SOCK_SEQPACKET), which daemon/channel.h accepts on. Does not accept
 * yet. On failure st says which path and why; nothing is left behind. */
int fsdp_listener_open(fsdp_listener_t *listener, const char *run_dir, fsdp_status_t *st);

/* Accepts connections on the loop and hands them to endpoint (borrowed). */
int fsdp_listener_start(fsdp_listener_t *listener, uv_loop_t *loop, fsdp_rpc_endpoint_t *endpoint);

/* Stops accepting, removes the socket, releases the lock and closes everything; synchronous
 * apart from the poll handle's own close, which this starts. */
void fsdp_listener_close(fsdp_listener_t *listener);

/* The credentials of the connection on file descriptor fd; -ENOENT if none was accepted
 * there. */
int fsdp_listener_peer(const fsdp_listener_t *listener, int fd, fsdp_peer_t *ret_peer);

/* Whether the peer on connected socket fd, with these credentials, was a member of group gid
 * when it connected: its primary group, or a supplementary one (SO_PEERGROUPS). */
bool fsdp_peer_in_group(int fd, const fsdp_peer_t *peer, gid_t gid);

/* Whether the peer on connected socket fd, with these credentials, may use the daemon: root,
 * the daemon's user, or a member of the daemon's group (primary, or supplementary as
 * SO_PEERGROUPS recorded it at connect time). */
bool fsdp_peer_allowed(int fd, const fsdp_peer_t *peer);

#endif
