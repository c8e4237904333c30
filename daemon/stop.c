/* The daemon's drain and stop: the saves a stop makes first, then the handles closed in
 * order (the RPC server, the peers, the fabric), the loop left to end. */
#include "daemon/internal.h"

#include <limits.h>
#include <signal.h>
#include <stdio.h>

#include <systemd/sd-daemon.h>

#include "common/log.h"
#include "daemon/services/fastpath.h"
#include "daemon/services/services.h"
#include "daemon/services/trainer_events.h"

static void on_handle_closed(uv_handle_t *handle) {
  (void)handle;
}

static void close_handles(fsdp_daemon_t *daemon) {
  /* Closing a signal's watcher restores its default action: a SIGTERM or Ctrl-C while the
   * daemon finishes exiting would kill it instead of letting it exit 0. Each is ignored
   * right after its watcher closes, so that the window between is a few instructions. */
  uv_signal_t *signals[] = {&daemon->sigterm, &daemon->sigint, &daemon->sighup};
  const int signums[] = {SIGTERM, SIGINT, SIGHUP};
  for (size_t i = 0; i < sizeof signals / sizeof signals[0]; i++)
    if (!uv_is_closing((uv_handle_t *)signals[i])) {
      uv_close((uv_handle_t *)signals[i], on_handle_closed);
      signal(signums[i], SIG_IGN);
    }
  uv_handle_t *timers[] = {(uv_handle_t *)&daemon->housekeeping,
                           (uv_handle_t *)&daemon->stop_saves_timer};
  for (size_t i = 0; i < sizeof timers / sizeof timers[0]; i++)
    if (!uv_is_closing(timers[i]))
      uv_close(timers[i], on_handle_closed);
}

static void on_peers_closed(void *data) {
  fsdp_daemon_t *daemon = data;
  fsdp_peers_free(daemon->peers);
  daemon->peers = daemon->handlers.peers = NULL;
  fsdp_peer_security_cleanup(&daemon->peer_security);
}

static void on_fabric_closed(void *data) {
  fsdp_daemon_t *daemon = data;
  daemon->fabric = NULL;
  fsdp_peers_close(daemon->peers, on_peers_closed, daemon);
}

static void on_rpc_stopped(void *data) {
  fsdp_daemon_t *daemon = data;
  fsdp_rpc_server_free(daemon->rpc);
  daemon->rpc = daemon->handlers.rpc = NULL;
  /* Collectives among hosts still running end CANCELLED; then the peers go. */
  fsdp_dataplane_set_cluster(&daemon->dataplane, NULL, NULL, 0);
  if (daemon->fabric)
    fsdp_fabric_close(daemon->fabric, on_fabric_closed, daemon);
  else
    on_fabric_closed(daemon); /* one host: there is no fabric */
  fsdp_channel_stop(&daemon->channel);
  for (fsdp_session_t *s = daemon->sessions.head; s; s = s->next) {
    fsdp_fastpath_close(s->fast_path);
    fsdp_trainer_events_close(s->cuda_events);
  }
  fsdp_sessions_cleanup(&daemon->sessions);
  fsdp_listener_close(&daemon->listener);
  fsdp_metrics_http_stop(daemon->metrics);
  daemon->metrics = NULL;
  daemon->metrics_address[0] = '\0';
  close_handles(daemon);
  daemon->state = FSDP_DAEMON_STOPPED;
  log_info("stopped");
}

static void stop_now(fsdp_daemon_t *daemon, const char *why) {
  daemon->state = FSDP_DAEMON_STOPPING;
  uint64_t drain_ms = (uint64_t)fsdp_config_number(&daemon->config, FSDP_OPTION_DRAIN_TIMEOUT);
  log_info("%s: draining, then stopping (at most %llu ms)", why, (unsigned long long)drain_ms);
  sd_notify(0, "STOPPING=1\nSTATUS=draining");
  /* Watchers hear NOT_SERVING before their streams end. The listener keeps accepting while
   * the drain lasts, so probes and operators can still see the daemon drain. */
  fsdp_health_set_serving(&daemon->health, false);
  fsdp_health_cleanup(&daemon->health);
  /* The peers hear it at once and count this host LEFT rather than wait out peer.timeout. */
  fsdp_peers_leave(daemon->peers, why);
  /* The saves the stop waited for are written (or given up on): others stop writing. */
  fsdp_checkpoints_abandon(&daemon->checkpoints);
  fsdp_rpc_server_stop(daemon->rpc, drain_ms, on_rpc_stopped, daemon);
}

static void stop_after_saves(fsdp_daemon_t *daemon) {
  uv_timer_stop(&daemon->stop_saves_timer);
  daemon->stop_saves = 0;
  stop_now(daemon, daemon->stop_why);
}

