/* Daemon lifecycle: start, serve, reload, drain, stop. */
#include "daemon/daemon.h"

#include <errno.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include <fsdp/fsdp_version.h>

#include "common/log.h"
#include "cuda/loader.h"
#include "daemon/services/fastpath.h"
#include "daemon/services/services.h"

/* Calls the TCP health endpoint holds at once. */
#define HEALTH_MAX_INFLIGHT 64
/* The peer port answers the other daemons: a Join, a Heartbeat and a Leave each at most. */
#define PEER_MAX_INFLIGHT 256
/* Client resets one health port connection may send within the relay's window: a probe
 * resets a stream only when its deadline passes. */
#define HEALTH_MAX_RESETS 64
/* Resets a peer port connection may send before a call on it carried the token: a peer's
 * first call does, long before a deadline of it could pass, and a probe without the token
 * is refused at once, so only a flood resets streams there. */
#define PEER_MAX_RESETS_UNTRUSTED 8
/* Connections the plaintext peer port holds at once: each other host's channel, and one it
 * left behind when it restarted until that one is found closed, plus probes. */
#define PEER_CONNECTIONS_PER_HOST 2
#define PEER_CONNECTIONS_EXTRA 16

/* The loop's clock in milliseconds (monotonic), as sessions and deadlines use it. */
static uint64_t now_ms(fsdp_daemon_t *daemon) {
  uv_update_time(&daemon->loop);
  return uv_now(&daemon->loop);
}

static void set_log_level(const fsdp_config_t *cfg) {
  fsdp_log_level_t level = (fsdp_log_level_t)fsdp_config_number(cfg, FSDP_OPTION_LOG_LEVEL);
  fsdp_log_set_level(level);
  fsdp_rpc_route_log(level);
}

/* Values that take effect without a restart; called at start and after a reload. */
static void apply_config(fsdp_daemon_t *daemon) {
  const fsdp_config_t *cfg = &daemon->config;
  set_log_level(cfg);
  daemon->store.max_jobs = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_SESSIONS);
  daemon->store.memory_limit = (size_t)fsdp_config_number(cfg, FSDP_OPTION_MEMORY_LIMIT);
  daemon->store.arena_capacity = (size_t)fsdp_config_number(cfg, FSDP_OPTION_JOB_MEMORY);
  daemon->store.max_inflight = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_INFLIGHT);
  fsdp_checkpoints_configure(
      &daemon->checkpoints, fsdp_config_text(cfg, FSDP_OPTION_CHECKPOINT_DIR),
      (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_CHECKPOINT_EVERY_STEPS),
      (unsigned)fsdp_config_number(cfg, FSDP_OPTION_CHECKPOINT_KEEP),
      (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_CHECKPOINT_WRITE_RATE),
      (unsigned)fsdp_config_number(cfg, FSDP_OPTION_CHECKPOINT_DISK_SHARE),
      fsdp_config_number(cfg, FSDP_OPTION_CHECKPOINT_RESUME) == 1 /* latest */);
  if (daemon->local_endpoint)
    fsdp_rpc_endpoint_set_max_inflight(
        daemon->local_endpoint, (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_INFLIGHT_CALLS));
  daemon->listener.local.acceptor.limit = daemon->channel.acceptor.limit =
      (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_CONNECTIONS_PER_UID);
  daemon->listener.tcp[FSDP_LISTENER_HEALTH].acceptor.limit =
      (unsigned)fsdp_config_number(cfg, FSDP_OPTION_HEALTH_MAX_CONNECTIONS);
  if (daemon->peers)
    fsdp_peers_set_timing(daemon->peers,
                          (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_PEER_HEARTBEAT_INTERVAL),
                          (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_PEER_TIMEOUT));
  if (daemon->state != FSDP_DAEMON_STOPPING && daemon->state != FSDP_DAEMON_STOPPED)
    fsdp_dataplane_set_cluster(
        &daemon->dataplane, daemon->peers, daemon->fabric,
        (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_COLLECTIVE_TIMEOUT));
  uint64_t period = (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_HOUSEKEEPING_INTERVAL);
  /* systemd wants a ping at least every WatchdogSec; twice as often leaves slack. */
  if (daemon->watchdog_usec && daemon->watchdog_usec / 2000 < period)
    period = daemon->watchdog_usec / 2000 ? daemon->watchdog_usec / 2000 : 1;
  uv_timer_set_repeat(&daemon->housekeeping, period);
  if (uv_is_active((uv_handle_t *)&daemon->housekeeping))
    uv_timer_again(&daemon->housekeeping);
}

/* daemon.operator_group as a gid: a group's name, or a number (a gid need not have a name).
 * Looked up at start and on reload only: the lookup may ask a directory service. */
