/* A real fsdpd for the C integration tests, and the process helpers they share. For tests
 * only: nothing outside tests/ links it.
 *
 * daemon_fixture_start() makes a fresh run directory /tmp/<prefix>-XXXXXX (/tmp, not $TMPDIR:
 * the sockets' paths must fit sun_path), and starts $FSDP_BUILD_DIR/bin/fsdpd with
 * `--run-dir <dir> --health-listen 127.0.0.1:0` followed by the caller's extra arguments, stdin
 * from /dev/null and stdout and stderr into <dir>/fsdpd.log, in an environment without fsdpd's
 * own settings (FSDPD_*), proxies or systemd's variables. It returns once Health.Check on
 * d->target answers SERVING, or fails within 10 s, printing the log. daemon_fixture_stop()
 * sends SIGTERM, fails (and prints the log) unless fsdpd exits 0 within 10 s, and removes the
 * run directory. Both print what went wrong to stderr and return 0 or -1, so that they can
 * sit in a cmocka group setup and teardown.
 *
 * The tests use gRPC, and gRPC and fork() do not mix: fsdpd is started with posix_spawn, and
 * the tests must start their rank processes with posix_spawn too, never fork(). Start the
 * daemon in the group setup, before the tests make their own clients. One thread only; the
 * caller owns the daemon_fixture_t, which must be zeroed before start and may be stopped
 * after a failed or partial start. */
#ifndef FSDP_TESTS_DAEMON_FIXTURE_H
#define FSDP_TESTS_DAEMON_FIXTURE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct daemon_fixture {
  char run_dir[64];
  char target[128]; /* "unix:<run_dir>/fsdpd.sock", for fsdp_client_connect() */
  char log[128];
  pid_t pid; /* 0: not running, or reaped */
} daemon_fixture_t;

/* extra_args: NULL-terminated fsdpd arguments after the fixed ones, or NULL; borrowed. */
int daemon_fixture_start(daemon_fixture_t *d, const char *run_dir_prefix,
                         const char *const *extra_args);
int daemon_fixture_stop(daemon_fixture_t *d);
/* Whether Health.Check on d->target answers SERVING within 1 s. */
bool daemon_fixture_is_serving(const daemon_fixture_t *d);

/* CLOCK_MONOTONIC in milliseconds. */
int64_t now_ms(void);

/* Kills and reaps pid within timeout_ms of sig, then with SIGKILL; returns its wait status. */
int stop_process(pid_t pid, int sig, int timeout_ms);

#endif
