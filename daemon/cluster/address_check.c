/* A peer's data-plane address, unpacked by UCX in a process of its own (see
 * address_check.h). */
#include "daemon/cluster/address_check.h"

#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/pidfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "proto/host/formats.h"
#include "transport/ucx.h"

extern char **environ;

/* Exit codes of the checking process. */
#define CHECK_TOOK 0
#define CHECK_CANNOT 1
#define CHECK_REFUSED 3

/* What the daemon reads of the process's output: UCX's message comes first, its backtrace
 * after. */
#define OUTPUT_MAX 4096

struct fsdp_address_check {
  pid_t pid;
  int pidfd, out_fd;
  uv_poll_t poll;
  uv_timer_t timer;
  int open_handles;
  bool timed_out, cancelled, reaped;
  uint64_t timeout_ms;
  int result;
  char why[FSDP_STATUS_MESSAGE_MAX];
  fsdp_address_check_fn cb;
  void *data;
};

/* A memfd holding len bytes, positioned at its start; -errno on failure. */
static int memfd_with(const char *name, const void *bytes, size_t len) {
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0)
    return -errno;
  const char *p = bytes;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      int err = n < 0 ? -errno : -EIO;
      close(fd);
      return err;
    }
    p += n;
    len -= (size_t)n;
  }
  if (lseek(fd, 0, SEEK_SET) < 0) {
    int err = -errno;
    close(fd);
    return err;
  }
  return fd;
}

/* The line of the process's output that says most: UCX's assertion when it aborted, else
 * the last line written (the process's own verdict), without UCX's "[host:pid:...]"
 * prefix and with anything unprintable replaced, as it goes into status messages. */
static void output_line(int fd, bool aborted, char *buf, size_t size) {
  char out[OUTPUT_MAX + 1];
  ssize_t n = pread(fd, out, OUTPUT_MAX, 0);
  buf[0] = '\0';
  if (n <= 0)
    return;
  out[n] = '\0';
  char *pick = NULL, *save;
  for (char *line = strtok_r(out, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    while (*line == ' ' || *line == '\t')
      line++;
    if (!*line)
      continue;
    if (aborted && strstr(line, "Assertion")) {
      pick = line;
      break;
    }
    if (!aborted || !pick)
      pick = line;
  }
  if (!pick)
    return;
  if (pick[0] == '[' && strchr(pick, ']'))
    pick = strchr(pick, ']') + 1;
  while (*pick == ' ')
    pick++;
  snprintf(buf, size, "%s", pick);
  for (char *c = buf; *c; c++)
    if ((unsigned char)*c < 0x20 || (unsigned char)*c >= 0x7f)
      *c = '?';
}

static void on_closed(uv_handle_t *handle) {
  fsdp_address_check_t *c = handle->data;
  if (--c->open_handles > 0)
    return;
  /* Only now: the poll handle watched the pidfd until it was closed, and the number must
   * not be another file's while epoll still has it. */
  close(c->out_fd);
  close(c->pidfd);
  c->cb(c->data, c->result, c->why);
  free(c);
}

/* The process has exited: reaps it and says what it found. */
static void finish(fsdp_address_check_t *c) {
  int status = 0;
  pid_t r;
  do
    r = waitpid(c->pid, &status, WNOHANG);
  while (r < 0 && errno == EINTR);
  if (r == 0)
    return; /* not yet: a spurious wake-up */
  c->reaped = true;
  char line[FSDP_STATUS_MESSAGE_MAX / 2];
  bool aborted = r > 0 && WIFSIGNALED(status);
  output_line(c->out_fd, aborted, line, sizeof line);
  if (c->cancelled) {
    c->result = FSDP_E_CANCELLED;
    snprintf(c->why, sizeof c->why, "the check was cancelled");
  } else if (c->timed_out) {
    c->result = FSDP_E_UNAVAILABLE;
    snprintf(c->why, sizeof c->why,
             "UCX did not finish unpacking it within %llu ms (peer.address_check_timeout)",
             (unsigned long long)c->timeout_ms);
  } else if (r > 0 && WIFEXITED(status) && WEXITSTATUS(status) == CHECK_TOOK) {
    c->result = 0;
    c->why[0] = '\0';
  } else if (r > 0 && WIFEXITED(status) && WEXITSTATUS(status) == CHECK_REFUSED) {
    c->result = FSDP_E_INVALID_ARGUMENT;
    snprintf(c->why, sizeof c->why, "UCX refused it: %s", line);
  } else if (aborted) {
    c->result = FSDP_E_INVALID_ARGUMENT;
    snprintf(c->why, sizeof c->why, "UCX aborted unpacking it (signal %d, %s)%s%s",
             WTERMSIG(status), strsignal(WTERMSIG(status)), line[0] ? ": " : "", line);
  } else {
    c->result = FSDP_E_UNAVAILABLE;
    snprintf(c->why, sizeof c->why, "the check could not be made (exit status %d)%s%s",
             r > 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1, line[0] ? ": " : "", line);
  }
  uv_timer_stop(&c->timer);
  uv_close((uv_handle_t *)&c->poll, on_closed);
  uv_close((uv_handle_t *)&c->timer, on_closed);
}

static void on_exit_readable(uv_poll_t *poll, int status, int events) {
  (void)events;
  if (status < 0) {
    /* Polling the pidfd failed: rather than spin on it, wait for the deadline, which kills
     * the process and polls once more. */
    uv_poll_stop(poll);
    return;
  }
  finish(poll->data);
}

static void on_deadline(uv_timer_t *timer) {
  fsdp_address_check_t *c = timer->data;
  c->timed_out = true;
  pidfd_send_signal(c->pidfd, SIGKILL, NULL, 0);
  uv_poll_start(&c->poll, UV_READABLE, on_exit_readable);
}

int fsdp_address_check_start(uv_loop_t *loop, const void *bytes, size_t len,
                             uint64_t timeout_ms, fsdp_address_check_fn cb, void *data,
                             fsdp_address_check_t **ret_check, fsdp_status_t *st) {
  fsdp_address_check_t *c = calloc(1, sizeof *c);
  if (!c)
    return fsdp_status_set(st, -ENOMEM, "out of memory for an address check");
  c->pidfd = c->out_fd = -1;
  c->timeout_ms = timeout_ms;
  c->cb = cb;
  c->data = data;
  int in_fd = memfd_with("fsdpd-peer-address", bytes, len);
  c->out_fd = memfd_with("fsdpd-address-check", "", 0);
  int r = in_fd < 0 ? in_fd : c->out_fd;
  const char *what = "making its memfds";
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  if (r >= 0) {
    /* Nothing of the daemon's but the two memfds reaches the process, and it starts with no
     * signal blocked or ignored (the daemon ignores some while it stops). */
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    posix_spawn_file_actions_adddup2(&actions, in_fd, 0);
    posix_spawn_file_actions_adddup2(&actions, c->out_fd, 1);
    posix_spawn_file_actions_adddup2(&actions, c->out_fd, 2);
    posix_spawn_file_actions_addclosefrom_np(&actions, 3);
    char *argv[] = {"fsdpd", FSDP_ADDRESS_CHECK_FLAG, NULL};
    what = "starting it";
    r = -posix_spawn(&c->pid, "/proc/self/exe", &actions, &attr, argv, environ);
  }
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (in_fd >= 0)
    close(in_fd);
  if (r >= 0 && (c->pidfd = pidfd_open(c->pid, 0)) < 0) {
    r = -errno;
    what = "watching it (pidfd_open)";
    kill(c->pid, SIGKILL);
    waitpid(c->pid, NULL, 0); /* killed: it is gone at once */
  }
  if (r >= 0 && (r = uv_poll_init(loop, &c->poll, c->pidfd)) < 0) {
    what = "watching it (uv_poll)";
    pidfd_send_signal(c->pidfd, SIGKILL, NULL, 0);
    waitpid(c->pid, NULL, 0);
  }
  if (r < 0) {
    if (c->pidfd >= 0)
      close(c->pidfd);
    if (c->out_fd >= 0)
      close(c->out_fd);
    free(c);
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE,
                           "cannot check the address in a process of its own: %s: %s", what,
                           strerror(-r));
  }
  uv_timer_init(loop, &c->timer);
  c->poll.data = c->timer.data = c;
  c->open_handles = 2;
  uv_poll_start(&c->poll, UV_READABLE, on_exit_readable);
  uv_timer_start(&c->timer, on_deadline, timeout_ms, 0);
  *ret_check = c;
  return 0;
}