static int resolve_operator_group(const fsdp_config_t *cfg, bool *ret_has, gid_t *ret_gid,
                                  fsdp_status_t *st) {
  const char *name = fsdp_config_text(cfg, FSDP_OPTION_OPERATOR_GROUP);
  if (!name[0]) {
    *ret_has = false;
    return 0;
  }
  char *end;
  errno = 0;
  unsigned long gid = strtoul(name, &end, 10);
  if (!*end && name[0] >= '0' && name[0] <= '9' && errno == 0 && gid < (gid_t)-1) {
    *ret_has = true;
    *ret_gid = (gid_t)gid;
    return 0;
  }
  struct group grp, *found = NULL;
  char *buf = NULL;
  int r = ERANGE;
  for (size_t size = 4096; r == ERANGE && size <= (1u << 20); size *= 2) {
    char *grown = realloc(buf, size);
    if (!grown) {
      r = ENOMEM;
      break;
    }
    buf = grown;
    r = getgrnam_r(name, &grp, buf, size, &found);
  }
  if (found)
    *ret_gid = grp.gr_gid;
  free(buf);
  if (!found)
    return fsdp_status_set(st, FSDP_E_CONFIG,
                           "key 'daemon.operator_group': value '%s' is no group on this host%s%s",
                           name, r ? ": " : "", r ? strerror(r) : "");
  *ret_has = true;
  return 0;
}

/* The handlers' lifecycle actions (daemon/services/context.h says what each does). */

static bool is_operator(void *data, int fd, const fsdp_credentials_t *cred) {
  const fsdp_daemon_t *daemon = data;
  return cred->uid == 0 || cred->uid == geteuid() ||
         (daemon->has_operator_group && fsdp_credentials_in_group(fd, cred, daemon->operator_gid));
}

static void log_session_end(const fsdp_session_t *s, const char *why) {
  log_info("session %016llx (job '%s' local rank %u, pid %d) ended: %s",
           (unsigned long long)s->id, s->job, s->local_rank, (int)s->pid, why);
}

/* Whether a session other than `except` (NULL: any) belongs to the job. */
static bool job_has_session(const fsdp_daemon_t *daemon, const fsdp_job_t *job,
                            const fsdp_session_t *except) {
  for (const fsdp_session_t *s = daemon->sessions.head; s; s = s->next)
    if (s != except && strcmp(s->job, job->name) == 0)
      return true;
  return false;
}

/* What a session leaves behind when it ends, however it ends. */
static void release_session(fsdp_daemon_t *daemon, fsdp_session_t *session,
                            const char *why) {
  if (session->channel)
    fsdp_channel_conn_close(session->channel);
  fsdp_job_t *job = fsdp_store_find_job(&daemon->store, session->job);
  if (job)
    fsdp_dataplane_release_session(job, session->local_rank, session->id, why,
                                   daemon->sessions.attaches);
  fsdp_fastpath_close(session->fast_path); /* its operations ended just now */
  if (!job)
    return;
  /* Its retention counts from its last session's end, and the job idle longest is the
   * first to give way to a new one (fsdp_store_job_for). */
  if (!job_has_session(daemon, job, session))
    fsdp_store_job_went_idle(&daemon->store, job, now_ms(daemon));
}

static void end_session(void *data, fsdp_session_t *session, const char *why) {
  fsdp_daemon_t *daemon = data;
  log_session_end(session, why);
  release_session(daemon, session, why);
  fsdp_sessions_end(&daemon->sessions, session);
}

static void on_session_expired(fsdp_session_t *s, void *data) {
  fsdp_daemon_t *daemon = data;
  char why[96];
  snprintf(why, sizeof why, "no call for %llu ms (session.lease)",
           (unsigned long long)(uv_now(&daemon->loop) - s->last_call_ms));
  log_session_end(s, why);
  release_session(daemon, s, why);
}

static bool job_idle(void *data, const fsdp_job_t *job) {
  fsdp_daemon_t *daemon = data;
  return !job_has_session(daemon, job, NULL) &&
         !fsdp_dataplane_uses_job(&daemon->dataplane, job) &&
         !fsdp_checkpoints_uses_job(&daemon->checkpoints, job);
}

/* Frees an idle job: its units and its arenas go back to the host. */
static void free_job(void *data, fsdp_job_t *job, const char *why) {
  fsdp_daemon_t *daemon = data;
  log_info("job '%s': %s; freeing its %u unit%s and memory", job->name, why, job->n_units,
           job->n_units == 1 ? "" : "s");
  fsdp_dataplane_forget_job(&daemon->dataplane, job);
  fsdp_store_remove_job(&daemon->store, job);
}

/* A job's units and memory wait store.job_retention after its last session for a trainer to
 * come back (unless a new job needs the room first: fsdp_store_job_for); then the memory
 * goes back to the host. */
