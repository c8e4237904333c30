/* A GPU trainer's session's CUDA events: made by the daemon on the job's GPU, their handles
 * sent in the memory channel's welcome (ChannelWelcome.cuda_events), recorded by the
 * trainer on its stream before a unit operation that names one (UnitOpRequest.event,
 * fsdp_fast_request_t.event), waited on by the daemon's streams as the operation arrives.
 *
 * Why: without them a trainer synchronizes its whole device before every call, so its host
 * thread stops until its queued kernels have run and the daemon's gather of the next unit
 * cannot overlap the compute of this one. With them the order is the device's: the daemon's
 * work after a request runs after the trainer's work before it, and nobody's host thread
 * waits for that. The daemon owns the events (the trainer opens them): they live as long as
 * the session. Loop thread only. */
#ifndef FSDP_SERVICES_TRAINER_EVENTS_H
#define FSDP_SERVICES_TRAINER_EVENTS_H

#include <stdint.h>

#include "common/status.h"
#include "daemon/backend/backend.h"
#include "proto/limits.h"

typedef struct fsdp_trainer_events fsdp_trainer_events_t;

/* FSDP_SESSION_CUDA_EVENTS new events on the backend's GPU in *ret; their handles in
 * handles[i]. */
int fsdp_trainer_events_open(const fsdp_backend_t *backend, fsdp_trainer_events_t **ret,
                             unsigned char handles[FSDP_SESSION_CUDA_EVENTS]
                                                  [FSDP_CUDA_IPC_EVENT_BYTES],
                             fsdp_status_t *st);
/* NULL-safe. Work already told to wait on them still does. */
void fsdp_trainer_events_close(fsdp_trainer_events_t *events);

/* The daemon's work from now on follows the latest record of the request's `event` (0:
 * none, i + 1: event i). INVALID_ARGUMENT naming the field and the value when the session
 * has no such event (events NULL: its job is in host memory). */
int fsdp_trainer_events_wait(fsdp_trainer_events_t *events, uint32_t event, fsdp_status_t *st);

#endif
