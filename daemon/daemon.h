/* fsdp_daemon_t: the one object that owns the daemon's state, made in main() and passed
 * down; nothing else in the daemon is global (except the log level).
 *
 * It runs on one libuv loop: the local listener (unix socket), the RPC server and its
 * endpoints, the health service, signals (SIGTERM/SIGINT drain, SIGHUP reloads) and one
 * housekeeping timer that also pings the systemd watchdog. Every function here runs on the
 * loop thread. */
#ifndef FSDP_DAEMON_H
#define FSDP_DAEMON_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "config/config.h"
#include "daemon/args.h"
#include "daemon/cluster/fabric.h"
#include "daemon/cluster/peers.h"
#include "daemon/checkpoints/checkpoints.h"
#include "daemon/dataplane/dataplane.h"
#include "daemon/metrics/http.h"
#include "daemon/rpc/listener.h"
#include "daemon/rpc/rpc_server.h"
#include "daemon/services/context.h"
#include "daemon/services/health.h"
#include "daemon/session/channel.h"
#include "daemon/session/sessions.h"
#include "daemon/store/store.h"

typedef enum fsdp_daemon_state {
  FSDP_DAEMON_STARTING,
  FSDP_DAEMON_SERVING,
  FSDP_DAEMON_DRAINING, /* Operator.Drain: no new work until Resume */
  FSDP_DAEMON_STOPPING, /* SIGTERM/SIGINT: draining, then exit */
  FSDP_DAEMON_STOPPED,
} fsdp_daemon_state_t;

typedef struct fsdp_daemon {
  uv_loop_t loop;
  const fsdp_args_t *args; /* borrowed: the flags a reload re-applies */
  char *const *envp;       /* borrowed */
  fsdp_config_t config;
  fsdp_daemon_state_t state;
  uint64_t started_ms; /* uv_now() at start */

  fsdp_listener_t listener;
  fsdp_health_t health;
  fsdp_sessions_t sessions;
  fsdp_store_t store;
  fsdp_channel_t channel;
  fsdp_dataplane_t dataplane;
  fsdp_checkpoints_t checkpoints;
  fsdp_services_context_t handlers; /* what the handlers work on; borrowed by them */
  fsdp_rpc_service_t services[FSDP_SERVICE_COUNT]; /* borrowed by the RPC server */
  fsdp_rpc_server_t *rpc;
  fsdp_rpc_endpoint_t *local_endpoint;
  fsdp_rpc_endpoint_t *health_endpoint; /* NULL when health.listen is empty */
  fsdp_rpc_endpoint_t *refused_endpoint; /* uids the unix socket does not let in hear why */
  char health_address[320];             /* with the bound port */
  fsdp_rpc_endpoint_t *peer_endpoint;   /* NULL on one host */
  char peer_address[320];
  fsdp_metrics_http_t *metrics; /* NULL when metrics.listen is empty */
  char metrics_address[320];
  fsdp_peer_security_t peer_security;   /* the token and TLS files, read at start */
  /* daemon.operator_group resolved (at start and on reload): whose members may change the
   * daemon's state besides root and its own user. */
  bool has_operator_group;
  gid_t operator_gid;
  fsdp_peers_t *peers;                  /* always there; one host: no peers, ready */
  fsdp_fabric_t *fabric;                /* the data plane's connections; one host: NULL */

  uv_signal_t sigterm, sigint, sighup;
  uv_timer_t housekeeping;
  /* checkpoint.on_stop: the saves a stop waits for (at most checkpoint.stop_timeout), and
   * why it stops once they end. */
  unsigned stop_saves;
  uv_timer_t stop_saves_timer;
  char stop_why[32];
  uint64_t watchdog_usec; /* 0 when systemd's watchdog is off */
} fsdp_daemon_t;

/* Brings the daemon up and tells systemd READY=1. Takes ownership of *config (moved into
 * the daemon; the caller's copy is left zeroed). On failure everything is undone, st says
 * why, and the return value is FSDP_E_CONFIG for a config the daemon cannot serve. */
int fsdp_daemon_start(fsdp_daemon_t *daemon, const fsdp_args_t *args, char *const *envp,
                      fsdp_config_t *config, fsdp_status_t *st);

/* Runs the loop until the daemon has stopped and released everything; returns the exit
 * status. */
int fsdp_daemon_run(fsdp_daemon_t *daemon);

/* Health NOT_SERVING at once, new work refused, in-flight work drained within
 * daemon.drain_timeout, then everything is released and the loop ends. Idempotent. */
void fsdp_daemon_stop(fsdp_daemon_t *daemon, const char *why);

#endif