static void retire_idle_jobs(fsdp_daemon_t *daemon, uint64_t now_ms) {
  uint64_t retention = (uint64_t)fsdp_config_number(&daemon->config, FSDP_OPTION_JOB_RETENTION);
  for (fsdp_job_t *job = daemon->store.jobs, *next; job; job = next) {
    next = job->next;
    if (!job_idle(daemon, job)) {
      job->idle_since_ms = 0;
      continue;
    }
    if (job->idle_since_ms == 0) {
      fsdp_store_job_went_idle(&daemon->store, job, now_ms);
      continue;
    }
    if (now_ms - job->idle_since_ms < retention)
      continue;
    char why[64];
    snprintf(why, sizeof why, "no session for %llu ms (store.job_retention)",
             (unsigned long long)(now_ms - job->idle_since_ms));
    free_job(daemon, job, why);
  }
}

static void on_housekeeping(uv_timer_t *timer) {
  fsdp_daemon_t *daemon = timer->data;
  if (daemon->watchdog_usec)
    sd_notify(0, "WATCHDOG=1");
  fsdp_sessions_expire(&daemon->sessions, uv_now(&daemon->loop),
                       (uint64_t)fsdp_config_number(&daemon->config, FSDP_OPTION_SESSION_LEASE),
                       on_session_expired, daemon);
  fsdp_channel_expire(&daemon->channel, uv_now(&daemon->loop));
  fsdp_dataplane_expire(&daemon->store, uv_now(&daemon->loop));
  fsdp_checkpoints_expire(&daemon->checkpoints, uv_now(&daemon->loop));
  retire_idle_jobs(daemon, uv_now(&daemon->loop));
}

/* Re-reads the config with the original precedence. All or nothing: on any error, or if a
 * value that cannot change at run time differs, the running config stays and st says why. */
static int reload(void *data, fsdp_option_id_t *ret_changed, size_t *ret_n, fsdp_status_t *st) {
  fsdp_daemon_t *daemon = data;
  fsdp_config_t next;
  int r = fsdp_args_build_config(daemon->args, daemon->envp, &next, st);
  if (r < 0) {
    fsdp_config_cleanup(&next);
    return r;
  }
  bool has_operator_group;
  gid_t operator_gid;
  if ((r = resolve_operator_group(&next, &has_operator_group, &operator_gid, st)) < 0) {
    fsdp_config_cleanup(&next);
    return r;
  }
  fsdp_config_keep_derived(&next, &daemon->config);
  fsdp_option_id_t changed[FSDP_OPTION_COUNT];
  size_t n = fsdp_config_diff(&daemon->config, &next, changed);
  for (size_t i = 0; i < n; i++) {
    const fsdp_option_t *opt = fsdp_option_get(changed[i]);
    if (opt->reloadable)
      continue;
    char running[128], wanted[128];
    fsdp_config_format(&daemon->config, changed[i], running, sizeof running);
    fsdp_config_format(&next, changed[i], wanted, sizeof wanted);
    fsdp_config_cleanup(&next);
    return fsdp_status_set(st, FSDP_E_CONFIG,
                           "key '%s' cannot change without a restart (running '%s', new '%s')",
                           opt->key, running, wanted);
  }
  fsdp_config_cleanup(&daemon->config);
  daemon->config = next;
  daemon->has_operator_group = has_operator_group;
  daemon->operator_gid = operator_gid;
  apply_config(daemon);
  memcpy(ret_changed, changed, n * sizeof changed[0]);
  *ret_n = n;
  return 0;
}

static void reload_from_signal(fsdp_daemon_t *daemon) {
  if (daemon->state == FSDP_DAEMON_STOPPING) {
    log_warning("SIGHUP while stopping: not reloading");
    return;
  }
  sd_notify(0, "RELOADING=1\nSTATUS=reloading the config");
  fsdp_option_id_t changed[FSDP_OPTION_COUNT];
  size_t n = 0;
  fsdp_status_t st;
  if (reload(daemon, changed, &n, &st) < 0) {
    log_error("reload failed, keeping the running config: %s", st.message);
  } else {
    log_info("config reloaded: %zu value%s changed", n, n == 1 ? "" : "s");
    for (size_t i = 0; i < n; i++)
      log_info("  %s", fsdp_option_get(changed[i])->key);
  }
  sd_notify(0, daemon->state == FSDP_DAEMON_DRAINING ? "READY=1\nSTATUS=draining on request"
                                                     : "READY=1\nSTATUS=serving");
}

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
  for (fsdp_session_t *s = daemon->sessions.head; s; s = s->next)
    fsdp_fastpath_close(s->fast_path);
  fsdp_sessions_cleanup(&daemon->sessions);
  fsdp_listener_close(&daemon->listener);
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
                                                    job_has_session(daemon, job, NULL),
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

