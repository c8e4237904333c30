/* What the daemon's lifecycle files share (daemon.h is the contract): the steps each offers
 * the others. Internal to the daemon's top folder; loop thread only. */
#ifndef FSDP_DAEMON_INTERNAL_H
#define FSDP_DAEMON_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/daemon.h"

/* serving.c */

/* The log level cfg asks for (daemon.log_level), for the daemon's log and gRPC's. */
void daemon_set_log_level(const fsdp_config_t *cfg);

/* Values that take effect without a restart; called at start and after a reload. */
void daemon_apply_config(fsdp_daemon_t *daemon);

/* daemon.operator_group as a gid: a group's name, or a number (a gid need not have a name).
 * Looked up at start and on reload only: the lookup may ask a directory service. */
int daemon_resolve_operator_group(const fsdp_config_t *cfg, bool *ret_has, gid_t *ret_gid,
                                  fsdp_status_t *st);

/* Whether a session other than `except` (NULL: any) belongs to the job. */
bool daemon_job_has_session(const fsdp_daemon_t *daemon, const fsdp_job_t *job,
                            const fsdp_session_t *except);

/* The services' lifecycle hooks (fsdp_services_lifecycle_t), data: the daemon: whether the
 * caller may change the daemon's state, and a session's end, released for `why`. */
bool daemon_is_operator(void *data, int fd, const fsdp_credentials_t *cred);
void daemon_end_session(void *data, fsdp_session_t *session, const char *why);

/* The store's hooks (fsdp_store_hooks_t), data: the daemon. */
bool daemon_job_idle(void *data, const fsdp_job_t *job);

/* Frees an idle job: its units and its arenas go back to the host. */
void daemon_free_job(void *data, fsdp_job_t *job, const char *why);

/* The housekeeping timer: every daemon.housekeeping_interval. */
void daemon_on_housekeeping(uv_timer_t *timer);

/* Re-reads the config with the original precedence. All or nothing: on any error, or if a
 * value that cannot change at run time differs, the running config stays and st says why. */
int daemon_reload(void *data, fsdp_option_id_t *ret_changed, size_t *ret_n, fsdp_status_t *st);

/* SIGHUP reloads; SIGTERM and SIGINT stop. */
void daemon_on_signal(uv_signal_t *handle, int signum);

/* endpoints.c */

/* The RPC server with its endpoints: the unix socket's, the health port's and, with
 * several hosts, the peer port's. */
int daemon_create_rpc(fsdp_daemon_t *daemon, fsdp_status_t *st);

/* The soft descriptor limit (1024 by default) is too low for session.max_sessions trainers
 * and the connection limits: raise it to the hard limit, and say so if even that is short.
 * The unix socket's limit is per uid: the estimate holds one uid's, as the socket's group is
 * the trainers' launcher and its operators, not a crowd. */
void daemon_raise_descriptor_limit(const fsdp_config_t *cfg);

/* stop.c */

/* With draining, health turns NOT_SERVING and new work is refused while the daemon keeps
 * running; without, it serves again. */
int daemon_set_draining(void *data, bool draining, fsdp_status_t *st);

/* What Operator.Status and health report of the daemon's state. */
fsdp_services_state_t daemon_serving_state(void *data);

#endif
