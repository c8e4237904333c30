/* The local listener: the run directory, its lock file, the unix socket trainers and
 * operators connect to, and the TCP ports: health, and peer when it is not TLS.
 *
 * The daemon binds and accepts the socket itself instead of letting gRPC do it, for three
 * reasons: gRPC would unlink and re-bind a path that another live daemon is serving; the
 * socket's mode must be 0660 from the start; and every connection's credentials
 * (SO_PEERCRED) are checked before gRPC sees a byte. Accepted connections are handed to an
 * RPC endpoint. The TCP ports are accepted here too, and their connections reach gRPC
 * through a relay (daemon/rpc/relay.h) that cuts a client resetting streams faster than a probe
 * or a peer ever would (HTTP/2 rapid reset) or holding more streams than the port allows;
 * their calls name the client by its TCP address. A peer port with mutual TLS stays gRPC's
 * own: its handshake wants a client certificate before any HTTP/2 frame.
 *
 * Connection limits (daemon/accept/acceptor.h, which accepts on every socket): each uid may
 * hold rpc.max_connections_per_uid connections on the unix socket, and each TCP port its
 * limit in all; an idle connection is one with no call the endpoint serves.
 *
 * Safety rules for the run directory: it must be a real directory (not a symlink) owned by
 * the daemon's user, mode 0750; the lock file (flock) proves which daemon owns it, and only
 * the holder of the lock removes a stale socket.
 *
 * Loop thread only. */
#ifndef FSDP_LISTENER_H
#define FSDP_LISTENER_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include <uv.h>

#include "common/credentials.h"
#include "common/status.h"
#include "daemon/accept/acceptor.h"
#include "daemon/rpc/relay.h"
#include "daemon/rpc/rpc_server.h"
#include "proto/limits.h" /* the run directory's names */

/* What the listener keeps of an accepted unix connection: its credentials (SO_PEERCRED at
 * accept) and whether it was let in. */
typedef struct fsdp_listener_caller {
  fsdp_credentials_t cred;
  bool refused; /* not let in: its calls only hear why */
} fsdp_listener_caller_t;

typedef struct fsdp_listener fsdp_listener_t;

/* A listening socket and what its connections go to. */
typedef struct fsdp_listener_socket {
  fsdp_listener_t *listener;
  fsdp_acceptor_t acceptor; /* its accept loop and connection limit */
  bool tcp;
  fsdp_rpc_endpoint_t *endpoint;
  fsdp_rpc_endpoint_t *refused; /* unix socket: where refused uids hear why */
  /* TCP only. */
  char address[320];       /* as configured, with the bound port */
  char port[16];           /* "health port" */
  fsdp_relay_limits_t relay;
} fsdp_listener_socket_t;

/* The TCP ports the listener may accept. */
typedef enum fsdp_listener_port {
  FSDP_LISTENER_HEALTH,
  FSDP_LISTENER_PEER,
  FSDP_LISTENER_PORTS
} fsdp_listener_port_t;

/* What a TCP port serves, and its limits. */
typedef struct fsdp_listener_tcp_options {
  const char *what; /* "health", "peer": names the port in messages */
  fsdp_rpc_endpoint_t *endpoint; /* borrowed */
  unsigned max_connections;
  const char *limit_name;
  unsigned max_streams, max_resets, max_resets_untrusted; /* each connection's
                                                           * (fsdp_relay_limits_t) */
} fsdp_listener_tcp_options_t;

struct fsdp_listener {
  uv_loop_t *loop;
  fsdp_listener_socket_t local;
  fsdp_listener_socket_t tcp[FSDP_LISTENER_PORTS]; /* bound when their `tcp` is set */
  int lock_fd;
  int socket_fd;
  char run_dir[4096];
  char socket_path[108]; /* sun_path's size */
  int channel_fd;         /* the memory channel's listening socket (daemon/session/channel.h) */
  char channel_path[108];
  /* Credentials by file descriptor of the accepted connection. A closed connection's entry
   * stays until its number is reused by the next accept: no call can come from it, because
   * gRPC keeps a connection's descriptor open while any of its calls is held. */
  fsdp_listener_caller_t *callers;
  size_t n_callers;
};

/* Prepares the run dir, takes its lock and binds the sockets (mode 0660): the gRPC one, and
 * the memory channel's (SOCK_SEQPACKET), which daemon/session/channel.h accepts on. Does not accept
 * yet. On failure st says which path and why; nothing is left behind. */
int fsdp_listener_open(fsdp_listener_t *listener, const char *run_dir, fsdp_status_t *st);

/* Binds TCP port `port` at "host:port" (port 0 picks one), whose connections will be relayed
 * to options->endpoint; its address with the bound port goes to listener->tcp[port].address.
 * After fsdp_listener_open(). */
int fsdp_listener_listen_tcp(fsdp_listener_t *listener, fsdp_listener_port_t port,
                             const char *address, const fsdp_listener_tcp_options_t *options,
                             fsdp_status_t *st);

/* Accepts connections on the loop and hands those of the unix socket to `local`, those of
 * uids the socket does not let in to `refused`, whose calls all hear why (its refuse option
 * is fsdp_listener_refusal with the listener), and relays those of the TCP ports bound. All
 * borrowed. */
int fsdp_listener_start(fsdp_listener_t *listener, uv_loop_t *loop, fsdp_rpc_endpoint_t *local,
                        fsdp_rpc_endpoint_t *refused);

/* Why the connection on fd was refused, for its callers (an endpoint's refuse option, with
 * the listener as data). */
void fsdp_listener_refusal(void *listener, int fd, char *buf, size_t size);

/* Stops accepting, removes the socket, releases the lock and closes everything; synchronous
 * apart from the poll handle's own close, which this starts. */
void fsdp_listener_close(fsdp_listener_t *listener);

/* The credentials of the connection on file descriptor fd; -ENOENT if none was let in
 * there. */
int fsdp_listener_credentials(const fsdp_listener_t *listener, int fd,
                              fsdp_credentials_t *ret_cred);

#endif
