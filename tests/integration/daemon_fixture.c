/* Starts and stops a real fsdpd for the C integration tests; the contract is in
 * daemon_fixture.h. */
#include "tests/integration/daemon_fixture.h"

#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <fsdp/fsdp_client.h>

#include "common/clock.h"

extern char **environ;

#define START_TIMEOUT_MS 10000
#define STOP_TIMEOUT_MS 10000
#define FIXED_ARGS 7 /* fsdpd --run-dir DIR --health-listen ADDR --metrics-listen ADDR */
#define MAX_EXTRA_ARGS 16

int64_t now_ms(void) {
  return fsdp_clock_now_ms();
}

static void dump_log(const daemon_fixture_t *d) {
  FILE *f = fopen(d->log, "r");
  if (!f)
    return;
  char line[1024];
  fprintf(stderr, "--- %s ---\n", d->log);
  while (fgets(line, sizeof line, f))
    fputs(line, stderr);
  fclose(f);
}

/* fsdpd must see neither our fsdpd settings nor a proxy nor systemd's variables. */
static bool scrubbed(const char *var) {
  static const char *const prefixes[] = {"FSDPD_", "NOTIFY_SOCKET=", "WATCHDOG_", "LISTEN_",
                                         "http_proxy=", "https_proxy=", "all_proxy=",
                                         "grpc_proxy=", "no_proxy=", "HTTP_PROXY=",
                                         "HTTPS_PROXY=", "ALL_PROXY=", "NO_PROXY="};
  for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++)
    if (strncmp(var, prefixes[i], strlen(prefixes[i])) == 0)
      return true;
  return false;
}

bool daemon_fixture_is_serving(const daemon_fixture_t *d) {
  fsdp_client_options_t opts = FSDP_CLIENT_OPTIONS_INIT;
  opts.timeout_ms = 1000;
  fsdp_client_t *client = NULL;
  fsdp_health_status_t status = FSDP_HEALTH_UNKNOWN;
  bool ok = fsdp_client_connect(d->target, &opts, &client) == 0 &&
            fsdp_client_health_check(client, "", 0, &status) == 0 &&
            status == FSDP_HEALTH_SERVING;
  fsdp_client_close(client);
  return ok;
}

int daemon_fixture_start(daemon_fixture_t *d, const char *run_dir_prefix,
                         const char *const *extra_args) {
  const char *build = getenv("FSDP_BUILD_DIR");
  if (!build) {
    fprintf(stderr, "FSDP_BUILD_DIR is not set (ctest sets it)\n");
    return -1;
  }
  char fsdpd[4096];
  snprintf(fsdpd, sizeof fsdpd, "%s/bin/fsdpd", build);
  int len = snprintf(d->run_dir, sizeof d->run_dir, "/tmp/%s-XXXXXX", run_dir_prefix);
  if (len < 0 || (size_t)len >= sizeof d->run_dir) {
    fprintf(stderr, "run directory prefix '%s' is too long\n", run_dir_prefix);
    d->run_dir[0] = '\0';
    return -1;
  }
  if (!mkdtemp(d->run_dir)) {
    d->run_dir[0] = '\0';
    return -1;
  }
  snprintf(d->target, sizeof d->target, "unix:%s/fsdpd.sock", d->run_dir);
  snprintf(d->log, sizeof d->log, "%s/fsdpd.log", d->run_dir);

  /* posix_spawn takes char *const[]; fsdpd does not write its arguments. */
  char *argv[FIXED_ARGS + MAX_EXTRA_ARGS + 1] = {fsdpd, "--run-dir", d->run_dir,
                                                 "--health-listen", "127.0.0.1:0",
                                                 "--metrics-listen", "127.0.0.1:0"};
  size_t argc = FIXED_ARGS;
  for (size_t i = 0; extra_args && extra_args[i]; i++) {
    if (i == MAX_EXTRA_ARGS) {
      fprintf(stderr, "more than %d extra fsdpd arguments\n", MAX_EXTRA_ARGS);
      return -1;
    }
    argv[argc++] = (char *)extra_args[i];
  }
  argv[argc] = NULL;

  size_t n = 0;
  while (environ[n])
    n++;
  char **env = calloc(n + 1, sizeof *env);
  if (!env)
    return -1;
  for (size_t i = 0, j = 0; i < n; i++)
    if (!scrubbed(environ[i]))
      env[j++] = environ[i];
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, d->log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  int r = posix_spawn(&d->pid, fsdpd, &fa, NULL, argv, env);
  posix_spawn_file_actions_destroy(&fa);
  free(env);
  if (r != 0) {
    d->pid = 0;
    fprintf(stderr, "posix_spawn %s: %s\n", fsdpd, strerror(r));
    return -1;
  }

  char sock[128];
  snprintf(sock, sizeof sock, "%s/fsdpd.sock", d->run_dir);
  for (int64_t deadline = now_ms() + START_TIMEOUT_MS;;) {
    struct stat sb;
    if (stat(sock, &sb) == 0 && daemon_fixture_is_serving(d))
      return 0;
    int wstatus;
    if (waitpid(d->pid, &wstatus, WNOHANG) == d->pid) {
      d->pid = 0;
      fprintf(stderr, "fsdpd exited before serving\n");
      dump_log(d);
      return -1;
    }
    if (now_ms() > deadline) {
      fprintf(stderr, "fsdpd did not serve within %d ms\n", START_TIMEOUT_MS);
      dump_log(d);
      return -1;
    }
    poll(NULL, 0, 10);
  }
}

int stop_process(pid_t pid, int sig, int timeout_ms) {
  int wstatus = 0;
  kill(pid, sig);
  for (int64_t deadline = now_ms() + timeout_ms; now_ms() < deadline; poll(NULL, 0, 10))
    if (waitpid(pid, &wstatus, WNOHANG) == pid)
      return wstatus;
  kill(pid, SIGKILL);
  waitpid(pid, &wstatus, 0);
  return wstatus;
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(path);
}

int daemon_fixture_stop(daemon_fixture_t *d) {
  int rc = 0;
  if (d->pid > 0) {
    int wstatus = stop_process(d->pid, SIGTERM, STOP_TIMEOUT_MS);
    d->pid = 0;
    if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
      fprintf(stderr, "fsdpd ended with wait status %#x\n", wstatus);
      dump_log(d);
      rc = -1;
    }
  }
  if (d->run_dir[0])
    nftw(d->run_dir, remove_entry, 8, FTW_DEPTH | FTW_PHYS);
  d->run_dir[0] = '\0';
  return rc;
}
