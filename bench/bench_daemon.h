/* Benchmarks' handling of a throw-away fsdpd: start the one built next to the bench in a
 * fresh run dir, wait until it serves, stop it with SIGTERM and insist on a clean exit,
 * remove the run dir. Also the small sleep and error helpers the benches share.
 *
 * gRPC forbids fork() once it has threads: bench_daemon_spawn() must run before the process
 * makes any gRPC client, and so must any fork of the bench's own workers. */
#ifndef FSDP_BENCH_DAEMON_H
#define FSDP_BENCH_DAEMON_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <fsdp/fsdp_client.h>

/* How long a spawned fsdpd may take to answer, and to exit after SIGTERM. Both are far above
 * what a healthy daemon needs (tens of milliseconds); they only bound a broken one. */
#define BENCH_SPAWN_READY_MS 10000
#define BENCH_STOP_WAIT_MS 10000

/* Set by SIGINT/SIGTERM once bench_catch_signals() ran: work stops, cleanup still happens. */
extern volatile sig_atomic_t bench_interrupted;
void bench_catch_signals(void);

void bench_sleep_ms(long ms);
/* Formats into buf and returns -1, for `return bench_set_error(...)`. */
__attribute__((format(printf, 3, 4))) int bench_set_error(char *buf, size_t size, const char *fmt,
                                                          ...);

/* The spawned daemon: its run dir and process. */
typedef struct bench_daemon {
  char run_dir[64];
  char socket_path[128];
  pid_t pid;
  bool reaped;
  bool term_sent;        /* SIGTERM sent: never twice (see bench_daemon_terminate) */
  int exit_status;       /* waitpid status once reaped */
  double ready_deadline; /* fsdp_clock_now_s(): BENCH_SPAWN_READY_MS after the start */
} bench_daemon_t;

/* Starts fsdpd (with extra_args, a NULL-terminated list, after the bench's own) in a fresh
 * run dir named after `name`, and waits until its socket exists. */
int bench_daemon_spawn(bench_daemon_t *d, const char *name, const char *const *extra_args,
                       char *err, size_t err_size);
/* Waits until the daemon answers health.Check with SERVING, by `deadline`
 * (fsdp_clock_now_s() time). */
int bench_daemon_wait_serving(bench_daemon_t *d, fsdp_client_t *client, double deadline, char *err,
                              size_t err_size);
/* Waits until the daemon's Operator.Status says every peer joined both ways (topology
 * peers_ready; always true on one host), by `deadline` (fsdp_clock_now_s() time). On a
 * timeout the message names the peers that are not JOINED, their state and last error. */
int bench_daemon_wait_peers(bench_daemon_t *d, fsdp_client_t *client, double deadline, char *err,
                            size_t err_size);
/* Sends SIGTERM, once: fsdpd closes its signal handlers when its drain is over, so a second
 * SIGTERM in the last moments of its exit kills it by the default action, which
 * bench_daemon_stop would report as an unclean stop. Lets a bench stop several daemons at
 * once before waiting for each. */
void bench_daemon_terminate(bench_daemon_t *d);
/* SIGTERM (unless sent already), reap, remove the run dir; -1 with a message unless the daemon stopped cleanly. */
int bench_daemon_stop(bench_daemon_t *d, char *err, size_t err_size);

/* The program `name` next to the running bench (as the build and an install lay them out),
 * checked to be executable. */
int bench_find_program(const char *name, char *buf, size_t size, char *err, size_t err_size);
/* n distinct TCP ports free on 127.0.0.1 right now (held together while chosen, so that they
 * differ); a daemon started soon after can listen on them. n <= 64. */
int bench_free_tcp_ports(unsigned n, unsigned short *ret_ports, char *err, size_t err_size);

#endif
