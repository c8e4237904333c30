/* Throw-away fsdpd processes for benchmarks, and the helpers benches share. */
#include "bench/bench_daemon.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/client_rpc.h"
#include "common/clock.h"
#include "fsdp/v1/operator.pb-c.h"
#include "proto/limits.h"
#include "proto/wire.h"

volatile sig_atomic_t bench_interrupted;

static void on_signal(int sig) {
  (void)sig;
  bench_interrupted = 1;
}

void bench_catch_signals(void) {
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
}

void bench_sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

int bench_set_error(char *buf, size_t size, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, size, fmt, ap);
  va_end(ap);
  return -1;
}

/* A program next to this binary, as the build and an install both lay them out. */
int bench_find_program(const char *name, char *buf, size_t size, char *err, size_t err_size) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n < 0)
    return bench_set_error(err, err_size, "cannot read /proc/self/exe: %s", strerror(errno));
  self[n] = '\0';
  char *slash = strrchr(self, '/');
  if (slash)
    *slash = '\0';
  if ((size_t)snprintf(buf, size, "%s/%s", self, name) >= size)
    return bench_set_error(err, err_size, "path of %s next to '%s' is too long", name, self);
  if (access(buf, X_OK) < 0)
    return bench_set_error(err, err_size,
                           "cannot run '%s' (%s is looked for next to the bench): %s", buf, name,
                           strerror(errno));
  return 0;
}

static void describe_exit(int status, char *buf, size_t size) {
  if (WIFEXITED(status))
    snprintf(buf, size, "exited with status %d", WEXITSTATUS(status));
  else if (WIFSIGNALED(status))
    snprintf(buf, size, "was killed by signal %d (%s)", WTERMSIG(status),
             strsignal(WTERMSIG(status)));
  else
    snprintf(buf, size, "stopped with wait status 0x%x", (unsigned)status);
}

/* Reaps the daemon if it has exited; true if it has. */
static bool daemon_exited(bench_daemon_t *d) {
  if (d->reaped)
    return true;
  if (waitpid(d->pid, &d->exit_status, WNOHANG) == d->pid)
    d->reaped = true;
  return d->reaped;
}

int bench_daemon_spawn(bench_daemon_t *d, const char *name, const char *const *extra_args,
                       char *err, size_t err_size) {
  *d = (bench_daemon_t){0};
  char fsdpd[PATH_MAX];
  if (bench_find_program("fsdpd", fsdpd, sizeof fsdpd, err, err_size) < 0)
    return -1;
  snprintf(d->run_dir, sizeof d->run_dir, "/tmp/%s.XXXXXX", name);
  if (!mkdtemp(d->run_dir)) {
    d->run_dir[0] = '\0';
    return bench_set_error(err, err_size, "cannot make a run dir under /tmp: %s", strerror(errno));
  }
  /* mkdtemp makes 0700; fsdpd wants its run dir 0750 and would warn and fix it. */
  if (chmod(d->run_dir, 0750) < 0)
    return bench_set_error(err, err_size, "cannot set mode 0750 on '%s': %s", d->run_dir,
                           strerror(errno));
  snprintf(d->socket_path, sizeof d->socket_path, "%s/%s", d->run_dir, FSDP_SOCKET_NAME);

  char *argv[32] = {fsdpd,         "--run-dir",   d->run_dir, "--health-listen",
                    "127.0.0.1:0", "--metrics-listen", "", "--log-level", "warning"};
  size_t argc = 9;
  for (size_t i = 0; extra_args && extra_args[i] && argc < 31; i++)
    argv[argc++] = (char *)extra_args[i];
  argv[argc] = NULL;
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0)
    return bench_set_error(err, err_size, "cannot fork for fsdpd: %s", strerror(errno));
  if (pid == 0) {
    /* Its own process group keeps a terminal's ^C away from it, so that the bench decides
     * when it stops; PDEATHSIG stops it if the bench dies without cleaning up. */
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent)
      _exit(127);
    /* UCX logs to stdout; the bench's stdout is its report (--json), so the daemon's goes to
     * stderr with its own log. */
    dup2(STDERR_FILENO, STDOUT_FILENO);
    execv(fsdpd, argv);
    static const char msg[] = "bench: cannot exec fsdpd\n";
    ssize_t unused = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)unused;
    _exit(127);
  }
  d->pid = pid;

  d->ready_deadline = fsdp_clock_now_s() + BENCH_SPAWN_READY_MS / 1e3;
  for (;;) {
    struct stat sb;
    if (stat(d->socket_path, &sb) == 0 && S_ISSOCK(sb.st_mode))
      return 0;
    if (daemon_exited(d)) {
      char how[96];
      describe_exit(d->exit_status, how, sizeof how);
      return bench_set_error(err, err_size, "fsdpd %s before its socket %s appeared", how,
                             d->socket_path);
    }
    if (bench_interrupted)
      return bench_set_error(err, err_size, "bench_interrupted while waiting for fsdpd");
    if (fsdp_clock_now_s() > d->ready_deadline)
      return bench_set_error(err, err_size, "fsdpd made no socket %s within %d ms", d->socket_path,
                             BENCH_SPAWN_READY_MS);
    bench_sleep_ms(5);
  }
}

