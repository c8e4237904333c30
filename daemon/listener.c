/* Run directory, lock file, unix socket and credential-checked accept. */
#include "listener.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "fdpass.h"
#include "log.h"

/* Creates or checks the run dir; resolves it to an absolute path in listener->run_dir. */
static int prepare_run_dir(fsdp_listener_t *listener, const char *run_dir, fsdp_status_t *st) {
  struct stat sb;
  if (lstat(run_dir, &sb) < 0) {
    if (errno != ENOENT)
      return fsdp_status_set(st, -errno, "run dir '%s': %s", run_dir, strerror(errno));
    if (mkdir(run_dir, 0750) < 0)
      return fsdp_status_set(st, -errno, "cannot create run dir '%s': %s", run_dir,
                             strerror(errno));
    if (lstat(run_dir, &sb) < 0)
      return fsdp_status_set(st, -errno, "run dir '%s': %s", run_dir, strerror(errno));
  }
  if (S_ISLNK(sb.st_mode))
    return fsdp_status_set(st, -ELOOP, "run dir '%s' is a symlink; refusing to follow it",
                           run_dir);
  if (!S_ISDIR(sb.st_mode))
    return fsdp_status_set(st, -ENOTDIR, "run dir '%s' is not a directory", run_dir);
  if (sb.st_uid != geteuid())
    return fsdp_status_set(st, -EPERM, "run dir '%s' is owned by uid %u, not by the daemon's uid %u",
                           run_dir, (unsigned)sb.st_uid, (unsigned)geteuid());
  if ((sb.st_mode & 07777) != 0750) {
    if (chmod(run_dir, 0750) < 0)
      return fsdp_status_set(st, -errno, "cannot set mode 0750 on run dir '%s': %s", run_dir,
                             strerror(errno));
    log_warning("run dir '%s' had mode %04o; set it to 0750", run_dir,
                (unsigned)(sb.st_mode & 07777));
  }
  if (!realpath(run_dir, listener->run_dir))
    return fsdp_status_set(st, -errno, "run dir '%s': %s", run_dir, strerror(errno));
  return 0;
}

static int take_lock(fsdp_listener_t *listener, fsdp_status_t *st) {
  char path[sizeof listener->run_dir + sizeof FSDP_LOCK_NAME + 1];
  snprintf(path, sizeof path, "%s/%s", listener->run_dir, FSDP_LOCK_NAME);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0640);
  if (fd < 0)
    return fsdp_status_set(st, -errno, "lock file '%s': %s", path, strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
    int err = errno;
    char owner[32] = "";
    ssize_t n = pread(fd, owner, sizeof owner - 1, 0);
    owner[n > 0 ? n : 0] = '\0';
    owner[strcspn(owner, "\n")] = '\0';
    close(fd);
    if (err == EWOULDBLOCK)
      return fsdp_status_set(st, -EBUSY, "run dir '%s' is in use by another fsdpd (pid %s)",
                             listener->run_dir, owner[0] ? owner : "unknown");
    return fsdp_status_set(st, -err, "cannot lock '%s': %s", path, strerror(err));
  }
  char pid[32];
  int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
  if (ftruncate(fd, 0) < 0 || pwrite(fd, pid, (size_t)len, 0) != len)
    log_warning("cannot record the pid in '%s': %s", path, strerror(errno));
  listener->lock_fd = fd;
  return 0;
}

/* Removes a socket left by a daemon that died; we hold the lock, so it cannot be live. */
static int remove_stale_socket(const char *path, fsdp_status_t *st) {
  struct stat sb;
  if (lstat(path, &sb) < 0)
    return errno == ENOENT ? 0 : fsdp_status_set(st, -errno, "'%s': %s", path, strerror(errno));
  if (!S_ISSOCK(sb.st_mode))
    return fsdp_status_set(st, -EEXIST, "'%s' exists and is not a socket; refusing to remove it",
                           path);
  if (sb.st_uid != geteuid())
    return fsdp_status_set(st, -EPERM, "stale socket '%s' is owned by uid %u; refusing to remove it",
                           path, (unsigned)sb.st_uid);
  if (unlink(path) < 0)
    return fsdp_status_set(st, -errno, "cannot remove stale socket '%s': %s", path,
                           strerror(errno));
  log_info("removed stale socket %s", path);
  return 0;
}

/* Binds run_dir/name as a listening unix socket of `type`, mode 0660; its path goes to
 * ret_path (sun_path's size). */
static int bind_socket(const fsdp_listener_t *listener, const char *name, int type,
                       char *ret_path, int *ret_fd, fsdp_status_t *st) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int n = snprintf(addr.sun_path, sizeof addr.sun_path, "%s/%s", listener->run_dir, name);
  if (n < 0 || (size_t)n >= sizeof addr.sun_path)
    return fsdp_status_set(st, -ENAMETOOLONG,
                           "socket path '%s/%s' is longer than the %zu bytes a unix socket allows",
                           listener->run_dir, name, sizeof addr.sun_path - 1);
  memcpy(ret_path, addr.sun_path, sizeof addr.sun_path);
  int r = remove_stale_socket(addr.sun_path, st);
  if (r < 0)
    return r;
  int fd = socket(AF_UNIX, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return fsdp_status_set(st, -errno, "socket: %s", strerror(errno));
  /* The umask makes the file 0660 at birth; chmod states it regardless of the umask. */
  mode_t old_mask = umask(0117);
  r = bind(fd, (struct sockaddr *)&addr, sizeof addr);
  umask(old_mask);
  if (r < 0 || chmod(addr.sun_path, 0660) < 0 || listen(fd, 128) < 0) {
    int err = errno;
    close(fd);
    return fsdp_status_set(st, -err, "cannot listen on '%s': %s", addr.sun_path, strerror(err));
  }
  *ret_fd = fd;
  return 0;
}

