/* grpc.health.v1.Health: Check and Watch over the daemon's serving status. */
#include "daemon/services/health.h"

#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"

#include "common/log.h"

typedef Grpc__Health__V1__HealthCheckResponse__ServingStatus serving_status_t;

struct fsdp_health_watch {
  fsdp_health_t *health;
  fsdp_rpc_call_t *call;
  int service; /* index into service_names, JOB_SERVICE, or -1 for an unknown name */
  char *name;  /* the service's name, as asked */
  serving_status_t last_sent;
  fsdp_health_watch_t *prev, *next;
};

static const char *const service_names[FSDP_HEALTH_SERVICES] = {
    "", "fsdp.v1.Trainer", "fsdp.v1.Operator", "fsdp.v1.Peer"};

const char *fsdp_health_service_name(unsigned index) {
  return index < FSDP_HEALTH_SERVICES ? service_names[index] : NULL;
}

/* A job's service: "fsdp.job.<name>". */
#define JOB_SERVICE FSDP_HEALTH_SERVICES

static int find_service(const char *name) {
  for (int i = 0; i < FSDP_HEALTH_SERVICES; i++)
    if (strcmp(name, service_names[i]) == 0)
      return i;
  if (strncmp(name, FSDP_HEALTH_JOB_PREFIX, strlen(FSDP_HEALTH_JOB_PREFIX)) == 0)
    return JOB_SERVICE;
  return -1;
}

static serving_status_t status_of(const fsdp_health_t *health, int service, const char *name) {
  if (service == JOB_SERVICE) {
    const char *job = name + strlen(FSDP_HEALTH_JOB_PREFIX);
    fsdp_health_job_state_t state =
        health->job_state ? health->job_state(health->job_data, job) : FSDP_HEALTH_JOB_UNKNOWN;
    if (state == FSDP_HEALTH_JOB_UNKNOWN)
      return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
    return health->serving[0] && state == FSDP_HEALTH_JOB_GOING
               ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
               : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
  }
  if (service < 0)
    return GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN;
  return health->serving[service] ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                                  : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
}

static void check(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  const Grpc__Health__V1__HealthCheckRequest *rq = (const void *)request;
  fsdp_health_t *health = data;
  int service = find_service(rq->service);
  serving_status_t status = status_of(health, service, rq->service);
  if (status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN) {
    fsdp_rpc_call_fail(call, FSDP_E_NOT_FOUND,
                       "unknown service '%s'; known: \"\", fsdp.v1.Trainer, fsdp.v1.Operator, "
                       "fsdp.v1.Peer, and fsdp.job.<name> for each job the daemon holds",
                       rq->service);
    return;
  }
  Grpc__Health__V1__HealthCheckResponse reply = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  reply.status = status;
  fsdp_rpc_call_reply(call, &reply.base);
}

static void watch_unlink(fsdp_health_watch_t *w) {
  fsdp_health_t *health = w->health;
  if (w->prev)
    w->prev->next = w->next;
  else
    health->watches = w->next;
  if (w->next)
    w->next->prev = w->prev;
  health->n_watches--;
  free(w->name);
  free(w);
}

static void on_watch_cancel(fsdp_rpc_call_t *call, void *data) {
  (void)call;
  watch_unlink(data);
}

static void watch_send(fsdp_health_watch_t *w) {
  Grpc__Health__V1__HealthCheckResponse reply = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  reply.status = status_of(w->health, w->service, w->name);
  w->last_sent = reply.status;
  fsdp_rpc_call_send(w->call, &reply.base);
}

static void watch(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  const Grpc__Health__V1__HealthCheckRequest *rq = (const void *)request;
  fsdp_health_t *health = data;
  if (health->closed) {
    Grpc__Health__V1__HealthCheckResponse reply = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    reply.status = status_of(health, find_service(rq->service), rq->service);
    fsdp_rpc_call_send(call, &reply.base);
    fsdp_rpc_call_fail(call, FSDP_E_UNAVAILABLE, "fsdpd is shutting down");
    return;
  }
  fsdp_health_watch_t *w = calloc(1, sizeof *w);
  char *name = w ? strdup(rq->service) : NULL;
  if (!name) {
    free(w);
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for a health watch");
    return;
  }
  *w = (fsdp_health_watch_t){.health = health, .call = call, .service = find_service(name),
                             .name = name};
  w->next = health->watches;
  if (health->watches)
    health->watches->prev = w;
  health->watches = w;
  health->n_watches++;
  fsdp_rpc_call_on_cancel(call, on_watch_cancel, w);
  watch_send(w);
}

/* Probes must see the daemon drain, so health is served while draining. */
static const fsdp_rpc_handler_t handlers[] = {{"Check", check, true}, {"Watch", watch, true}};

void fsdp_health_init(fsdp_health_t *health) {
  memset(health, 0, sizeof *health);
  health->service = (fsdp_rpc_service_t){.descriptor = &grpc__health__v1__health__descriptor,
                                         .handlers = handlers,
                                         .n_handlers = sizeof handlers / sizeof handlers[0],
                                         .data = health};
}

void fsdp_health_refresh(fsdp_health_t *health) {
  for (fsdp_health_watch_t *w = health->watches; w; w = w->next)
    if (status_of(health, w->service, w->name) != w->last_sent)
      watch_send(w);
}

void fsdp_health_set_serving(fsdp_health_t *health, bool serving) {
  for (int i = 0; i < FSDP_HEALTH_SERVICES; i++)
    health->serving[i] = serving;
  fsdp_health_refresh(health);
}

bool fsdp_health_is_serving(const fsdp_health_t *health) {
  return health->serving[0];
}

void fsdp_health_cleanup(fsdp_health_t *health) {
  if (!health)
    return;
  health->closed = true;
  while (health->watches) {
    fsdp_health_watch_t *w = health->watches;
    fsdp_rpc_call_t *call = w->call;
    watch_unlink(w);
    fsdp_rpc_call_on_cancel(call, NULL, NULL);
    fsdp_rpc_call_fail(call, FSDP_E_UNAVAILABLE, "fsdpd is shutting down");
  }
}
