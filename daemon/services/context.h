/* What the handlers of daemon/services/ work on: the parts of the daemon they use, and the
 * few lifecycle actions they may ask of it, so that they need not know the daemon itself.
 *
 * daemon/start.c fills it, and the daemon owns everything it points to (borrowed here); the
 * parts made after the handlers' tables (the peers, the RPC server) are set as they are made,
 * before any call is served. Loop thread only. */
#ifndef FSDP_SERVICES_CONTEXT_H
#define FSDP_SERVICES_CONTEXT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "config/config.h"
#include "daemon/cluster/peers.h"
#include "daemon/checkpoints/checkpoints.h"
#include "daemon/dataplane/dataplane.h"
#include "daemon/rpc/listener.h"
#include "daemon/rpc/rpc_server.h"
#include "daemon/session/sessions.h"
#include "daemon/store/store.h"

/* Service tables. The unix socket serves the first FSDP_SERVICE_LOCAL_COUNT, the health
 * port only HEALTH, the peer port (TCP, token and TLS as configured) HEALTH and PEER. */
enum {
  FSDP_SERVICE_TRAINER,
  FSDP_SERVICE_OPERATOR,
  FSDP_SERVICE_HEALTH,
  FSDP_SERVICE_PEER,
  FSDP_SERVICE_COUNT,
  FSDP_SERVICE_LOCAL_COUNT = FSDP_SERVICE_PEER,
};

/* The daemon's state as Operator.Status reports it. */
typedef enum fsdp_services_state {
  FSDP_SERVICES_SERVING,
  FSDP_SERVICES_DRAINING,  /* Operator.Drain: no new work until Resume */
  FSDP_SERVICES_STOPPING,  /* starting, stopping or stopped */
} fsdp_services_state_t;

/* What the handlers ask of the daemon's lifecycle; each gets `data`. */
typedef struct fsdp_services_lifecycle {
  /* Operator.ReloadConfig: re-reads the config, all or nothing; ret_changed receives the ids
   * of changed options (room for FSDP_OPTION_COUNT). */
  int (*reload)(void *data, fsdp_option_id_t *ret_changed, size_t *ret_n, fsdp_status_t *st);
  /* Operator.Drain and Resume; fails while stopping. */
  int (*set_draining)(void *data, bool draining, fsdp_status_t *st);
  /* Ends a session for `why` (Detach, its memory channel closed) and releases it. */
  void (*end_session)(void *data, fsdp_session_t *session, const char *why);
  /* Whether the caller on connected socket fd may change the daemon's state. */
  bool (*is_operator)(void *data, int fd, const fsdp_credentials_t *cred);
  fsdp_services_state_t (*state)(void *data);
  void *data;
} fsdp_services_lifecycle_t;

/* A session as the store knows it: a local rank of its job. Borrows the session. */
static inline fsdp_store_rank_t fsdp_services_store_rank(const fsdp_session_t *s) {
  return (fsdp_store_rank_t){.job = s->job,
                             .local_rank = s->local_rank,
                             .local_world_size = s->local_world_size,
                             .owner = &s->owner};
}

typedef struct fsdp_services_context {
  uv_loop_t *loop;     /* whose clock sessions and deadlines use */
  uint64_t started_ms; /* loop time at start */
  const fsdp_config_t *config;
  fsdp_listener_t *listener;
  fsdp_sessions_t *sessions;
  fsdp_store_t *store;
  fsdp_dataplane_t *dataplane;
  fsdp_checkpoints_t *checkpoints;
  fsdp_peers_t *peers;
  fsdp_rpc_server_t *rpc;
  const fsdp_rpc_service_t *services; /* FSDP_SERVICE_COUNT of them, for Status */
  /* The TCP endpoints' bound addresses, for Status; empty when there is none. */
  const char *health_address;
  const char *peer_address;
  const char *metrics_address; /* HOST:PORT of the metrics endpoint (HTTP) */
  fsdp_services_lifecycle_t lifecycle;
} fsdp_services_context_t;

#endif
