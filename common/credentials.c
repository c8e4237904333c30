/* Credentials of a local connection, and who may use the daemon. */
#include "common/credentials.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

/* Whether the process on a connected socket had gid among its supplementary groups when it
 * connected (SO_PEERGROUPS: the kernel's record, immune to pid reuse). */
static bool in_supplementary_group(int fd, gid_t gid) {
  gid_t small[64], *groups = small;
  socklen_t len = sizeof small;
  bool found = false;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0) {
    if (errno != ERANGE || !(groups = malloc(len)))
      return false;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0)
      goto out;
  }
  for (size_t i = 0; i < len / sizeof *groups; i++)
    if (groups[i] == gid)
      found = true;
out:
  if (groups != small)
    free(groups);
  return found;
}

bool fsdp_credentials_in_group(int fd, const fsdp_credentials_t *cred, gid_t gid) {
  return cred->gid == gid || in_supplementary_group(fd, gid);
}

bool fsdp_credentials_allowed(int fd, const fsdp_credentials_t *cred) {
  return cred->uid == 0 || cred->uid == geteuid() ||
         fsdp_credentials_in_group(fd, cred, getegid());
}

void fsdp_credentials_refusal(const fsdp_credentials_t *cred, const char *where, char *buf,
                              size_t size) {
  snprintf(buf, size,
           "uid %u (pid %ld, gid %u) may not use fsdpd: only root, uid %u and members of group "
           "%u (primary or supplementary) may connect to %s",
           (unsigned)cred->uid, (long)cred->pid, (unsigned)cred->gid, (unsigned)geteuid(),
           (unsigned)getegid(), where);
}
