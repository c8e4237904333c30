/* A session's fast path (proto/fastpath.h): its shared-memory rings and doorbells, and the
 * unit operations that come through them, handed to the data plane as the gRPC handlers hand
 * theirs, with the same checks, deadlines and messages.
 *
 * Made when the session's memory channel opens (the welcome carries its descriptors) and
 * closed when the session is released, after the data plane has ended the session's
 * operations. Loop thread only. */
#ifndef FSDP_SERVICES_FASTPATH_H
#define FSDP_SERVICES_FASTPATH_H

#include "common/status.h"
#include "daemon/services/context.h"
#include "daemon/session/sessions.h"

typedef struct fsdp_fastpath fsdp_fastpath_t;

/* Makes session's fast path and sets session->fast_path. ret_fds receives the descriptors
 * the welcome sends: the region, the daemon's doorbell, the trainer's (kept open by the
 * fast path until it closes); ret_bytes the region's size. */
int fsdp_fastpath_open(fsdp_services_context_t *ctx, fsdp_session_t *session, int ret_fds[3],
                       size_t *ret_bytes, fsdp_status_t *st);

/* Cancels what the session still has in flight (nothing, after the data plane released the
 * session) and frees its fast path once its handles are closed. NULL-safe. */
void fsdp_fastpath_close(fsdp_fastpath_t *fp);

#endif
