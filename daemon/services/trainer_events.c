/* A GPU trainer's session's events (daemon/services/trainer_events.h). */
#include "daemon/services/trainer_events.h"

#include <errno.h>
#include <stdlib.h>

struct fsdp_trainer_events {
  const fsdp_backend_t *backend;
  fsdp_backend_event_t *event[FSDP_SESSION_CUDA_EVENTS];
};

int fsdp_trainer_events_open(const fsdp_backend_t *backend, fsdp_trainer_events_t **ret,
                             unsigned char handles[FSDP_SESSION_CUDA_EVENTS]
                                                  [FSDP_CUDA_IPC_EVENT_BYTES],
                             fsdp_status_t *st) {
  _Static_assert(FSDP_CUDA_IPC_EVENT_BYTES == 64, "the backend's handles are 64 bytes");
  fsdp_trainer_events_t *te = calloc(1, sizeof *te);
  if (!te)
    return fsdp_status_set(st, -ENOMEM, "out of memory for a session's events");
  te->backend = backend;
  for (size_t i = 0; i < FSDP_SESSION_CUDA_EVENTS; i++) {
    int r = fsdp_backend_event_new(backend, &te->event[i], handles[i], st);
    if (r < 0) {
      fsdp_trainer_events_close(te);
      return r;
    }
  }
  *ret = te;
  return 0;
}

void fsdp_trainer_events_close(fsdp_trainer_events_t *te) {
  if (!te)
    return;
  for (size_t i = 0; i < FSDP_SESSION_CUDA_EVENTS; i++)
    fsdp_backend_event_free(te->backend, te->event[i]);
  free(te);
}

int fsdp_trainer_events_wait(fsdp_trainer_events_t *te, uint32_t event, fsdp_status_t *st) {
  if (event == 0)
    return 0;
  if (!te)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "event %u: the session has no CUDA events (its job's memory is the "
                           "host's)", event);
  if (event > FSDP_SESSION_CUDA_EVENTS)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "event %u: the session's CUDA events are 1 to %d (0: none)", event,
                           FSDP_SESSION_CUDA_EVENTS);
  return fsdp_backend_wait_event(te->backend, te->event[event - 1], st);
}
