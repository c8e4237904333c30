/* SCM_RIGHTS messaging with deadlines. Every receive path that fails closes the
 * descriptors that already arrived: a descriptor the caller never sees is a leak the caller
 * cannot fix. The control buffer always has room for FSDP_FD_MAX descriptors whatever
 * max_fds is, so that "too many" is told apart from "truncated by the kernel" only by the
 * flag, and both end the same way: everything that arrived is closed. */
#include "common/fdpass.h"

#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"

/* Waits until sock is ready for events or the deadline passes: 0 ready (or hung up: the
 * next call reports how), -ETIMEDOUT, or -errno. */
static int wait_ready(int sock, short events, int64_t deadline) {
  for (;;) {
    int left = fsdp_clock_left_ms(deadline);
    if (left == 0)
      return -ETIMEDOUT;
    struct pollfd pfd = {.fd = sock, .events = events};
    int r = poll(&pfd, 1, left);
    if (r > 0) {
      if (pfd.revents & POLLNVAL)
        return -EBADF;
      return 0;
    }
    if (r == 0)
      continue; /* the loop re-checks the deadline */
    if (errno != EINTR)
      return -errno;
  }
}

int fsdp_fd_send(int sock, const int *fds, size_t n_fds, const void *payload, size_t len,
                 int timeout_ms) {
  if (sock < 0 || n_fds > FSDP_FD_MAX || (n_fds > 0 && !fds) || !payload || len == 0 ||
      timeout_ms < 0)
    return -EINVAL;
  for (size_t i = 0; i < n_fds; i++)
    if (fds[i] < 0)
      return -EINVAL;

  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * FSDP_FD_MAX)];
  } control;
  memset(&control, 0, sizeof control);

  int64_t deadline = fsdp_clock_deadline_ms(timeout_ms);
  const char *p = payload;
  size_t sent = 0;
  bool fds_sent = n_fds == 0;
  while (sent < len) {
    struct iovec iov = {.iov_base = (void *)(p + sent), .iov_len = len - sent};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (!fds_sent) {
      /* The descriptors ride on the first byte; a partial send still delivered them. */
      msg.msg_control = control.buf;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * n_fds);
      struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int) * n_fds);
      memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * n_fds);
    }
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += (size_t)n;
      fds_sent = true;
      continue;
    }
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int r = wait_ready(sock, POLLOUT, deadline);
      if (r < 0)
        return r;
      continue;
    }
    if (n < 0 && (errno == EPIPE || errno == ECONNRESET))
      return -ECONNRESET;
    return n < 0 ? -errno : -EIO;
  }
  return 0;
}

static void close_all(int *fds, size_t n) {
  for (size_t i = 0; i < n; i++)
    close(fds[i]);
}

/* Moves the descriptors of every SCM_RIGHTS message in msg into got[*n_got], closing those
 * beyond FSDP_FD_MAX (the buffer only has room for that many, so this is belt and braces);
 * returns true when any had to be dropped. Other control messages (SCM_CREDENTIALS when
 * the caller set SO_PASSCRED) are ignored. */
static bool collect_fds(struct msghdr *msg, int *got, size_t *n_got) {
  bool dropped = false;
  for (struct cmsghdr *cmsg = CMSG_FIRSTHDR(msg); cmsg; cmsg = CMSG_NXTHDR(msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS ||
        cmsg->cmsg_len < CMSG_LEN(0))
      continue;
    size_t n = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char *data = CMSG_DATA(cmsg);
    for (size_t i = 0; i < n; i++) {
      int fd;
      memcpy(&fd, data + i * sizeof(int), sizeof fd);
      if (*n_got < FSDP_FD_MAX) {
        got[(*n_got)++] = fd;
      } else {
        close(fd);
        dropped = true;
      }
    }
  }
  return dropped;
}

int fsdp_fd_recv(int sock, void *payload, size_t len, size_t max_fds, int timeout_ms,
                 int *ret_fds, size_t *ret_n_fds) {
  if (sock < 0 || max_fds > FSDP_FD_MAX || (max_fds > 0 && !ret_fds) || !payload ||
      len == 0 || timeout_ms < 0)
    return -EINVAL;

  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * FSDP_FD_MAX)];
  } control;

  int got[FSDP_FD_MAX];
  size_t n_got = 0;
  bool truncated = false;
  int64_t deadline = fsdp_clock_deadline_ms(timeout_ms);
  char *p = payload;
  size_t have = 0;
  int r = 0;
  while (have < len) {
    /* Asking for exactly the rest of this message keeps the next message's descriptors in
     * the socket: the kernel never merges a segment that carries descriptors into a read
     * beyond the bytes asked for. */
    struct iovec iov = {.iov_base = p + have, .iov_len = len - have};
    struct msghdr msg = {.msg_iov = &iov,
                         .msg_iovlen = 1,
                         .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n > 0) {
      /* Descriptors come with the bytes they were sent with, so collect before anything
       * else: they are ours to close from here on. */
      if (collect_fds(&msg, got, &n_got))
        truncated = true;
      if (msg.msg_flags & MSG_CTRUNC)
        truncated = true;
      have += (size_t)n;
      continue;
    }
    if (n == 0) {
      r = -ECONNRESET;
      goto fail;
    }
    if (errno == EINTR)
      continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      r = wait_ready(sock, POLLIN, deadline);
      if (r < 0)
        goto fail;
      continue;
    }
    r = -errno;
    goto fail;
  }
  if (truncated || n_got > max_fds) {
    r = -EMSGSIZE;
    goto fail;
  }
  if (n_got > 0)
    memcpy(ret_fds, got, n_got * sizeof(int));
  if (ret_n_fds)
    *ret_n_fds = n_got;
  return 0;

fail:
  close_all(got, n_got);
  return r;
}

int fsdp_peer_credentials(int sock, pid_t *ret_pid, uid_t *ret_uid, gid_t *ret_gid) {
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0)
    return -errno;
  if (len != sizeof cred)
    return -EPROTO;
  if (ret_pid)
    *ret_pid = cred.pid;
  if (ret_uid)
    *ret_uid = cred.uid;
  if (ret_gid)
    *ret_gid = cred.gid;
  return 0;
}
