/* Who is on the other end of a local connection: the credentials the kernel recorded when
 * the process connected to a unix socket (SO_PEERCRED, read by fsdp_peer_credentials() of
 * common/fdpass.h), and the daemon's rule for who may use it.
 *
 * Its own header so that the listener that records them, and the sessions and the memory
 * channel that check them (the store through the sessions), take them without reaching into
 * the gRPC adapter. ("Peer" in this project is another host's daemon; a connection's process
 * is a caller.) Stateless; any thread. */
#ifndef FSDP_CREDENTIALS_H
#define FSDP_CREDENTIALS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

typedef struct fsdp_credentials {
  pid_t pid;
  uid_t uid;
  gid_t gid;
} fsdp_credentials_t;

/* Whether the process on connected socket fd, with these credentials, was a member of group
 * gid when it connected: its primary group, or a supplementary one (SO_PEERGROUPS). */
bool fsdp_credentials_in_group(int fd, const fsdp_credentials_t *cred, gid_t gid);

/* Whether the process on connected socket fd, with these credentials, may use the daemon:
 * root, the daemon's user, or a member of the daemon's group (primary, or supplementary as
 * SO_PEERGROUPS recorded it at connect time). */
bool fsdp_credentials_allowed(int fd, const fsdp_credentials_t *cred);

/* What a process fsdp_credentials_allowed refused is told, into buf: its ids, and who may
 * connect to `where` (a socket, as the message names it). */
void fsdp_credentials_refusal(const fsdp_credentials_t *cred, const char *where, char *buf,
                              size_t size);

#endif