/* With draining, health turns NOT_SERVING and new work is refused while the daemon keeps
 * running; without, it serves again. */
static int set_draining(void *data, bool draining, fsdp_status_t *st) {
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

static fsdp_services_state_t serving_state(void *data) {
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

static void on_signal(uv_signal_t *handle, int signum) {
  fsdp_daemon_t *daemon = handle->data;
  if (signum == SIGHUP)
    reload_from_signal(daemon);
  else
    fsdp_daemon_stop(daemon, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* "127.0.0.1:0" listened on port 41234 -> "127.0.0.1:41234". */
static void format_bound_address(char *buf, size_t size, const char *address, int port) {
  const char *colon = strrchr(address, ':');
  int host_len = colon ? (int)(colon - address) : (int)strlen(address);
  snprintf(buf, size, "%.*s:%d", host_len, address, port);
}

/* Client resets one peer port connection may send within the relay's window. A peer's
 * client resets a stream only when a call's deadline passes: it holds at most one Join and
 * one Heartbeat in flight, each with a deadline of peer.timeout, which no daemon sets below
 * the option's minimum (50 ms), and sends one Leave as it stops. So a peer resets at most
 * 2 * 10 s / 50 ms + 1 = 401 streams in 10 s, and with the default peer.timeout (5 s) 5. The
 * relay counts resets when it reads them, so a loop that stalled reads a backlog at once:
 * but a peer that hears nothing for peer.timeout counts this host lost and stops its
 * Heartbeats, and its Joins back off to one a second, so only a stall of minutes brings
 * this many into one read (and then the peer reconnects). A rapid-reset client sends
 * thousands a second. */
static unsigned peer_max_resets(void) {
  unsigned shortest_deadline_ms = (unsigned)fsdp_option_get(FSDP_OPTION_PEER_TIMEOUT)->min;
  return 2 * FSDP_RELAY_RESET_WINDOW_MS / shortest_deadline_ms + 1;
}

static unsigned peer_max_connections(const fsdp_config_t *cfg) {
  return PEER_CONNECTIONS_PER_HOST * fsdp_config_host_count(cfg) + PEER_CONNECTIONS_EXTRA;
}

/* The Peer service on its own TCP port, with the token and TLS of the peer.* keys; only
 * when there are peers. A plaintext port (token or peer.insecure) is accepted by the
 * listener and relayed, like the health port: a client without the token reaches gRPC all
 * the same, and could reset streams faster than gRPC 1.51 can stop. With mutual TLS gRPC
 * accepts the port itself: the handshake wants a client certificate before any HTTP/2
 * frame, so only a holder of one could try. */
static int create_peer_endpoint(fsdp_daemon_t *daemon, fsdp_status_t *st) {
  const fsdp_config_t *cfg = &daemon->config;
  if (fsdp_config_host_count(cfg) < 2)
    return 0;
  const fsdp_peer_security_t *sec = &daemon->peer_security;
  fsdp_rpc_endpoint_options_t options = {
      .max_inflight_calls = PEER_MAX_INFLIGHT,
      .limit_name = "the peer port's fixed limit",
      .max_streams = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_STREAMS),
      .streams_limit_name = "rpc.max_streams",
      .idle_ms = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_IDLE_TIMEOUT),
      .auth_token = sec->token,
      .auth_name = "peer.token_file",
      .tls_cert_pem = sec->tls_cert,
      .tls_key_pem = sec->tls_key,
      .tls_ca_pem = sec->tls_ca,
  };
  /* HEALTH and PEER are adjacent: probes can ask for fsdp.v1.Peer where it is served. */
  int r = fsdp_rpc_server_add_endpoint(daemon->rpc, "peer", &daemon->services[FSDP_SERVICE_HEALTH],
                                       2, &options, &daemon->peer_endpoint);
  if (r < 0)
    return fsdp_status_set(st, r == -EINVAL && sec->tls_cert ? FSDP_E_CONFIG : r,
                           "cannot set up the peer endpoint: %s%s", fsdp_strerror(r),
                           sec->tls_cert ? " (check peer.tls_cert, peer.tls_key, peer.tls_ca)"
                                         : "");
  char listen[320];
  const char *configured = fsdp_config_text(cfg, FSDP_OPTION_PEER_LISTEN);
  if (configured[0])
    snprintf(listen, sizeof listen, "%s", configured);
  else
    fsdp_config_host(cfg, (unsigned)fsdp_config_number(cfg, FSDP_OPTION_CLUSTER_HOST_RANK),
                     listen, sizeof listen);
  if (!sec->tls_cert) {
    fsdp_listener_tcp_options_t tcp = {
        .what = "peer",
        .endpoint = daemon->peer_endpoint,
        .max_connections = peer_max_connections(cfg),
        .limit_name = "the peer port's fixed limit",
        .max_streams = fsdp_rpc_endpoint_max_streams_per_connection(daemon->peer_endpoint),
        .max_resets = peer_max_resets(),
        .max_resets_untrusted = PEER_MAX_RESETS_UNTRUSTED,
    };
    if ((r = fsdp_listener_listen_tcp(&daemon->listener, FSDP_LISTENER_PEER, listen, &tcp,
                                      st)) < 0)
      return r;
    snprintf(daemon->peer_address, sizeof daemon->peer_address, "%s",
             daemon->listener.tcp[FSDP_LISTENER_PEER].address);
    return 0;
  }
  int port;
  if ((r = fsdp_rpc_endpoint_listen(daemon->peer_endpoint, listen, &port, st)) < 0)
    return r;
  format_bound_address(daemon->peer_address, sizeof daemon->peer_address, listen, port);
  return 0;
}

static int create_rpc(fsdp_daemon_t *daemon, fsdp_status_t *st) {
  const fsdp_config_t *cfg = &daemon->config;
  fsdp_rpc_server_options_t options = {
      .max_message_size = (size_t)fsdp_config_number(cfg, FSDP_OPTION_MAX_MESSAGE_SIZE),
  };
  unsigned max_streams = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_STREAMS);
  unsigned idle_ms = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_IDLE_TIMEOUT);
  fsdp_rpc_endpoint_options_t local_options = {
      .max_inflight_calls = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_INFLIGHT_CALLS),
      .limit_name = "rpc.max_inflight_calls",
      .max_streams = max_streams,
      .streams_limit_name = "rpc.max_streams",
      .idle_ms = idle_ms,
  };
  /* The TCP port answers anyone on the host: probes are short Checks and a few Watches. */
  fsdp_rpc_endpoint_options_t health_options = {
      .max_inflight_calls = HEALTH_MAX_INFLIGHT,
      .limit_name = "the health port's fixed limit",
      .max_streams = max_streams,
      .streams_limit_name = "rpc.max_streams",
      .idle_ms = idle_ms,
  };
  int r = fsdp_rpc_server_new(&daemon->loop, &options, &daemon->rpc);
  if (r < 0)
    return fsdp_status_set(st, r, "cannot create the RPC server: %s", fsdp_strerror(r));

  r = fsdp_rpc_server_add_endpoint(daemon->rpc, "local", daemon->services,
                                   FSDP_SERVICE_LOCAL_COUNT, &local_options,
                                   &daemon->local_endpoint);
  if (r < 0)
    return fsdp_status_set(st, r, "cannot set up the local endpoint: %s", fsdp_strerror(r));

  /* Serves no one: every call gets PERMISSION_DENIED saying why (fsdp_listener_refusal). */
  fsdp_rpc_endpoint_options_t refused_options = {
      .max_inflight_calls = HEALTH_MAX_INFLIGHT,
      .limit_name = "the refusal's fixed limit",
      .max_streams = 1,
      .streams_limit_name = "the refusal's fixed limit",
      .idle_ms = idle_ms,
      .refuse = fsdp_listener_refusal,
      .refuse_data = &daemon->listener,
  };
  r = fsdp_rpc_server_add_endpoint(daemon->rpc, "refused", NULL, 0, &refused_options,
                                   &daemon->refused_endpoint);
  if (r < 0)
    return fsdp_status_set(st, r, "cannot set up the refusal endpoint: %s", fsdp_strerror(r));

  const char *health_listen = fsdp_config_text(cfg, FSDP_OPTION_HEALTH_LISTEN);
  if (health_listen[0]) {
    r = fsdp_rpc_server_add_endpoint(daemon->rpc, "health",
                                     &daemon->services[FSDP_SERVICE_HEALTH], 1,
                                     &health_options,
                                     &daemon->health_endpoint);
    if (r < 0)
      return fsdp_status_set(st, r, "cannot set up the health endpoint: %s", fsdp_strerror(r));
    /* The listener accepts the port itself, as it does the unix socket. */
    fsdp_listener_tcp_options_t tcp = {
        .what = "health",
        .endpoint = daemon->health_endpoint,
        .max_connections = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_HEALTH_MAX_CONNECTIONS),
        .limit_name = "health.max_connections",
        .max_streams = fsdp_rpc_endpoint_max_streams_per_connection(daemon->health_endpoint),
        .max_resets = HEALTH_MAX_RESETS,
        .max_resets_untrusted = HEALTH_MAX_RESETS,
    };
    if ((r = fsdp_listener_listen_tcp(&daemon->listener, FSDP_LISTENER_HEALTH, health_listen,
                                      &tcp, st)) < 0)
      return r;
    snprintf(daemon->health_address, sizeof daemon->health_address, "%s",
             daemon->listener.tcp[FSDP_LISTENER_HEALTH].address);
  }
  return create_peer_endpoint(daemon, st);
}