static void on_stop_save(void *data, const fsdp_status_t *st, const char *path, uint64_t step) {
  fsdp_daemon_t *daemon = data;
  (void)st, (void)path, (void)step; /* the data plane logged how it went */
  if (daemon->stop_saves && --daemon->stop_saves == 0)
    stop_after_saves(daemon);
}

static void on_stop_saves_late(uv_timer_t *timer) {
  fsdp_daemon_t *daemon = timer->data;
  log_error("%s: stopping without %u checkpoint%s not written within checkpoint.stop_timeout "
            "(a job that did not reach a step boundary, or a slow disk)",
            daemon->stop_why, daemon->stop_saves, daemon->stop_saves == 1 ? "" : "s");
  stop_after_saves(daemon);
}

/* checkpoint.on_stop: saves each job that trained a step into checkpoint.dir/<job>/ at its
 * step boundary, while the daemon goes on serving so that its trainers reach it; how many
 * saves the stop waits for. */
static unsigned save_before_stop(fsdp_daemon_t *daemon) {
  const fsdp_config_t *cfg = &daemon->config;
  const char *dir = daemon->checkpoints.dir; /* checkpoint.dir, its links resolved */
  if (!dir[0] || !fsdp_config_number(cfg, FSDP_OPTION_CHECKPOINT_ON_STOP))
    return 0;
  unsigned saves = 0;
  for (fsdp_job_t *job = daemon->store.jobs; job; job = job->next) {
    char path[PATH_MAX];
    fsdp_status_t st;
    int r = (size_t)snprintf(path, sizeof path, "%s/%s", dir, job->name) >= sizeof path
                ? fsdp_status_set(&st, FSDP_E_INVALID_ARGUMENT, "checkpoint.dir is too long")
                : fsdp_checkpoints_save_at_boundary(&daemon->checkpoints, job, path,
                                                    daemon_job_has_session(daemon, job, NULL),
                                                    on_stop_save, daemon, &st);
    if (r < 0)
      log_error("job '%s': no checkpoint before stopping: %s", job->name, st.message);
    saves += r == 0;
  }
  return saves;
}

void fsdp_daemon_stop(fsdp_daemon_t *daemon, const char *why) {
  if (daemon->state != FSDP_DAEMON_SERVING && daemon->state != FSDP_DAEMON_DRAINING)
    return;
  if (daemon->stop_saves) {
    log_warning("%s again: stopping without waiting for the checkpoints", why);
    stop_after_saves(daemon);
    return;
  }
  snprintf(daemon->stop_why, sizeof daemon->stop_why, "%s", why);
  /* Training stops: pacing the saves would only make the stop wait. */
  fsdp_checkpoints_hurry(&daemon->checkpoints);
  daemon->stop_saves = save_before_stop(daemon);
  if (!daemon->stop_saves) {
    stop_now(daemon, why);
    return;
  }
  uint64_t timeout_ms =
      (uint64_t)fsdp_config_number(&daemon->config, FSDP_OPTION_CHECKPOINT_STOP_TIMEOUT);
  log_info("%s: saving %u job%s (checkpoint.on_stop) before stopping, within %llu ms", why,
           daemon->stop_saves, daemon->stop_saves == 1 ? "" : "s",
           (unsigned long long)timeout_ms);
  sd_notifyf(0, "STATUS=saving checkpoints before stopping\nEXTEND_TIMEOUT_USEC=%llu",
             (unsigned long long)timeout_ms * 1000);
  uv_timer_start(&daemon->stop_saves_timer, on_stop_saves_late, timeout_ms, 0);
}

int daemon_set_draining(void *data, bool draining, fsdp_status_t *st) {
  fsdp_daemon_t *daemon = data;
  if (daemon->state != FSDP_DAEMON_SERVING && daemon->state != FSDP_DAEMON_DRAINING)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION, "fsdpd is stopping");
  if (draining == (daemon->state == FSDP_DAEMON_DRAINING))
    return 0;
  daemon->state = draining ? FSDP_DAEMON_DRAINING : FSDP_DAEMON_SERVING;
  fsdp_rpc_server_set_draining(daemon->rpc, draining);
  fsdp_health_set_serving(&daemon->health, !draining);
  sd_notify(0, draining ? "STATUS=draining on request" : "STATUS=serving");
  log_info("%s", draining ? "draining on request: new work is refused" : "resumed serving");
  return 0;
}

fsdp_services_state_t daemon_serving_state(void *data) {
  const fsdp_daemon_t *daemon = data;
  switch (daemon->state) {
  case FSDP_DAEMON_SERVING:
    return FSDP_SERVICES_SERVING;
  case FSDP_DAEMON_DRAINING:
    return FSDP_SERVICES_DRAINING;
  case FSDP_DAEMON_STARTING:
  case FSDP_DAEMON_STOPPING:
  case FSDP_DAEMON_STOPPED:
    break;
  }
  return FSDP_SERVICES_STOPPING;
}
