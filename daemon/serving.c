/* What the running daemon does besides answering calls: the configuration applied and
 * reloaded, its signals, the ends of sessions and jobs, and the housekeeping timer that
 * expires what waited too long and frees what nothing refers to. */
#include "daemon/internal.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "common/log.h"
#include "daemon/services/fastpath.h"
#include "daemon/services/operator_service.h"
#include "daemon/services/trainer_events.h"

/* The loop's clock in milliseconds (monotonic), as sessions and deadlines use it. */
static uint64_t now_ms(fsdp_daemon_t *daemon) {
  uv_update_time(&daemon->loop);
  return uv_now(&daemon->loop);
}

void daemon_set_log_level(const fsdp_config_t *cfg) {
  fsdp_log_level_t level = (fsdp_log_level_t)fsdp_config_number(cfg, FSDP_OPTION_LOG_LEVEL);
  fsdp_log_set_level(level);
  fsdp_rpc_route_log(level);
}

void daemon_apply_config(fsdp_daemon_t *daemon) {
  const fsdp_config_t *cfg = &daemon->config;
  daemon_set_log_level(cfg);
  daemon->store.max_jobs = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_SESSIONS);
  daemon->store.memory_limit = (size_t)fsdp_config_number(cfg, FSDP_OPTION_MEMORY_LIMIT);
  daemon->store.arena_capacity = (size_t)fsdp_config_number(cfg, FSDP_OPTION_JOB_MEMORY);
  daemon->store.max_inflight = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_INFLIGHT);
  daemon->dataplane.trace_ops = (uint32_t)fsdp_config_number(cfg, FSDP_OPTION_TRACE_OPS);
  fsdp_checkpoints_configure(
      &daemon->checkpoints, fsdp_config_text(cfg, FSDP_OPTION_CHECKPOINT_DIR),
      (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_CHECKPOINT_EVERY_STEPS),
      (unsigned)fsdp_config_number(cfg, FSDP_OPTION_CHECKPOINT_KEEP),
      (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_CHECKPOINT_WRITE_RATE),
      (unsigned)fsdp_config_number(cfg, FSDP_OPTION_CHECKPOINT_DISK_SHARE),
      fsdp_config_number(cfg, FSDP_OPTION_CHECKPOINT_RESUME) == 1 /* latest */);
  fsdp_checkpoints_configure_recovery(
      &daemon->checkpoints, fsdp_config_number(cfg, FSDP_OPTION_RECOVER_FROM_REPLICAS) != 0);
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