static void start_handles(fsdp_daemon_t *daemon) {
  uv_signal_t *signals[] = {&daemon->sigterm, &daemon->sigint, &daemon->sighup};
  const int signums[] = {SIGTERM, SIGINT, SIGHUP};
  for (size_t i = 0; i < 3; i++) {
    uv_signal_init(&daemon->loop, signals[i]);
    signals[i]->data = daemon;
    uv_signal_start(signals[i], on_signal, signums[i]);
  }
  uv_timer_init(&daemon->loop, &daemon->housekeeping);
  daemon->housekeeping.data = daemon;
  uv_timer_init(&daemon->loop, &daemon->stop_saves_timer);
  daemon->stop_saves_timer.data = daemon;
  /* sd_watchdog_enabled() is 0 unless WATCHDOG_PID is ours; then pinging is required. */
  if (sd_watchdog_enabled(0, &daemon->watchdog_usec) <= 0)
    daemon->watchdog_usec = 0;
  apply_config(daemon);
  uv_timer_start(&daemon->housekeeping, on_housekeeping, 0,
                 uv_timer_get_repeat(&daemon->housekeeping));
}

/* Descriptors the limits allow the daemon to hold: each session's connection, memory channel
 * and job arenas; one uid's connections on the unix socket, the health port's and the peer
 * port's; pending memory channels; and a margin for peers, UCX, gRPC and logs. */
