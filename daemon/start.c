/* The daemon's start, step by step in the order the parts depend on each other, each step
 * undone if a later one fails; and its run. */
#include "daemon/internal.h"

#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include <fsdp/fsdp_version.h>

#include "common/log.h"
#include "cuda/loader.h"
#include "daemon/services/services.h"

static void start_handles(fsdp_daemon_t *daemon) {
  uv_signal_t *signals[] = {&daemon->sigterm, &daemon->sigint, &daemon->sighup};
  const int signums[] = {SIGTERM, SIGINT, SIGHUP};
  for (size_t i = 0; i < 3; i++) {
    uv_signal_init(&daemon->loop, signals[i]);
    signals[i]->data = daemon;
    uv_signal_start(signals[i], daemon_on_signal, signums[i]);
  }
  uv_timer_init(&daemon->loop, &daemon->housekeeping);
  daemon->housekeeping.data = daemon;
  uv_timer_init(&daemon->loop, &daemon->stop_saves_timer);
  daemon->stop_saves_timer.data = daemon;
  /* sd_watchdog_enabled() is 0 unless WATCHDOG_PID is ours; then pinging is required. */
  if (sd_watchdog_enabled(0, &daemon->watchdog_usec) <= 0)
    daemon->watchdog_usec = 0;
  daemon_apply_config(daemon);
  uv_timer_start(&daemon->housekeeping, daemon_on_housekeeping, 0,
                 uv_timer_get_repeat(&daemon->housekeeping));
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
  daemon_set_log_level(&daemon->config);
  daemon_raise_descriptor_limit(&daemon->config);
}

/* A job's state for its health service: whether the last check found it stalled. */
static fsdp_health_job_state_t job_state(void *data, const char *name) {
  const fsdp_daemon_t *daemon = data;
  const fsdp_job_t *job = fsdp_store_find_job(&daemon->store, name);
  if (!job)
    return FSDP_HEALTH_JOB_UNKNOWN;
  return job->flight->stalled ? FSDP_HEALTH_JOB_STALLED : FSDP_HEALTH_JOB_GOING;
}

/* Health, the sessions, the store and the data plane under it, on the configured backend. */
static int init_store(fsdp_daemon_t *daemon, fsdp_status_t *st) {
  fsdp_health_init(&daemon->health);
  daemon->health.job_state = job_state;
  daemon->health.job_data = daemon;
  fsdp_sessions_init(&daemon->sessions);
  fsdp_store_init(&daemon->store);
  daemon->store.hooks = (fsdp_store_hooks_t){.job_idle = daemon_job_idle,
                                             .free_job = daemon_free_job,
                                             .data = daemon};
  fsdp_dataplane_hook_store(&daemon->store.hooks);
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
      .metrics_address = daemon->metrics_address,
      .lifecycle = {.reload = daemon_reload,
                    .set_draining = daemon_set_draining,
                    .end_session = daemon_end_session,
                    .is_operator = daemon_is_operator,
                    .state = daemon_serving_state,
                    .data = daemon},
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
  if ((r = daemon_create_rpc(daemon, st)) < 0)
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
  log_info("fsdpd %s serving on unix:%s%s%s%s%s%s%s (backend %s, protocol %u, host %u of %u)",
           FSDP_VERSION_STRING, daemon->listener.socket_path,
           daemon->health_endpoint ? ", health on " : "", daemon->health_address,
           daemon->peer_endpoint ? ", peers on " : "", daemon->peer_address,
           daemon->metrics ? ", metrics on http://" : "", daemon->metrics_address,
           fsdp_backend_name(&daemon->dataplane.backend), FSDP_PROTOCOL_VERSION,
           fsdp_peers_host_rank(daemon->peers), fsdp_peers_host_count(daemon->peers));
  sd_notifyf(0, "READY=1\nSTATUS=serving on unix:%s\nMAINPID=%ld", daemon->listener.socket_path,
             (long)getpid());
}

int fsdp_daemon_start(fsdp_daemon_t *daemon, const fsdp_args_t *args, char *const *envp,
                      fsdp_config_t *config, fsdp_status_t *st) {
  adopt_config(daemon, args, envp, config);
  int r;
  if ((r = daemon_resolve_operator_group(&daemon->config, &daemon->has_operator_group,
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
  fsdp_metrics_http_stop(daemon->metrics);
  daemon->metrics = NULL;
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
  /* Only now is no work in flight on the units and their arenas. The store's arenas are
   * the backend's memory: they go before it does. */
  fsdp_checkpoints_cleanup(&daemon->checkpoints);
  fsdp_store_cleanup(&daemon->store);
  fsdp_dataplane_cleanup(&daemon->dataplane);
  int r = uv_loop_close(&daemon->loop);
  if (r < 0)
    log_warning("event loop closed with handles still open: %s", uv_strerror(r));
  fsdp_config_cleanup(&daemon->config);
  return 0;
}
