/* What the handlers of daemon/services/ do alike with a call: fail it the way every refusal
 * reads, know the process calling, use the session it names, read the loop's clock. Apart
 * so that the Trainer, Operator and Peer handlers and the memory channel's welcome each say
 * these the same. Loop thread only. */
#ifndef FSDP_SERVICES_CALLS_H
#define FSDP_SERVICES_CALLS_H

#include <stdint.h>

#include "common/status.h"
#include "daemon/rpc/rpc_server.h"
#include "daemon/services/context.h"
#include "daemon/session/sessions.h"

/* The loop's clock in milliseconds, brought up to date: sessions and deadlines count in it. */
uint64_t fsdp_services_now_ms(fsdp_services_context_t *ctx);

/* Fails a call with st, its message prefixed by the method, as every refusal here reads. */
void fsdp_services_fail_call(fsdp_rpc_call_t *call, const fsdp_status_t *st);

/* The credentials of the calling process, or NULL when it did not come through our listener. */
const fsdp_credentials_t *fsdp_services_caller(fsdp_services_context_t *ctx,
                                               fsdp_rpc_call_t *call,
                                               fsdp_credentials_t *ret_cred);

/* The session a request names, its lease renewed; fails the call if there is none. */
fsdp_session_t *fsdp_services_use_session(fsdp_rpc_call_t *call, fsdp_services_context_t *ctx,
                                          uint64_t id);

#endif
