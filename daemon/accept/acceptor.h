/* The accept loop of every socket the daemon listens on itself, and its connection limit:
 * the gRPC unix socket and TCP ports (daemon/rpc/listener.h) and the memory channel's
 * socket (daemon/session/channel.h) all accept through it, so they refuse, retry and count
 * the same way.
 *
 * On a unix socket every connection's credentials are read (SO_PEERCRED) before its owner
 * sees a byte; a process that may not use the daemon (common/credentials.h) is logged and
 * closed, or handed to the owner's adopt_refused to hear why. Each uid may hold `limit`
 * connections on a unix socket, and a TCP socket `limit` in all. At the limit the oldest
 * idle connection of that uid (of the socket) is closed to make room, the owner saying
 * which are idle, so one user's idle connections cost only that user; when none is idle
 * the new connection is refused (logged, and told why through turn_away if the owner has a
 * way to). Out of descriptors, accepting pauses ACCEPT_RETRY_MS rather than spin on the
 * pending connection, and says so once.
 *
 * A connection counts until its owner releases it (fsdp_acceptor_release) or, for one the
 * owner handed to gRPC (which closes descriptors without telling), until its descriptor is
 * seen closed or reused (the same socket inode) when a count of its uid matters.
 *
 * Apart from the listener and the memory channel because both use it, and neither may use
 * the other. Loop thread only; the socket's descriptor is borrowed. */
#ifndef FSDP_ACCEPTOR_H
#define FSDP_ACCEPTOR_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include <uv.h>

#include "common/credentials.h"
#include "common/list.h"

typedef struct fsdp_acceptor fsdp_acceptor_t;

/* One accepted connection, while the acceptor counts it against a limit. */
typedef struct fsdp_accepted {
  fsdp_acceptor_t *acceptor;
  int fd;
  ino_t ino; /* the socket's inode: the same number with another inode is another file */
  fsdp_credentials_t cred; /* unix sockets only */
  uint64_t since_ms;
  /* The owner's object for the connection, set in adopt: an owner that sets it releases
   * the connection when it ends. NULL while gRPC holds the descriptor. */
  void *owner;
  bool closing; /* closed to make room, not yet released: no longer counted */
  fsdp_list_t link; /* in the acceptor's conns */
} fsdp_accepted_t;

/* What the acceptor asks of the socket's owner; data is passed back. */
typedef struct fsdp_acceptor_ops {
  /* Takes the connection (its descriptor, whatever the result). Returns < 0 if it could
   * not keep it; the acceptor then forgets it. */
  int (*adopt)(void *data, fsdp_accepted_t *conn);
  /* Unix sockets: takes a connection whose credentials are not let in, counted like any,
   * so that its calls hear why; NULL closes such connections at once. */
  int (*adopt_refused)(void *data, fsdp_accepted_t *conn);
  /* Whether conn may be closed to make room: FSDP_ACCEPTED_BUSY if not, else a rank (lower
   * ranks go first, the oldest first within a rank). */
  int (*idleness)(void *data, const fsdp_accepted_t *conn);
  /* Closes conn to make room (its uid or the socket holds `held` of `limit`) and logs it;
   * the owner releases it now or when it has ended. */
  void (*evict)(void *data, fsdp_accepted_t *conn, unsigned held, unsigned limit);
  /* Optional: tells a connection refused at the limit why (the logged message) before the
   * acceptor closes it. */
  void (*turn_away)(void *data, int fd, const fsdp_credentials_t *cred, const char *why);
  void *data;
} fsdp_acceptor_ops_t;

#define FSDP_ACCEPTED_BUSY (-1)

struct fsdp_acceptor {
  uv_loop_t *loop;
  uv_poll_t poll;
  uv_timer_t retry; /* restarts accepting after running out of descriptors */
  bool polling;
  bool starved; /* out of descriptors: said once, until an accept works again */
  bool unix_socket; /* credentials checked, and the limit is per uid */
  int fd;
  const char *name; /* for messages: the path or the address */
  unsigned limit; /* connections per uid (unix) or in all (TCP); the loop thread may change it */
  const char *limit_name; /* how refusals name the limit: its config key */
  fsdp_acceptor_ops_t ops;
  fsdp_list_t conns; /* fsdp_accepted_t, newest first */
};

/* Makes an acceptor for the listening socket fd (borrowed) that accepts nothing yet; name
 * and limit_name are borrowed too. */
void fsdp_acceptor_init(fsdp_acceptor_t *acceptor, int fd, bool unix_socket, const char *name,
                        unsigned limit, const char *limit_name, const fsdp_acceptor_ops_t *ops);
/* Accepts connections on the loop. */
int fsdp_acceptor_start(fsdp_acceptor_t *acceptor, uv_loop_t *loop);
/* Stops accepting and forgets every connection (the owner ends those it holds first);
 * closes the handles, whose close callbacks need no memory of the acceptor's. */
void fsdp_acceptor_stop(fsdp_acceptor_t *acceptor);

/* The connection ended: it no longer counts. */
void fsdp_acceptor_release(fsdp_accepted_t *conn);

#endif