static uint64_t descriptors_needed(const fsdp_config_t *cfg) {
  return 3 * (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_MAX_SESSIONS) +
         (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_MAX_CONNECTIONS_PER_UID) +
         (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_HEALTH_MAX_CONNECTIONS) +
         peer_max_connections(cfg) + FSDP_CHANNEL_MAX_PENDING + 256;
}

/* The soft descriptor limit (1024 by default) is too low for session.max_sessions trainers
 * and the connection limits: raise it to the hard limit, and say so if even that is short.
 * The unix socket's limit is per uid: the estimate holds one uid's, as the socket's group is
 * the trainers' launcher and its operators, not a crowd. */
static void raise_descriptor_limit(const fsdp_config_t *cfg) {
  struct rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) < 0)
    return;
  if (nofile.rlim_cur < nofile.rlim_max) {
    rlim_t was = nofile.rlim_cur;
    nofile.rlim_cur = nofile.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &nofile) < 0)
      nofile.rlim_cur = was;
  }
  uint64_t need = descriptors_needed(cfg);
  if (nofile.rlim_cur != RLIM_INFINITY && nofile.rlim_cur < need)
    log_warning("the descriptor limit is %llu (hard limit %llu) but the configured limits need "
                "about %llu (3 per session.max_sessions, one uid's "
                "rpc.max_connections_per_uid, health.max_connections, the peer port's and the "
                "memory channel's pending connections, and a margin): raise LimitNOFILE or "
                "lower them, or trainers and probes will be refused when it runs out",
                (unsigned long long)nofile.rlim_cur, (unsigned long long)nofile.rlim_max,
                (unsigned long long)need);
  else
    log_debug("descriptor limit %llu, the configured limits need about %llu",
              (unsigned long long)nofile.rlim_cur, (unsigned long long)need);
}

/* backend = cuda: the configured GPU runs the data plane and holds the jobs' memory, or the
 * exit says why it cannot. */
static int use_cuda_backend(fsdp_daemon_t *daemon, fsdp_status_t *st) {
  const fsdp_cuda_module_t *module;
  fsdp_cuda_device_t devices[FSDP_CUDA_DEVICES_MAX];
  unsigned n = 0;
  int ordinal = (int)fsdp_config_number(&daemon->config, FSDP_OPTION_CUDA_DEVICE);
  if (fsdp_cuda_load(&module, st) < 0 ||
      fsdp_cuda_usable_devices(module, devices, FSDP_CUDA_DEVICES_MAX, &n, st) < 0)
    return fsdp_status_set(st, FSDP_E_CONFIG, "key 'daemon.backend': value 'cuda': %s; use "
                           "'host'", st->message);
  for (unsigned i = 0; i < n; i++) {
    if (devices[i].ordinal != ordinal)
      continue;
    if (fsdp_dataplane_use_cuda(&daemon->dataplane, module, &devices[i], st) < 0)
      return fsdp_status_set(st, FSDP_E_CONFIG, "key 'daemon.backend': value 'cuda': %s",
                             st->message);
    char versions[96];
    module->versions(versions, sizeof versions);
    log_info("backend cuda on %s (%s)", daemon->dataplane.backend.device_name, versions);
    return 0;
  }
  char first[320];
  fsdp_cuda_device_format(&devices[0], first, sizeof first);
  return fsdp_status_set(st, FSDP_E_CONFIG,
                         "key 'daemon.cuda_device': value %d is not a usable GPU: %u found, %s "
                         "first",
                         ordinal, n, first);
}

