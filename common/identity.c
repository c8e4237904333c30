/* A thread's file-system identity (common/identity.h). */
#include "common/identity.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

int fsdp_identity_of_peer(int fd, const fsdp_credentials_t *cred, fsdp_identity_t *ret) {
  gid_t small[FSDP_IDENTITY_GROUPS_MAX], *groups = small;
  socklen_t len = sizeof small;
  int r = 0;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0) {
    if (errno != ERANGE || !(groups = malloc(len)))
      return errno == ERANGE ? -ENOMEM : -errno;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0)
      r = -errno;
  }
  if (r == 0) {
    *ret = (fsdp_identity_t){.uid = cred->uid, .gid = cred->gid};
    for (size_t i = 0; i < len / sizeof *groups && ret->n_groups < FSDP_IDENTITY_GROUPS_MAX;
         i++)
      ret->groups[ret->n_groups++] = groups[i];
    ret->partial = len / sizeof *groups > FSDP_IDENTITY_GROUPS_MAX; /* fewer rights, not more */
  }
  if (groups != small)
    free(groups);
  return r;
}

void fsdp_identity_self(fsdp_identity_t *ret) {
  *ret = (fsdp_identity_t){.uid = (uid_t)setfsuid((uid_t)-1), .gid = (gid_t)setfsgid((gid_t)-1)};
  /* The raw call: this thread's groups, which glibc's getgroups reads too. */
  int n = (int)syscall(SYS_getgroups, FSDP_IDENTITY_GROUPS_MAX, ret->groups);
  ret->n_groups = n > 0 ? (unsigned)n : 0;
  ret->partial = n < 0 && errno == EINVAL; /* more than FSDP_IDENTITY_GROUPS_MAX */
}

bool fsdp_identity_equal(const fsdp_identity_t *a, const fsdp_identity_t *b) {
  return a->uid == b->uid && a->gid == b->gid && a->n_groups == b->n_groups &&
         memcmp(a->groups, b->groups, a->n_groups * sizeof *a->groups) == 0;
}

/* Sets this thread's identity to id, groups first (they need the privilege the uid may give
 * up). setfsuid and setfsgid say nothing of a refusal: the value read back does. */
static int take(const fsdp_identity_t *id) {
  /* glibc's setgroups would change every thread of the daemon: the system call alone
   * changes this one. */
  if (syscall(SYS_setgroups, (size_t)id->n_groups, id->groups) < 0)
    return -errno;
  setfsgid(id->gid);
  setfsuid(id->uid);
  if ((uid_t)setfsuid((uid_t)-1) != id->uid || (gid_t)setfsgid((gid_t)-1) != id->gid)
    return -EPERM;
  return 0;
}

int fsdp_identity_enter(const fsdp_identity_t *id, fsdp_identity_t *ret_saved) {
  fsdp_identity_t saved;
  fsdp_identity_self(&saved);
  if (saved.partial)
    return -E2BIG;
  if (fsdp_identity_equal(id, &saved)) {
    *ret_saved = saved;
    return 0;
  }
  int r = take(id);
  if (r < 0) {
    take(&saved);
    /* A daemon that may not change its identity still acts for a caller of its own user:
     * with its own rights, which are that user's. */
    if (id->uid != saved.uid || id->gid != saved.gid)
      return r;
  }
  *ret_saved = saved;
  return 0;
}

void fsdp_identity_leave(const fsdp_identity_t *saved) {
  /* The uid first: back to root, the thread may set its groups again. */
  setfsuid(saved->uid);
  setfsgid(saved->gid);
  syscall(SYS_setgroups, (size_t)saved->n_groups, saved->groups);
}