int fsdp_listener_open(fsdp_listener_t *listener, const char *run_dir, fsdp_status_t *st) {
  memset(listener, 0, sizeof *listener);
  listener->lock_fd = listener->socket_fd = listener->channel_fd = -1;
  int r = prepare_run_dir(listener, run_dir, st);
  if (r < 0)
    return r;
  r = take_lock(listener, st);
  if (r < 0)
    return r;
  r = bind_socket(listener, FSDP_SOCKET_NAME, SOCK_STREAM, listener->socket_path,
                  &listener->socket_fd, st);
  if (r == 0)
    r = bind_socket(listener, FSDP_CHANNEL_SOCKET_NAME, SOCK_SEQPACKET, listener->channel_path,
                    &listener->channel_fd, st);
  if (r < 0)
    fsdp_listener_close(listener);
  return r;
}

/* Whether the peer of a connected socket had gid among its supplementary groups when it
 * connected (SO_PEERGROUPS: the kernel's record, immune to pid reuse). */
static bool peer_in_supplementary_group(int fd, gid_t gid) {
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

bool fsdp_peer_in_group(int fd, const fsdp_peer_t *peer, gid_t gid) {
  return peer->gid == gid || peer_in_supplementary_group(fd, gid);
}

bool fsdp_peer_allowed(int fd, const fsdp_peer_t *peer) {
  return peer->uid == 0 || peer->uid == geteuid() || fsdp_peer_in_group(fd, peer, getegid());
}

/* Out of descriptors: accepting again at once would spin on the pending connection. */
#define ACCEPT_RETRY_MS 100

static void on_readable(uv_poll_t *poll, int status, int events);

static void on_accept_retry(uv_timer_t *timer) {
  fsdp_listener_t *listener = timer->data;
  uv_poll_start(&listener->poll, UV_READABLE, on_readable);
}

static void on_readable(uv_poll_t *poll, int status, int events) {
  (void)events;
  fsdp_listener_t *listener = poll->data;
  if (status < 0) {
    log_error("socket %s: %s", listener->socket_path, uv_strerror(status));
    return;
  }
  for (;;) {
    int fd = accept4(listener->socket_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        if (!listener->starved)
          log_warning("cannot accept on %s: %s; retrying every %d ms", listener->socket_path,
                      strerror(errno), ACCEPT_RETRY_MS);
        listener->starved = true;
        uv_poll_stop(&listener->poll);
        uv_timer_start(&listener->retry, on_accept_retry, ACCEPT_RETRY_MS, 0);
      }
      return; /* EAGAIN: drained */
    }
    if (listener->starved) {
      log_info("accepting on %s again", listener->socket_path);
      listener->starved = false;
    }
    fsdp_peer_t cred = {0};
    if (fsdp_peer_credentials(fd, &cred.pid, &cred.uid, &cred.gid) < 0 ||
        !fsdp_peer_allowed(fd, &cred)) {
      log_warning("refused a connection from pid %ld uid %u gid %u: not the daemon's user or group",
                  (long)cred.pid, (unsigned)cred.uid, (unsigned)cred.gid);
      listener->refused++;
      close(fd);
      continue;
    }
    if ((size_t)fd >= listener->n_peers) {
      size_t n = (size_t)fd * 2 + 16;
      fsdp_peer_t *grown = realloc(listener->peers, n * sizeof *grown);
      if (!grown) {
        log_warning("out of memory recording a connection; closing it");
        close(fd);
        continue;
      }
      memset(grown + listener->n_peers, 0, (n - listener->n_peers) * sizeof *grown);
      listener->peers = grown;
      listener->n_peers = n;
    }
    listener->peers[fd] = cred;
    listener->accepted++;
    fsdp_rpc_endpoint_adopt(listener->endpoint, fd);
  }
}

int fsdp_listener_start(fsdp_listener_t *listener, uv_loop_t *loop, fsdp_rpc_endpoint_t *endpoint) {
  listener->endpoint = endpoint;
  int r = uv_poll_init(loop, &listener->poll, listener->socket_fd);
  if (r < 0)
    return r;
  uv_timer_init(loop, &listener->retry);
  listener->poll.data = listener->retry.data = listener;
  listener->polling = true;
  return uv_poll_start(&listener->poll, UV_READABLE, on_readable);
}

static void stop_polling(fsdp_listener_t *listener) {
  if (listener->polling) {
    uv_poll_stop(&listener->poll);
    uv_close((uv_handle_t *)&listener->poll, NULL);
    uv_close((uv_handle_t *)&listener->retry, NULL);
    listener->polling = false;
  }
}

int fsdp_listener_peer(const fsdp_listener_t *listener, int fd, fsdp_peer_t *ret_peer) {
  if (fd < 0 || (size_t)fd >= listener->n_peers || listener->peers[fd].pid == 0)
    return -ENOENT;
  *ret_peer = listener->peers[fd];
  return 0;
}

void fsdp_listener_close(fsdp_listener_t *listener) {
  stop_polling(listener);
  free(listener->peers);
  listener->peers = NULL;
  listener->n_peers = 0;
  if (listener->socket_fd >= 0) {
    unlink(listener->socket_path);
    close(listener->socket_fd);
    listener->socket_fd = -1;
  }
  if (listener->channel_fd >= 0) {
    unlink(listener->channel_path);
    close(listener->channel_fd);
    listener->channel_fd = -1;
  }
  if (listener->lock_fd >= 0) {
    close(listener->lock_fd); /* releases the flock */
    listener->lock_fd = -1;
  }
}