/* Takes the config (the caller's copy left zeroed); sets the log level and descriptor limit. */
static void adopt_config(fsdp_daemon_t *daemon, const fsdp_args_t *args, char *const *envp,
                         fsdp_config_t *config) {
  memset(daemon, 0, sizeof *daemon);
  daemon->args = args;
  daemon->envp = envp;
  daemon->config = *config;
  memset(config, 0, sizeof *config);
  daemon->listener.lock_fd = daemon->listener.socket_fd = -1;
  set_log_level(&daemon->config);
  raise_descriptor_limit(&daemon->config);
}

/* Health, the sessions, the store and the data plane under it, on the configured backend. */
static int init_store(fsdp_daemon_t *daemon, fsdp_status_t *st) {
  fsdp_health_init(&daemon->health);
  fsdp_sessions_init(&daemon->sessions);
  fsdp_store_init(&daemon->store);
  daemon->store.hooks = (fsdp_store_hooks_t){.job_idle = job_idle, .free_job = free_job,
                                             .data = daemon};
  fsdp_dataplane_hook_units(&daemon->store.hooks);
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int r = fsdp_dataplane_init(&daemon->dataplane, &daemon->loop,
                              cpus > 0 && cpus < 64 ? (unsigned)cpus : 64, st);
  if (r < 0)
    return r;
  fsdp_checkpoints_init(&daemon->checkpoints, &daemon->dataplane);
  daemon->store.backend = &daemon->dataplane.backend;
  if (daemon->dataplane.backend.stages_rings)
    log_info("backend host stages the rings among hosts as a GPU's does (failpoint stage-rings)");
  if (fsdp_config_number(&daemon->config, FSDP_OPTION_BACKEND) != 0)
    return use_cuda_backend(daemon, st);
  return 0;
}

/* What the RPC handlers work on, and the service tables that route to them. */
static void init_services(fsdp_daemon_t *daemon) {
  daemon->handlers = (fsdp_services_context_t){
      .loop = &daemon->loop,
      .started_ms = daemon->started_ms,
      .config = &daemon->config,
      .listener = &daemon->listener,
      .sessions = &daemon->sessions,
      .store = &daemon->store,
      .dataplane = &daemon->dataplane,
      .checkpoints = &daemon->checkpoints,
      .services = daemon->services,
      .health_address = daemon->health_address,
      .peer_address = daemon->peer_address,
      .lifecycle = {.reload = reload, .set_draining = set_draining, .end_session = end_session,
                    .is_operator = is_operator, .state = serving_state, .data = daemon},
  };
  fsdp_services_tables(&daemon->handlers, &daemon->health.service, daemon->services);
}

/* The other hosts: the peer table and its secrets, the store's topology, the fabric. */
static int create_cluster(fsdp_daemon_t *daemon, fsdp_status_t *st) {
  int r;
  if ((r = fsdp_peer_security_load(&daemon->config, &daemon->peer_security, st)) < 0 ||
      (r = fsdp_peers_new(&daemon->loop, &daemon->config, &daemon->peer_security, NULL,
                          &daemon->peers, st)) < 0)
    return r;
  daemon->handlers.peers = daemon->peers;
  daemon->store.topology = (fsdp_topology_t){
      .hosts = fsdp_peers_host_count(daemon->peers),
      .host_rank = fsdp_peers_host_rank(daemon->peers),
      .shard_group_hosts =
          (unsigned)fsdp_config_number(&daemon->config, FSDP_OPTION_CLUSTER_SHARD_GROUP_HOSTS),
  };
  daemon->store.local_world_size =
      (uint32_t)fsdp_config_number(&daemon->config, FSDP_OPTION_CLUSTER_LOCAL_WORLD_SIZE);
  return fsdp_fabric_new(&daemon->loop, daemon->peers, &daemon->fabric, st);
}

