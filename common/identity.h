/* Whose rights a thread's file operations use. The daemon runs as root or as its own user;
 * a path a caller names must be used with the caller's rights, not the daemon's. A thread
 * doing that work takes the caller's file-system identity for the while (its uid, gid and
 * supplementary groups, as the kernel recorded them when the caller connected): the kernel
 * then checks every lookup, open, creation and removal of that thread as it would the
 * caller's own, ACLs and sticky directories included, and what it makes is the caller's.
 * Only that thread changes (setfsuid, setfsgid and the raw setgroups are per thread on
 * Linux); the daemon's other threads keep its own rights.
 *
 * Plain data; any thread, each changing only itself. */
#ifndef FSDP_COMMON_IDENTITY_H
#define FSDP_COMMON_IDENTITY_H

#include <stdbool.h>
#include <sys/types.h>

#include "common/credentials.h"

/* The supplementary groups an identity carries: a caller in more has the rights of these. */
#define FSDP_IDENTITY_GROUPS_MAX 64

typedef struct fsdp_identity {
  uid_t uid;
  gid_t gid;
  unsigned n_groups;
  gid_t groups[FSDP_IDENTITY_GROUPS_MAX];
  bool partial; /* it has more groups than these */
} fsdp_identity_t;

/* The identity of the process on connected unix socket fd, with credentials cred: its uid
 * and gid, and its supplementary groups when it connected (SO_PEERGROUPS). Returns 0 or
 * -errno. */
int fsdp_identity_of_peer(int fd, const fsdp_credentials_t *cred, fsdp_identity_t *ret);

/* The daemon's own file-system identity (this thread's, as it is now). */
void fsdp_identity_self(fsdp_identity_t *ret);

/* Whether a and b are the same uid, gid and groups. */
bool fsdp_identity_equal(const fsdp_identity_t *a, const fsdp_identity_t *b);

/* This thread takes id's file-system identity; *ret_saved is what fsdp_identity_leave
 * gives back. Returns 0, or -EPERM where the daemon may not take it (it is not root) and
 * id's uid and gid are not its own, or -E2BIG where the thread's own groups are more than
 * an identity holds (it could not be given them back): the thread is then as it was. */
int fsdp_identity_enter(const fsdp_identity_t *id, fsdp_identity_t *ret_saved);

/* This thread goes back to the identity saved by fsdp_identity_enter. */
void fsdp_identity_leave(const fsdp_identity_t *saved);

#endif