void fsdp_address_check_cancel(fsdp_address_check_t *check) {
  if (check->reaped || check->cancelled)
    return;
  check->cancelled = true;
  pidfd_send_signal(check->pidfd, SIGKILL, NULL, 0);
}

int fsdp_address_check_main(void) {
  static unsigned char address[FSDP_UCX_ADDRESS_MAX + 1];
  size_t len = 0;
  ssize_t got = 0;
  while (len < sizeof address &&
         ((got = read(0, address + len, sizeof address - len)) > 0 || (got < 0 && errno == EINTR)))
    len += got > 0 ? (size_t)got : 0;
  fsdp_status_t st;
  int code = CHECK_REFUSED;
  if (got < 0) {
    snprintf(st.message, sizeof st.message, "cannot read the address: %s", strerror(errno));
    code = CHECK_CANNOT;
  } else if (fsdp_ucx_address_check(address, len, "the peer", &st) == 0) {
    /* The daemon's own transport, as the fabric makes it, so that UCX unpacks the address
     * exactly as the daemon's worker would. */
    uv_loop_t loop;
    fsdp_ucx_t *ucx;
    fsdp_ucx_peer_t *peer;
    fsdp_ucx_options_t options = {.err_mode = FSDP_DATA_PLANE_UCX_ERR_MODE};
    if (uv_loop_init(&loop) < 0 || fsdp_ucx_new(&loop, &options, &ucx, &st) < 0)
      code = CHECK_CANNOT;
    else if (fsdp_ucx_connect(ucx, address, len, "the peer", &peer, &st) == 0)
      code = CHECK_TOOK;
    else if (st.code == -ENOMEM)
      code = CHECK_CANNOT;
  }
  printf("%s\n", code == CHECK_TOOK ? "UCX took the address" : st.message);
  fflush(stdout);
  /* Without UCX's teardown: the process has said all it had to. */
  _exit(code);
}
