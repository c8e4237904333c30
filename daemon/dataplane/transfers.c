/* A job's state between two hosts, for a host that recovers it from a replica
 * (daemon/checkpoints/replicas.c): one tagged UCX message over the fabric, which the rings
 * share, with an end that a deadline or a caller can bring. */
#include "daemon/dataplane/internal.h"

#include <stdlib.h>

#include "proto/host/formats.h"

struct fsdp_dataplane_transfer {
  fsdp_ucx_req_t req;
  fsdp_ucx_peer_t *peer;
  unsigned host;
  bool send;
  fsdp_dataplane_transfer_fn done;
  void *data;
};

static void on_transfer_done(fsdp_ucx_req_t *req, int status) {
  fsdp_dataplane_transfer_t *t = req->data;
  fsdp_status_t st = {0};
  if (status < 0) {
    const char *why = fsdp_ucx_peer_error(t->peer);
    fsdp_status_set(&st, status, "the %s of the state %s host %u %s: %s",
                    t->send ? "send" : "receive", t->send ? "to" : "from", t->host,
                    status == FSDP_E_CANCELLED ? "was cancelled" : "failed",
                    why ? why : fsdp_strerror(status));
  }
  t->done(t->data, status < 0 ? &st : NULL);
  free(t);
}

int fsdp_dataplane_transfer_state(fsdp_dataplane_t *dp, bool send, unsigned host,
                                  const char *job, uint64_t step, uint64_t receiver, void *buf,
                                  size_t len, fsdp_dataplane_transfer_fn done, void *data,
                                  fsdp_dataplane_transfer_t **ret, fsdp_status_t *st) {
  const char *why = "this daemon serves one host";
  fsdp_ucx_peer_t *peer = dp->fabric ? fsdp_fabric_peer(dp->fabric, host, &why) : NULL;
  if (!peer)
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "no data-plane connection to host %u: %s",
                           host, why);
  fsdp_dataplane_transfer_t *t = calloc(1, sizeof *t);
  if (!t)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for a transfer");
  *t = (fsdp_dataplane_transfer_t){.peer = peer, .host = host, .send = send, .done = done,
                                   .data = data};
  t->req.data = t;
  /* One message per (job, step, receiving daemon): a receive matches this send alone. */
  uint64_t tag = fsdp_ring_tag_data(fsdp_op_id(job, "", step, receiver, FSDP_OP_KIND_RECOVER),
                                    0, 0);
  int r = send ? fsdp_ucx_send(&t->req, peer, buf, len, NULL, tag, on_transfer_done)
               : fsdp_ucx_recv(&t->req, peer, buf, len, NULL, tag, ~(uint64_t)0,
                               on_transfer_done);
  if (r < 0) {
    free(t);
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "no data-plane connection to host %u: %s",
                           host, fsdp_ucx_peer_error(peer));
  }
  *ret = t;
  return 0;
}

void fsdp_dataplane_transfer_end(fsdp_dataplane_transfer_t *t, const char *why) {
  if (why)
    fsdp_ucx_peer_fail(t->peer, why);
  else
    fsdp_ucx_cancel(&t->req);
}
