/* The host backend: jobs' memory in host memfds (the arenas make them, daemon/store/arena.h)
 * and the CPU kernels over the data plane's worker pool. Apart from backend.h so that the
 * interface names no implementation's types. */
#ifndef FSDP_HOST_BACKEND_H
#define FSDP_HOST_BACKEND_H

#include "daemon/backend/backend.h"
#include "kernels/workers.h"

/* The host backend: the CPU kernels over workers (borrowed; NULL: on the calling thread). */
void fsdp_backend_init_host(fsdp_backend_t *b, fsdp_workers_t *workers);

#endif
