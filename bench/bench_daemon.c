/* Throw-away fsdpd processes for benchmarks, and the helpers benches share. */
#include "bench_daemon.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* The daemon's socket inside its run dir: FSDP_SOCKET_NAME of daemon/listener.h, repeated
 * because that header drags in libuv and the daemon's internals; the spawn fails loudly (no
 * socket appears) if the two ever drift. */
#define DAEMON_SOCKET_NAME "fsdpd.sock"

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

double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

int set_error(char *buf, size_t size, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, size, fmt, ap);
  va_end(ap);
  return -1;
}

/* fsdpd next to this binary, as the build and an install both lay them out. */
static int find_fsdpd(char *buf, size_t size, char *err, size_t err_size) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n < 0)
    return set_error(err, err_size, "cannot read /proc/self/exe: %s", strerror(errno));
  self[n] = '\0';
  char *slash = strrchr(self, '/');
  if (slash)
    *slash = '\0';
  if ((size_t)snprintf(buf, size, "%s/fsdpd", self) >= size)
    return set_error(err, err_size, "path of fsdpd next to '%s' is too long", self);
  if (access(buf, X_OK) < 0)
    return set_error(err, err_size, "cannot run '%s' (fsdpd is looked for next to the bench): %s",
                     buf, strerror(errno));
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
static bool daemon_exited(daemon_proc_t *d) {
  if (d->reaped)
    return true;
  if (waitpid(d->pid, &d->exit_status, WNOHANG) == d->pid)
    d->reaped = true;
  return d->reaped;
}

int bench_daemon_spawn(daemon_proc_t *d, const char *name, const char *const *extra_args,
                       char *err, size_t err_size) {
  char fsdpd[PATH_MAX];
  if (find_fsdpd(fsdpd, sizeof fsdpd, err, err_size) < 0)
    return -1;
  snprintf(d->run_dir, sizeof d->run_dir, "/tmp/%s.XXXXXX", name);
  if (!mkdtemp(d->run_dir)) {
    d->run_dir[0] = '\0';
    return set_error(err, err_size, "cannot make a run dir under /tmp: %s", strerror(errno));
  }
  /* mkdtemp makes 0700; fsdpd wants its run dir 0750 and would warn and fix it. */
  if (chmod(d->run_dir, 0750) < 0)
    return set_error(err, err_size, "cannot set mode 0750 on '%s': %s", d->run_dir,
                     strerror(errno));
  snprintf(d->socket_path, sizeof d->socket_path, "%s/%s", d->run_dir, DAEMON_SOCKET_NAME);

  char *argv[32] = {fsdpd,         "--run-dir",   d->run_dir, "--health-listen",
                    "127.0.0.1:0", "--log-level", "warning"};
  size_t argc = 7;
  for (size_t i = 0; extra_args && extra_args[i] && argc < 31; i++)
    argv[argc++] = (char *)extra_args[i];
  argv[argc] = NULL;
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0)
    return set_error(err, err_size, "cannot fork for fsdpd: %s", strerror(errno));
  if (pid == 0) {
    /* Its own process group keeps a terminal's ^C away from it, so that the bench decides
     * when it stops; PDEATHSIG stops it if the bench dies without cleaning up. */
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent)
      _exit(127);
    execv(fsdpd, argv);
    static const char msg[] = "bench: cannot exec fsdpd\n";
    ssize_t unused = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)unused;
    _exit(127);
  }
  d->pid = pid;

  d->ready_deadline = now_s() + SPAWN_READY_MS / 1e3;
  for (;;) {
    struct stat sb;
    if (stat(d->socket_path, &sb) == 0 && S_ISSOCK(sb.st_mode))
      return 0;
    if (daemon_exited(d)) {
      char how[96];
      describe_exit(d->exit_status, how, sizeof how);
      return set_error(err, err_size, "fsdpd %s before its socket %s appeared", how,
                       d->socket_path);
    }
    if (bench_interrupted)
      return set_error(err, err_size, "bench_interrupted while waiting for fsdpd");
    if (now_s() > d->ready_deadline)
      return set_error(err, err_size, "fsdpd made no socket %s within %d ms", d->socket_path,
                       SPAWN_READY_MS);
    sleep_ms(5);
  }
}

/* Within what is left of the spawn deadline. The bench's own first client asks: a separate probe client would be the
 * process's last gRPC user when closed, and a full gRPC shutdown and re-init, with the
 * channels sharing one subchannel to the same socket, is a race we do not want to measure.
 * The client fails fast while it cannot connect, so it retries. */
int bench_daemon_wait_serving(daemon_proc_t *d, fsdp_client_t *client, double deadline,
                              char *err, size_t err_size) {
  for (;;) {
    fsdp_health_status_t hs = FSDP_HEALTH_UNKNOWN;
    int r = fsdp_client_health_check(client, "", 1000, &hs);
    if (r >= 0 && hs == FSDP_HEALTH_SERVING)
      return 0;
    if (daemon_exited(d)) {
      char how[96];
      describe_exit(d->exit_status, how, sizeof how);
      return set_error(err, err_size, "fsdpd %s before it answered health.Check", how);
    }
    if (bench_interrupted)
      return set_error(err, err_size, "bench_interrupted while waiting for fsdpd");
    if (now_s() > deadline) {
      if (r < 0)
        return set_error(err, err_size, "fsdpd did not answer within %d ms: health.Check(\"\"): "
                         "%s: %s", SPAWN_READY_MS, fsdp_strerror(r),
                         fsdp_client_last_error(client));
      return set_error(err, err_size, "fsdpd did not become SERVING within %d ms (health: %s)",
                       SPAWN_READY_MS, fsdp_health_status_name(hs));
    }
    sleep_ms(20);
  }
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

/* A bench run must not hide a daemon that crashes on drain: a stop other than exit 0 fails. */
int bench_daemon_stop(daemon_proc_t *d, char *err, size_t err_size) {
  int rc = 0;
  if (d->pid > 0 && !d->reaped) {
    kill(d->pid, SIGTERM);
    double deadline = now_s() + STOP_WAIT_MS / 1e3;
    while (!daemon_exited(d) && now_s() < deadline)
      sleep_ms(5);
    if (!d->reaped) {
      kill(d->pid, SIGKILL);
      waitpid(d->pid, &d->exit_status, 0);
      d->reaped = true;
      rc = set_error(err, err_size, "fsdpd (pid %ld) did not stop within %d ms of SIGTERM",
                     (long)d->pid, STOP_WAIT_MS);
    } else if (!WIFEXITED(d->exit_status) || WEXITSTATUS(d->exit_status) != 0) {
      char how[96];
      describe_exit(d->exit_status, how, sizeof how);
      rc = set_error(err, err_size, "fsdpd (pid %ld) %s on SIGTERM, expected a clean stop",
                     (long)d->pid, how);
    }
  }
  if (d->run_dir[0])
    remove_run_dir(d->run_dir);
  return rc;
}