/* Within what is left of the spawn deadline. The bench's own first client asks: a separate probe client would be the
 * process's last gRPC user when closed, and a full gRPC shutdown and re-init, with the
 * channels sharing one subchannel to the same socket, is a race we do not want to measure.
 * The client fails fast while it cannot connect, so it retries. */
int bench_daemon_wait_serving(bench_daemon_t *d, fsdp_client_t *client, double deadline, char *err,
                              size_t err_size) {
  for (;;) {
    fsdp_health_status_t hs = FSDP_HEALTH_UNKNOWN;
    int r = fsdp_client_health_check(client, "", 1000, &hs);
    if (r >= 0 && hs == FSDP_HEALTH_SERVING)
      return 0;
    if (daemon_exited(d)) {
      char how[96];
      describe_exit(d->exit_status, how, sizeof how);
      return bench_set_error(err, err_size, "fsdpd %s before it answered health.Check", how);
    }
    if (bench_interrupted)
      return bench_set_error(err, err_size, "bench_interrupted while waiting for fsdpd");
    if (fsdp_clock_now_s() > deadline) {
      if (r < 0)
        return bench_set_error(err, err_size,
                               "fsdpd did not answer within %d ms: health.Check(\"\"): "
                               "%s: %s",
                               BENCH_SPAWN_READY_MS, fsdp_strerror(r),
                               fsdp_client_last_error(client));
      return bench_set_error(err, err_size,
                             "fsdpd did not become SERVING within %d ms (health: %s)",
                             BENCH_SPAWN_READY_MS, fsdp_health_status_name(hs));
    }
    bench_sleep_ms(20);
  }
}

/* Writes "host R STATE (last error); ..." for every peer that is neither SELF nor JOINED. */
static void describe_unjoined(const Fsdp__V1__StatusReply *s, char *buf, size_t size) {
  size_t len = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < s->n_peers && len < size; i++) {
    const Fsdp__V1__PeerStatus *p = s->peers[i];
    if (p->state == FSDP__V1__PEER_STATE__PEER_STATE_SELF ||
        p->state == FSDP__V1__PEER_STATE__PEER_STATE_JOINED)
      continue;
    int n = snprintf(buf + len, size - len, "%shost %u %s%s%s%s", len ? "; " : "", p->host_rank,
                     fsdp_wire_peer_state_name(p->state),
                     p->last_error && p->last_error[0] ? " (" : "",
                     p->last_error ? p->last_error : "",
                     p->last_error && p->last_error[0] ? ")" : "");
    if (n < 0)
      break;
    len += (size_t)n;
  }
}