/* The RPC server and endpoints, the open listener accepting onto them, the memory channel. */
static int start_rpc(fsdp_daemon_t *daemon, fsdp_status_t *st) {
  int r;
  if ((r = create_rpc(daemon, st)) < 0)
    return r;
  daemon->handlers.rpc = daemon->rpc;
  /* Nothing is accepted before the loop runs, so the listener may start before the server. */
  if ((r = fsdp_listener_start(&daemon->listener, &daemon->loop, daemon->local_endpoint,
                                daemon->refused_endpoint)) < 0)
    return fsdp_status_set(st, r, "cannot accept on %s: %s", daemon->listener.socket_path,
                           uv_strerror(r));
  fsdp_channel_callbacks_t callbacks;
  fsdp_services_channel_callbacks(&daemon->handlers, &callbacks);
  if ((r = fsdp_channel_start(&daemon->channel, &daemon->loop, daemon->listener.channel_fd,
                              &callbacks)) < 0)
    return fsdp_status_set(st, r, "cannot accept on %s: %s", daemon->listener.channel_path,
                           uv_strerror(r));
  if ((r = fsdp_rpc_server_start(daemon->rpc)) < 0)
    return fsdp_status_set(st, r, "cannot start the RPC server: %s", fsdp_strerror(r));
  return 0;
}

/* Health SERVING, the log line, and READY=1 to systemd. */
static void announce_serving(fsdp_daemon_t *daemon) {
  daemon->state = FSDP_DAEMON_SERVING;
  fsdp_health_set_serving(&daemon->health, true);
  log_info("fsdpd %s serving on unix:%s%s%s%s%s (backend %s, protocol %u, host %u of %u)",
           FSDP_VERSION_STRING, daemon->listener.socket_path,
           daemon->health_endpoint ? ", health on " : "", daemon->health_address,
           daemon->peer_endpoint ? ", peers on " : "", daemon->peer_address,
           fsdp_backend_name(&daemon->dataplane.backend), FSDP_PROTOCOL_VERSION,
           fsdp_peers_host_rank(daemon->peers), fsdp_peers_host_count(daemon->peers));
  sd_notifyf(0, "READY=1\nSTATUS=serving on unix:%s\nMAINPID=%ld", daemon->listener.socket_path,
             (long)getpid());
}

int fsdp_daemon_start(fsdp_daemon_t *daemon, const fsdp_args_t *args, char *const *envp,
                      fsdp_config_t *config, fsdp_status_t *st) {
  adopt_config(daemon, args, envp, config);
  int r;
  if ((r = resolve_operator_group(&daemon->config, &daemon->has_operator_group,
                                  &daemon->operator_gid, st)) < 0)
    goto fail_config;
  if ((r = uv_loop_init(&daemon->loop)) < 0) {
    fsdp_status_set(st, r, "cannot create the event loop: %s", uv_strerror(r));
    goto fail_config;
  }
  daemon->started_ms = uv_now(&daemon->loop);
  if ((r = init_store(daemon, st)) < 0)
    goto fail_loop;
  init_services(daemon);
  if ((r = create_cluster(daemon, st)) < 0)
    goto fail_loop;
  if ((r = fsdp_listener_open(&daemon->listener,
                              fsdp_config_text(&daemon->config, FSDP_OPTION_RUN_DIR), st)) < 0)
    goto fail_loop;
  if ((r = start_rpc(daemon, st)) < 0)
    goto fail_rpc;
  start_handles(daemon);
  if ((r = fsdp_peers_start(daemon->peers)) < 0)
    log_error("cannot start joining the peers: %s; they will count this host lost",
              fsdp_strerror(r));
  announce_serving(daemon);
  return 0;

fail_rpc:
  fsdp_rpc_server_free(daemon->rpc);
  daemon->rpc = NULL;
  fsdp_listener_close(&daemon->listener);
fail_loop:
  if (daemon->fabric)
    fsdp_fabric_close(daemon->fabric, NULL, NULL);
  daemon->fabric = NULL;
  fsdp_peers_free(daemon->peers);
  daemon->peers = NULL;
  fsdp_peer_security_cleanup(&daemon->peer_security);
  fsdp_checkpoints_cleanup(&daemon->checkpoints);
  fsdp_dataplane_cleanup(&daemon->dataplane);
  uv_run(&daemon->loop, UV_RUN_DEFAULT); /* lets closed handles finish */
  uv_loop_close(&daemon->loop);
fail_config:
  fsdp_config_cleanup(&daemon->config);
  return r;
}

int fsdp_daemon_run(fsdp_daemon_t *daemon) {
  uv_run(&daemon->loop, UV_RUN_DEFAULT);
  /* Only now is no work in flight on the units and their arenas. */
  fsdp_checkpoints_cleanup(&daemon->checkpoints);
  fsdp_dataplane_cleanup(&daemon->dataplane);
  fsdp_store_cleanup(&daemon->store);
  int r = uv_loop_close(&daemon->loop);
  if (r < 0)
    log_warning("event loop closed with handles still open: %s", uv_strerror(r));
  fsdp_config_cleanup(&daemon->config);
  return 0;
}
