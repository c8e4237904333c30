/* The gRPC health service (grpc.health.v1.Health) as schedulers and grpc_health_probe use it.
 *
 * It knows the serving status of "" (the daemon as a whole), of each fsdp.v1 service, and
 * of each job the daemon holds as "fsdp.job.<name>": NOT_SERVING while one of the job's
 * collectives has been under way longer than health.stall_after (the job_state callback
 * says; the daemon's log and the metrics say why), so that a scheduler sees a stuck job
 * while the daemon itself stays SERVING. Check answers at once (NOT_FOUND for an unknown
 * service, as the protocol says); Watch streams the current status and every change
 * (SERVICE_UNKNOWN for an unknown service or job, keeping the stream open: a job may come).
 * Draining flips everything to NOT_SERVING, which every watcher sees before its stream is
 * closed.
 *
 * Loop thread only. Embedded in the daemon (init/cleanup). */
#ifndef FSDP_HEALTH_H
#define FSDP_HEALTH_H

#include <stdbool.h>

#include "daemon/rpc/rpc_server.h"

#define FSDP_HEALTH_SERVICES 4

/* The prefix of a job's service name. */
#define FSDP_HEALTH_JOB_PREFIX "fsdp.job."

typedef struct fsdp_health_watch fsdp_health_watch_t;

/* A job's state for its health: unknown (no such job), stalled, or going. */
typedef enum fsdp_health_job_state {
  FSDP_HEALTH_JOB_UNKNOWN,
  FSDP_HEALTH_JOB_STALLED,
  FSDP_HEALTH_JOB_GOING,
} fsdp_health_job_state_t;

typedef struct fsdp_health {
  bool serving[FSDP_HEALTH_SERVICES];
  /* The jobs' states (NULL: every job unknown), with job_data. */
  fsdp_health_job_state_t (*job_state)(void *data, const char *job);
  void *job_data;
  bool closed; /* cleaned up for a stop: a new Watch gets one status and ends */
  fsdp_health_watch_t *watches;
  unsigned n_watches;
  fsdp_rpc_service_t service; /* for registration on an endpoint */
} fsdp_health_t;

void fsdp_health_init(fsdp_health_t *health);
/* Ends every watch stream with UNAVAILABLE; frees what the health service holds. */
void fsdp_health_cleanup(fsdp_health_t *health);

/* The jobs' states may have changed: their watchers hear what did. */
void fsdp_health_refresh(fsdp_health_t *health);

/* Sets the status of every service and tells the watchers what changed. */
void fsdp_health_set_serving(fsdp_health_t *health, bool serving);
bool fsdp_health_is_serving(const fsdp_health_t *health);

/* The names the health service knows, "" first; NULL past the end. */
const char *fsdp_health_service_name(unsigned index);

#endif