int bench_daemon_wait_peers(bench_daemon_t *d, fsdp_client_t *client, double deadline, char *err,
                            size_t err_size) {
  char path[FSDP_WIRE_PATH_MAX];
  const ProtobufCServiceDescriptor *sd = &fsdp__v1__operator__descriptor;
  const ProtobufCMethodDescriptor *md =
      protobuf_c_service_descriptor_get_method_by_name(sd, "Status");
  if (!md || fsdp_wire_method_path(sd, (unsigned)(md - sd->methods), path, sizeof path) < 0)
    return bench_set_error(err, err_size, "%s", "fsdp.v1.Operator has no method Status");
  char last[512] = "no answer yet";
  for (;;) {
    Fsdp__V1__StatusRequest request = FSDP__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *reply = NULL;
    int r = fsdp_client_call(client, path, &request.base, &fsdp__v1__status_reply__descriptor,
                             1000, &reply);
    if (r >= 0) {
      const Fsdp__V1__StatusReply *s = (const Fsdp__V1__StatusReply *)reply;
      bool ready = s->topology && s->topology->peers_ready;
      if (!ready)
        describe_unjoined(s, last, sizeof last);
      protobuf_c_message_free_unpacked(reply, NULL);
      if (ready)
        return 0;
    } else {
      snprintf(last, sizeof last, "Operator.Status: %s: %s", fsdp_strerror(r),
               fsdp_client_last_error(client));
    }
    if (daemon_exited(d)) {
      char how[96];
      describe_exit(d->exit_status, how, sizeof how);
      return bench_set_error(err, err_size, "fsdpd (%s) %s while waiting for its peers", d->run_dir,
                             how);
    }
    if (bench_interrupted)
      return bench_set_error(err, err_size, "bench_interrupted while waiting for the peers");
    if (fsdp_clock_now_s() > deadline)
      return bench_set_error(err, err_size, "fsdpd (%s): peers not ready in time: %s", d->run_dir,
                             last);
    bench_sleep_ms(20);
  }
}

int bench_free_tcp_ports(unsigned n, unsigned short *ret_ports, char *err, size_t err_size) {
  int fds[64];
  unsigned short ports[64];
  unsigned open_fds = 0;
  int rc = 0;
  if (n > 64)
    return bench_set_error(err, err_size, "%u ports asked for, at most 64", n);
  for (; open_fds < n; open_fds++) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      rc = bench_set_error(err, err_size, "socket: %s", strerror(errno));
      break;
    }
    fds[open_fds] = fd;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 ||
        getsockname(fd, (struct sockaddr *)&a, &alen) < 0) {
      rc = bench_set_error(err, err_size, "cannot bind a TCP port on 127.0.0.1: %s",
                           strerror(errno));
      close(fd);
      break;
    }
    ports[open_fds] = ntohs(a.sin_port);
  }
  for (unsigned i = 0; i < open_fds; i++)
    close(fds[i]);
  if (rc == 0)
    memcpy(ret_ports, ports, n * sizeof *ports);
  return rc;
}

/* Removes the run dir and what the daemon left in it (its lock file; the socket too if it
 * did not stop cleanly). The dir is flat: fsdpd makes no subdirectories. */
static void remove_run_dir(const char *dir) {
  DIR *dp = opendir(dir);
  if (dp) {
    struct dirent *e;
    while ((e = readdir(dp))) {
      if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
        continue;
      char path[PATH_MAX];
      snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
      if (unlink(path) < 0)
        fprintf(stderr, "bench: cannot remove '%s': %s\n", path, strerror(errno));
    }
    closedir(dp);
  }
  if (rmdir(dir) < 0)
    fprintf(stderr, "bench: cannot remove run dir '%s': %s\n", dir, strerror(errno));
}

void bench_daemon_terminate(bench_daemon_t *d) {
  if (d->pid > 0 && !d->reaped && !d->term_sent) {
    kill(d->pid, SIGTERM);
    d->term_sent = true;
  }
}

/* A bench run must not hide a daemon that crashes on drain: a stop other than exit 0 fails. */
int bench_daemon_stop(bench_daemon_t *d, char *err, size_t err_size) {
  int rc = 0;
  if (d->pid > 0 && !d->reaped) {
    bench_daemon_terminate(d);
    double deadline = fsdp_clock_now_s() + BENCH_STOP_WAIT_MS / 1e3;
    while (!daemon_exited(d) && fsdp_clock_now_s() < deadline)
      bench_sleep_ms(5);
    if (!d->reaped) {
      kill(d->pid, SIGKILL);
      waitpid(d->pid, &d->exit_status, 0);
      d->reaped = true;
      rc = bench_set_error(err, err_size, "fsdpd (pid %ld) did not stop within %d ms of SIGTERM",
                           (long)d->pid, BENCH_STOP_WAIT_MS);
    } else if (!WIFEXITED(d->exit_status) || WEXITSTATUS(d->exit_status) != 0) {
      char how[96];
      describe_exit(d->exit_status, how, sizeof how);
      rc = bench_set_error(err, err_size, "fsdpd (pid %ld) %s on SIGTERM, expected a clean stop",
                           (long)d->pid, how);
    }
  }
  if (d->run_dir[0])
    remove_run_dir(d->run_dir);
  return rc;
}
