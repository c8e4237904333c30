/* The call helpers every handler of daemon/services/ uses (calls.h). */
#include "daemon/services/calls.h"

uint64_t fsdp_services_now_ms(fsdp_services_context_t *ctx) {
  uv_update_time(ctx->loop);
  return uv_now(ctx->loop);
}

void fsdp_services_fail_call(fsdp_rpc_call_t *call, const fsdp_status_t *st) {
  fsdp_rpc_call_fail(call, st->code, "%s: %s", fsdp_rpc_call_method(call), st->message);
}

const fsdp_credentials_t *fsdp_services_caller(fsdp_services_context_t *ctx,
                                               fsdp_rpc_call_t *call,
                                               fsdp_credentials_t *ret_cred) {
  return fsdp_listener_credentials(ctx->listener, fsdp_rpc_call_peer_fd(call), ret_cred) == 0
             ? ret_cred
             : NULL;
}

fsdp_session_t *fsdp_services_use_session(fsdp_rpc_call_t *call, fsdp_services_context_t *ctx,
                                          uint64_t id) {
  fsdp_session_t *s;
  fsdp_status_t st;
  fsdp_credentials_t cred;
  if (fsdp_sessions_use(ctx->sessions, id, fsdp_services_caller(ctx, call, &cred),
                        fsdp_services_now_ms(ctx), &s, &st) < 0) {
    fsdp_services_fail_call(call, &st);
    return NULL;
  }
  return s;
}