int daemon_resolve_operator_group(const fsdp_config_t *cfg, bool *ret_has, gid_t *ret_gid,
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

bool daemon_is_operator(void *data, int fd, const fsdp_credentials_t *cred) {
  const fsdp_daemon_t *daemon = data;
  return cred->uid == 0 || cred->uid == geteuid() ||
         (daemon->has_operator_group && fsdp_credentials_in_group(fd, cred, daemon->operator_gid));
}

static void log_session_end(const fsdp_session_t *s, const char *why) {
  char rank[16];
  snprintf(rank, sizeof rank, "%u", s->local_rank);
  const fsdp_log_field_t fields[] = {{"JOB", s->job}, {"RANK", rank}};
  fsdp_log_fields(FSDP_LOG_INFO, fields, 2, "session %016llx (job '%s' local rank %u, pid %d) "
                  "ended: %s", (unsigned long long)s->id, s->job, s->local_rank, (int)s->pid, why);
}

bool daemon_job_has_session(const fsdp_daemon_t *daemon, const fsdp_job_t *job,
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
  fsdp_trainer_events_close(session->cuda_events);
  session->cuda_events = NULL;
  if (!job)
    return;
  /* Its retention counts from its last session's end, and the job idle longest is the
   * first to give way to a new one (fsdp_store_job_for). */
  if (!daemon_job_has_session(daemon, job, session))
    fsdp_store_job_went_idle(&daemon->store, job, now_ms(daemon));
}

void daemon_end_session(void *data, fsdp_session_t *session, const char *why) {
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

bool daemon_job_idle(void *data, const fsdp_job_t *job) {
  fsdp_daemon_t *daemon = data;
  return !daemon_job_has_session(daemon, job, NULL) &&
         !fsdp_dataplane_uses_job(&daemon->dataplane, job) &&
         !fsdp_checkpoints_uses_job(&daemon->checkpoints, job);
}

void daemon_free_job(void *data, fsdp_job_t *job, const char *why) {
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
    if (!daemon_job_idle(daemon, job)) {
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
    daemon_free_job(daemon, job, why);
  }
}

/* A collective of the job timed out: its flight record goes beside the daemon's socket, in
 * the run directory, and what its ranks hear names the file. */
static void keep_record(void *data, const fsdp_job_t *job, char *note, size_t size) {
  fsdp_daemon_t *daemon = data;
  const char *dir = daemon->listener.run_dir;
  char path[sizeof daemon->listener.run_dir + 128];
  fsdp_status_t st = FSDP_STATUS_INIT;
  int dir_fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  int r = dir_fd < 0 ? fsdp_status_set(&st, -errno, "%s: %s", dir, strerror(errno))
                     : fsdp_operator_write_record(job, dir_fd, dir, path, sizeof path, &st);
  if (dir_fd >= 0)
    close(dir_fd);
  if (r < 0) {
    log_warning("job '%s': its flight record at the timeout was not kept: %s", job->name,
                st.message);
    return;
  }
  log_warning("job '%s': its flight record at the timeout is %s (fsdpctl record %s --out "
              "FILE)", job->name, path, path);
  snprintf(note, size, "; the job's flight record: %s", path);
}

void daemon_on_housekeeping(uv_timer_t *timer) {
  fsdp_daemon_t *daemon = timer->data;
  if (daemon->watchdog_usec)
    sd_notify(0, "WATCHDOG=1");
  fsdp_sessions_expire(&daemon->sessions, uv_now(&daemon->loop),
                       (uint64_t)fsdp_config_number(&daemon->config, FSDP_OPTION_SESSION_LEASE),
                       on_session_expired, daemon);
  fsdp_channel_expire(&daemon->channel, uv_now(&daemon->loop));
  fsdp_dataplane_expire(&daemon->store, uv_now(&daemon->loop), keep_record, daemon);
  fsdp_dataplane_check_stalls(
      &daemon->store, uv_now(&daemon->loop),
      (uint64_t)fsdp_config_number(&daemon->config, FSDP_OPTION_HEALTH_STALL_AFTER));
  fsdp_health_refresh(&daemon->health);
  fsdp_checkpoints_expire(&daemon->checkpoints, uv_now(&daemon->loop));
  retire_idle_jobs(daemon, uv_now(&daemon->loop));
}

int daemon_reload(void *data, fsdp_option_id_t *ret_changed, size_t *ret_n, fsdp_status_t *st) {
  fsdp_daemon_t *daemon = data;
  fsdp_config_t next;
  int r = fsdp_args_build_config(daemon->args, daemon->envp, &next, st);
  if (r < 0) {
    fsdp_config_cleanup(&next);
    return r;
  }
  bool has_operator_group;
  gid_t operator_gid;
  if ((r = daemon_resolve_operator_group(&next, &has_operator_group, &operator_gid, st)) < 0) {
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
  daemon_apply_config(daemon);
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
  if (daemon_reload(daemon, changed, &n, &st) < 0) {
    log_error("reload failed, keeping the running config: %s", st.message);
  } else {
    log_info("config reloaded: %zu value%s changed", n, n == 1 ? "" : "s");
    for (size_t i = 0; i < n; i++)
      log_info("  %s", fsdp_option_get(changed[i])->key);
  }
  sd_notify(0, daemon->state == FSDP_DAEMON_DRAINING ? "READY=1\nSTATUS=draining on request"
                                                     : "READY=1\nSTATUS=serving");
}

void daemon_on_signal(uv_signal_t *handle, int signum) {
  fsdp_daemon_t *daemon = handle->data;
  if (signum == SIGHUP)
    reload_from_signal(daemon);
  else
    fsdp_daemon_stop(daemon, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}
