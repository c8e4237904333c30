/* The ucp worker on a libuv loop, tagged sends and receives with callbacks that always run
 * from the loop, and peer failure turned into errors for every pending request.
 *
 * ucp calls its own callbacks from inside ucp_worker_progress, ucp_request_cancel and
 * ucp_ep_close_nbx, and sometimes inside the call that starts a request. None of those may
 * run caller code: the caller could be in the middle of updating its own state, and
 * ucp_worker_progress must not be re-entered. So a ucp callback only records the outcome and
 * queues the request; drive() runs the queued callbacks at the top of the loop, between
 * progress rounds, and only arms the worker (so that the loop may sleep in epoll) when no
 * callback is queued and progress found nothing to do. */
#include "transport/ucx.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ucp/api/ucp.h>

#include "proto/host/formats.h"

struct fsdp_ucx_peer {
  fsdp_ucx_t *ucx;
  fsdp_ucx_peer_t *next;
  ucp_ep_h ep;            /* NULL once closed */
  fsdp_ucx_req_t *pending; /* requests UCX still holds (doubly linked) */
  unsigned n_pending;      /* requests whose callbacks have not run */
  bool err_handling;
  bool failed;
  bool needs_close; /* failed from inside a ucp callback: close at the top of drive() */
  bool needs_notify;
  char label[FSDP_UCX_LABEL_MAX];
  char error[160];
};

/* A send's copy of the caller's data, for a peer without peer error handling: UCX holds it
 * until it lets go of the send, which after fsdp_ucx_peer_fail may be long after the
 * caller's request has ended, or never (then it goes with the worker). */
struct fsdp_ucx_bounce {
  fsdp_ucx_t *ucx;
  fsdp_ucx_req_t *req; /* NULL once the request ended without it */
  fsdp_ucx_bounce_t *prev, *next; /* in ucx->bounces */
  max_align_t data[];
};

struct fsdp_ucx_mem {
  fsdp_ucx_t *ucx;
  ucp_mem_h memh;
  const char *addr;
  size_t len;
  fsdp_ucx_mem_t *prev, *next;
};

struct fsdp_ucx {
  uv_loop_t *loop;
  fsdp_ucx_options_t opt;
  ucp_context_h ctx;
  ucp_worker_h worker;
  unsigned char *addr;
  size_t addr_len;
  uv_poll_t poll;
  uv_idle_t idle;
  bool poll_started, idle_started;
  bool driving, again;
  fsdp_ucx_peer_t *peers;
  fsdp_ucx_mem_t *mems;
  fsdp_ucx_bounce_t *bounces;
  fsdp_ucx_req_t *done_head, *done_tail;
  unsigned ep_closes; /* ucp_ep_close_nbx requests not completed yet */
  bool closing, destroyed;
  unsigned handles_open;
  void (*close_cb)(void *arg);
  void *close_arg;
};

static void drive(fsdp_ucx_t *u);
static void on_idle(uv_idle_t *h);

static void schedule(fsdp_ucx_t *u) {
  if (u->driving) {
    u->again = true;
    return;
  }
  if (!u->idle_started && !u->destroyed) {
    uv_idle_start(&u->idle, on_idle);
    u->idle_started = true;
  }
}

/* ---- Requests ---- */

static void pending_unlink(fsdp_ucx_req_t *r) {
  fsdp_ucx_peer_t *p = r->peer;
  if (r->prev)
    r->prev->next = r->next;
  else if (p->pending == r)
    p->pending = r->next;
  if (r->next)
    r->next->prev = r->prev;
  r->prev = r->next = NULL;
}

static void bounce_free(fsdp_ucx_bounce_t *b) {
  fsdp_ucx_t *u = b->ucx;
  if (b->prev)
    b->prev->next = b->next;
  else
    u->bounces = b->next;
  if (b->next)
    b->next->prev = b->prev;
  free(b);
}

/* Records the outcome of a request and queues its callback; safe inside ucp callbacks. A
 * send from a copy leaves the copy to UCX. */
static void complete(fsdp_ucx_req_t *r, int status) {
  if (r->done)
    return;
  r->done = true;
  r->ucp_req = NULL;
  if (r->bounce) {
    r->bounce->req = NULL;
    r->bounce = NULL;
  }
  r->status = status;
  pending_unlink(r);
  fsdp_ucx_t *u = r->ucx;
  if (u->done_tail)
    u->done_tail->next = r;
  else
    u->done_head = r;
  u->done_tail = r;
  schedule(u);
}

static void peer_mark_failed(fsdp_ucx_peer_t *p, const char *why) {
  if (p->failed)
    return;
  p->failed = true;
  p->needs_notify = true;
  snprintf(p->error, sizeof p->error, "%s", why);
}

static int status_of(fsdp_ucx_req_t *r, ucs_status_t st) {
  if (st == UCS_OK)
    return 0;
  if (st == UCS_ERR_MESSAGE_TRUNCATED)
    return FSDP_E_DATA_LOSS;
  if (st == UCS_ERR_CANCELED)
    return r->peer->failed && !r->ucx->closing ? FSDP_E_UNAVAILABLE : FSDP_E_CANCELLED;
  /* Any other error is the connection's: the peer is unusable from now on. Closing the
   * endpoint from inside a ucp callback is not allowed, so drive() does it. */
  if (!r->peer->failed) {
    peer_mark_failed(r->peer, ucs_status_string(st));
    r->peer->needs_close = true;
  }
  return FSDP_E_UNAVAILABLE;
}

static void send_cb(void *request, ucs_status_t st, void *user_data) {
  fsdp_ucx_req_t *r = user_data;
  ucp_request_free(request);
  complete(r, status_of(r, st));
}

static void bounce_send_cb(void *request, ucs_status_t st, void *user_data) {
  fsdp_ucx_bounce_t *b = user_data;
  fsdp_ucx_req_t *r = b->req;
  ucp_request_free(request);
  bounce_free(b);
  if (r) {
    r->bounce = NULL;
    complete(r, status_of(r, st));
  }
}

static void recv_cb(void *request, ucs_status_t st, const ucp_tag_recv_info_t *info,
                    void *user_data) {
  fsdp_ucx_req_t *r = user_data;
  ucp_request_free(request);
  int status = status_of(r, st);
  if (status == 0) {
    r->received = info->length;
    if (info->length != r->expected)
      status = FSDP_E_DATA_LOSS;
  }
  complete(r, status);
}

static void req_start(fsdp_ucx_req_t *r, fsdp_ucx_peer_t *p, fsdp_ucx_req_cb cb, size_t len,
                      bool is_recv) {
  void *data = r->data;
  memset(r, 0, sizeof *r);
  r->data = data;
  r->ucx = p->ucx;
  r->peer = p;
  r->cb = cb;
  r->expected = len;
  r->is_recv = is_recv;
  r->next = p->pending;
  if (p->pending)
    p->pending->prev = r;
  p->pending = r;
  p->n_pending++;
}

/* What ucp returned for a request just started: done now, failed now, or in flight (unless
 * its callback already ran inside the call). */
static void req_started(fsdp_ucx_req_t *r, ucs_status_ptr_t sp) {
  if (sp == NULL)
    complete(r, 0);
  else if (UCS_PTR_IS_ERR(sp))
    complete(r, status_of(r, UCS_PTR_STATUS(sp)));
  else if (!r->done)
    r->ucp_req = sp;
  schedule(r->ucx);
}

/* A transfer's parameters: its request for the callback, and the registration when mem
 * covers the whole of buf. The caller sets the callback of its direction. */
static ucp_request_param_t transfer_params(fsdp_ucx_req_t *req, const fsdp_ucx_mem_t *mem,
                                           const void *buf, size_t len) {
  ucp_request_param_t rp = {
      .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
      .user_data = req,
  };
  const char *b = buf;
  if (mem && b >= mem->addr && len <= mem->len && (size_t)(b - mem->addr) <= mem->len - len) {
    rp.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    rp.memh = mem->memh;
  }
  return rp;
}

/* A send to a peer without peer error handling, from a copy of buf: UCX cannot end a send
 * to such a peer (see peer_close_now), so the copy is what stays with UCX when the peer
 * fails, and the caller's request ends at once. */
static void send_bounced(fsdp_ucx_req_t *req, fsdp_ucx_peer_t *peer, const void *buf,
                         size_t len, uint64_t tag) {
  fsdp_ucx_t *u = peer->ucx;
  fsdp_ucx_bounce_t *b = malloc(sizeof *b + len);
  if (!b) {
    complete(req, -ENOMEM);
    schedule(u);
    return;
  }
  b->ucx = u;
  b->req = req;
  b->prev = NULL;
  b->next = u->bounces;
  if (u->bounces)
    u->bounces->prev = b;
  u->bounces = b;
  if (len)
    memcpy(b->data, buf, len);
  req->bounce = b;
  ucp_request_param_t rp = transfer_params(req, NULL, b->data, len);
  rp.user_data = b;
  rp.cb.send = bounce_send_cb;
  ucs_status_ptr_t sp = ucp_tag_send_nbx(peer->ep, b->data, len, tag, &rp);
  if (!UCS_PTR_IS_PTR(sp)) { /* done or failed in the call, without the callback */
    req->bounce = NULL;
    bounce_free(b);
  }
  req_started(req, sp);
}

int fsdp_ucx_send(fsdp_ucx_req_t *req, fsdp_ucx_peer_t *peer, const void *buf, size_t len,
                  const fsdp_ucx_mem_t *mem, uint64_t tag, fsdp_ucx_req_cb cb) {
  if (peer->failed || !peer->ep)
    return FSDP_E_UNAVAILABLE;
  req_start(req, peer, cb, len, false);
  if (!peer->err_handling) {
    send_bounced(req, peer, buf, len, tag);
    return 0;
  }
  ucp_request_param_t rp = transfer_params(req, mem, buf, len);
  rp.cb.send = send_cb;
  req_started(req, ucp_tag_send_nbx(peer->ep, buf, len, tag, &rp));
  return 0;
}

int fsdp_ucx_recv(fsdp_ucx_req_t *req, fsdp_ucx_peer_t *peer, void *buf, size_t len,
                  const fsdp_ucx_mem_t *mem, uint64_t tag, uint64_t tag_mask,
                  fsdp_ucx_req_cb cb) {
  if (peer->failed || !peer->ep)
    return FSDP_E_UNAVAILABLE;
  req_start(req, peer, cb, len, true);
  ucp_request_param_t rp = transfer_params(req, mem, buf, len);
  rp.cb.recv = recv_cb;
  req_started(req, ucp_tag_recv_nbx(peer->ucx->worker, buf, len, tag, tag_mask, &rp));
  return 0;
}

/* ---- Registered memory ---- */

int fsdp_ucx_mem_register(fsdp_ucx_t *ucx, void *addr, size_t len, fsdp_ucx_mem_t **ret_mem,
                          fsdp_status_t *st) {
  if (!addr || len == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "UCX memory registration of %zu bytes at %p: expected a buffer", len,
                           addr);
  if (ucx->closing)
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE,
                           "UCX memory registration: the transport is closing");
  fsdp_ucx_mem_t *m = calloc(1, sizeof *m);
  if (!m)
    return fsdp_status_set(st, -ENOMEM, "UCX memory registration: out of memory");
  ucp_mem_map_params_t mp = {
      .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
      .address = addr,
      .length = len,
  };
  ucs_status_t us = ucp_mem_map(ucx->ctx, &mp, &m->memh);
  if (us != UCS_OK) {
    free(m);
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE,
                           "UCX cannot register %zu bytes at %p (ucp_mem_map): %s", len, addr,
                           ucs_status_string(us));
  }
  m->ucx = ucx;
  m->addr = addr;
  m->len = len;
  m->next = ucx->mems;
  if (ucx->mems)
    ucx->mems->prev = m;
  ucx->mems = m;
  *ret_mem = m;
  return 0;
}

void fsdp_ucx_mem_deregister(fsdp_ucx_mem_t *m) {
  if (!m)
    return;
  fsdp_ucx_t *u = m->ucx;
  if (m->prev)
    m->prev->next = m->next;
  else
    u->mems = m->next;
  if (m->next)
    m->next->prev = m->prev;
  ucp_mem_unmap(u->ctx, m->memh);
  free(m);
}

void fsdp_ucx_cancel(fsdp_ucx_req_t *req) {
  if (!req->done && req->ucp_req && req->is_recv)
    ucp_request_cancel(req->ucx->worker, req->ucp_req);
}

/* ---- Peers ---- */

static void ep_close_cb(void *request, ucs_status_t st, void *user_data) {
  (void)st;
  fsdp_ucx_t *u = user_data;
  ucp_request_free(request);
  u->ep_closes--;
  schedule(u);
}

/* Closes the endpoint without waiting for the other end, which completes every send on it
 * (UCS_ERR_CANCELED), and cancels the receives attributed to the peer. Not from inside a
 * ucp callback. UCX refuses that close (UCS_ERR_INVALID_PARAM, doing nothing) for an
 * endpoint without peer error handling, the shared-memory one: its sends queued behind the
 * peer's full FIFO end only when the peer takes them, or with the worker. Those sends are
 * from copies (send_bounced), so their requests end here at once and UCX keeps the copies. */
static void peer_close_now(fsdp_ucx_peer_t *p) {
  fsdp_ucx_t *u = p->ucx;
  p->needs_close = false;
  if (p->ep) {
    ucp_ep_h ep = p->ep;
    p->ep = NULL;
    ucp_request_param_t rp = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                        UCP_OP_ATTR_FIELD_USER_DATA,
        .flags = UCP_EP_CLOSE_FLAG_FORCE,
        .cb.send = ep_close_cb,
        .user_data = u,
    };
    ucs_status_ptr_t sp = ucp_ep_close_nbx(ep, &rp);
    if (UCS_PTR_IS_PTR(sp))
      u->ep_closes++;
  }
  int status = u->closing ? FSDP_E_CANCELLED : FSDP_E_UNAVAILABLE;
  for (fsdp_ucx_req_t *r = p->pending, *next; r; r = next) {
    next = r->next;
    if (r->bounce)
      complete(r, status);
  }
  /* Each cancel may complete (and unlink) that request only, so walk from the head again
   * after each one; requests already asked are skipped through their flag. */
  for (;;) {
    fsdp_ucx_req_t *r = p->pending;
    while (r && (!r->is_recv || !r->ucp_req || r->status == FSDP_E_CANCELLED))
      r = r->next;
    if (!r)
      break;
    r->status = FSDP_E_CANCELLED; /* asked; the outcome comes through recv_cb */
    ucp_request_cancel(u->worker, r->ucp_req);
  }
  schedule(u);
}

static void peer_notify(fsdp_ucx_peer_t *p) {
  fsdp_ucx_t *u = p->ucx;
  p->needs_notify = false;
  if (u->opt.on_peer_failed && !u->closing)
    u->opt.on_peer_failed(p, u->opt.arg);
}

static void err_handler(void *arg, ucp_ep_h ep, ucs_status_t st) {
  (void)ep;
  fsdp_ucx_peer_t *p = arg;
  if (!p->failed) {
    peer_mark_failed(p, ucs_status_string(st));
    p->needs_close = true;
  }
  schedule(p->ucx);
}

void fsdp_ucx_peer_fail(fsdp_ucx_peer_t *peer, const char *reason) {
  if (peer->failed && !peer->needs_close && !peer->ep)
    return;
  peer_mark_failed(peer, reason ? reason : "disconnected");
  peer_close_now(peer);
}

const char *fsdp_ucx_peer_label(const fsdp_ucx_peer_t *peer) {
  return peer->label;
}

bool fsdp_ucx_peer_has_err_handling(const fsdp_ucx_peer_t *peer) {
  return peer->err_handling;
}

const char *fsdp_ucx_peer_error(const fsdp_ucx_peer_t *peer) {
  return peer->failed ? peer->error : NULL;
}

unsigned fsdp_ucx_peer_pending(const fsdp_ucx_peer_t *peer) {
  return peer->n_pending;
}

uv_loop_t *fsdp_ucx_loop(const fsdp_ucx_t *ucx) {
  return ucx->loop;
}

void fsdp_ucx_address(const fsdp_ucx_t *ucx, const void **ret_bytes, size_t *ret_len) {
  *ret_bytes = ucx->addr;
  *ret_len = ucx->addr_len;
}

int fsdp_ucx_connect(fsdp_ucx_t *u, const void *address, size_t len, const char *label,
                     fsdp_ucx_peer_t **ret_peer, fsdp_status_t *st) {
  const unsigned char *a = address;
  if (!label)
    label = "peer";
  int r = fsdp_ucx_address_check(address, len, label, st);
  if (r < 0)
    return r;
  if (u->closing)
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "connecting %s: the transport is closing",
                           label);

  fsdp_ucx_peer_t *p = calloc(1, sizeof *p);
  if (!p)
    return fsdp_status_set(st, -ENOMEM, "connecting %s: out of memory", label);
  p->ucx = u;
  snprintf(p->label, sizeof p->label, "%s", label);
  /* AUTO tries peer error handling first and goes without it only where UCX cannot offer
   * it (shared memory alone). Going without it over tcp is avoided: closing such an
   * endpoint without waiting, the only way to end a transfer to a peer that stopped, is
   * undefined in UCX then, and crashed the other end here. */
  bool peer_mode = u->opt.err_mode != FSDP_UCX_ERR_NONE;
  ucs_status_t s;
  for (;;) {
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .address = (const ucp_address_t *)(a + FSDP_UCX_ADDRESS_HEADER_BYTES),
        .err_mode = peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE,
    };
    if (peer_mode) {
      ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.err_handler.cb = err_handler;
      ep.err_handler.arg = p;
    }
    s = ucp_ep_create(u->worker, &ep, &p->ep);
    if (s == UCS_ERR_UNREACHABLE && peer_mode && u->opt.err_mode == FSDP_UCX_ERR_AUTO) {
      peer_mode = false;
      continue;
    }
    break;
  }
  p->err_handling = peer_mode;
  if (s != UCS_OK) {
    free(p);
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "connecting %s (%s error handling): %s%s",
                           label, peer_mode ? "peer" : "no", ucs_status_string(s),
                           peer_mode && s == UCS_ERR_UNREACHABLE
                               ? " (shared-memory transports cannot report a peer's failure)"
                               : "");
  }
  p->next = u->peers;
  u->peers = p;
  schedule(u);
  *ret_peer = p;
  return 0;
}

/* ---- The loop ---- */

static void run_queued(fsdp_ucx_t *u) {
  for (fsdp_ucx_peer_t *p = u->peers; p; p = p->next)
    if (p->needs_close)
      peer_close_now(p);
  while (u->done_head) {
    fsdp_ucx_req_t *r = u->done_head;
    u->done_head = r->next;
    if (!u->done_head)
      u->done_tail = NULL;
    r->next = NULL;
    r->peer->n_pending--;
    r->cb(r, r->status);
  }
  for (fsdp_ucx_peer_t *p = u->peers; p; p = p->next)
    if (p->needs_notify)
      peer_notify(p);
}

static bool has_queued(const fsdp_ucx_t *u) {
  if (u->done_head)
    return true;
  for (const fsdp_ucx_peer_t *p = u->peers; p; p = p->next)
    if (p->needs_close || p->needs_notify)
      return true;
  return false;
}

static void finish_close(fsdp_ucx_t *u);

#define MAX_IDLE_BUSY 64

static void drive(fsdp_ucx_t *u) {
  if (u->driving || u->destroyed)
    return;
  u->driving = true;
  /* Rounds in a row in which progress did nothing and the worker still would not arm. */
  unsigned idle_busy = 0;
  for (;;) {
    u->again = false;
    unsigned progressed = 0;
    while (ucp_worker_progress(u->worker))
      progressed++;
    if (has_queued(u)) {
      run_queued(u);
      idle_busy = 0;
      continue;
    }
    if (u->again)
      continue;
    /* Closing, with nothing of ours queued and every endpoint's close done: what the worker
     * still holds (sends stuck behind a dead shared-memory peer's FIFO keep it BUSY for
     * good) ends with it, so the close need not wait for it to arm. */
    if (u->closing && !u->ep_closes)
      break;
    ucs_status_t st = ucp_worker_arm(u->worker);
    if (st == UCS_OK)
      break;
    idle_busy = progressed ? 0 : idle_busy + 1;
    if (st != UCS_ERR_BUSY || idle_busy >= MAX_IDLE_BUSY) {
      /* Cannot sleep on the fd: poll from the idle handle instead (slower, still correct).
       * A worker can stay BUSY with nothing to progress (a dead peer's socket event over
       * tcp, seen under ASan): going back to the loop lets its timers run, so the
       * collectives' deadlines still end what waits on that peer. */
      u->driving = false;
      schedule(u);
      return;
    }
  }
  u->driving = false;
  if (u->closing)
    finish_close(u);
}

static void on_poll(uv_poll_t *h, int status, int events) {
  (void)status;
  (void)events;
  drive(h->data);
}

static void on_idle(uv_idle_t *h) {
  fsdp_ucx_t *u = h->data;
  uv_idle_stop(h);
  u->idle_started = false;
  drive(u);
}

/* ---- Creation and close ---- */

static void destroy_ucp(fsdp_ucx_t *u) {
  if (u->addr)
    free(u->addr);
  u->addr = NULL;
  if (u->worker)
    ucp_worker_destroy(u->worker);
  u->worker = NULL;
  while (u->mems)
    fsdp_ucx_mem_deregister(u->mems);
  if (u->ctx)
    ucp_cleanup(u->ctx);
  u->ctx = NULL;
}

int fsdp_ucx_new(uv_loop_t *loop, const fsdp_ucx_options_t *options, fsdp_ucx_t **ret_ucx,
                 fsdp_status_t *st) {
  fsdp_ucx_t *u = calloc(1, sizeof *u);
  if (!u)
    return fsdp_status_set(st, -ENOMEM, "UCX transport: out of memory");
  u->loop = loop;
  if (options)
    u->opt = *options;

  ucp_config_t *cfg;
  ucs_status_t s = ucp_config_read(NULL, NULL, &cfg);
  if (s != UCS_OK) {
    free(u);
    return fsdp_status_set(st, FSDP_E_CONFIG, "UCX configuration (UCX_* variables): %s",
                           ucs_status_string(s));
  }
  /* UCX's tcp transport moves a large message in segments of UCX_TCP_TX_SEG_SIZE (8 KiB by
   * default), one send call and one progress round each, and receives into 64 KiB ones.
   * Bulk transfers between daemons want far fewer, larger calls: 512 KiB segments doubled
   * UCX's own tcp bandwidth (ucx_perftest tag_bw) and made the ring 1.5-1.7x faster where we
   * measured (docs/PERFORMANCE.md, "Collectives between hosts"); the price is larger buffer
   * pools (they grow 8 segments at a time) in a worker that uses tcp. A value set in the
   * environment wins. Its sockets' buffers are left to the kernel's autotuning, which starts
   * them small: asking for 8 MiB made the ring's tcp all-gather and reduce-scatter 10-15 %
   * faster where we measured, with net.core.[wr]mem_max at 4 MiB. A size set on a socket
   * turns autotuning off and is capped at those limits, so where they are left at a
   * distribution's default (about 208 KiB) links between hosts get less than autotuning
   * would give them: raise the limits with the buffers (docs/PERFORMANCE.md). The names are
   * given without the transport's prefix, as ucp hands them on to every transport's
   * settings; only tcp's transport and its connection manager have these. */
  static const struct {
    const char *env, *name, *value;
  } tuning[] = {{"UCX_TCP_TX_SEG_SIZE", "TX_SEG_SIZE", "512k"},
                {"UCX_TCP_RX_SEG_SIZE", "RX_SEG_SIZE", "512k"},
                {"UCX_TCP_SNDBUF", "SNDBUF", "8m"},
                {"UCX_TCP_RCVBUF", "RCVBUF", "8m"}};
  for (size_t i = 0; i < sizeof tuning / sizeof tuning[0]; i++)
    if (!getenv(tuning[i].env))
      ucp_config_modify(cfg, tuning[i].name, tuning[i].value);
  ucp_params_t p = {
      .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
      .features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP,
      .name = "fsdpd",
  };
  s = ucp_init(&p, cfg, &u->ctx);
  ucp_config_release(cfg);
  int code;
  const char *what;
  if (s != UCS_OK) {
    what = "ucp_init";
    goto fail_ucp;
  }
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  s = ucp_worker_create(u->ctx, &wp, &u->worker);
  if (s != UCS_OK) {
    what = "ucp_worker_create";
    goto fail_ucp;
  }
  ucp_address_t *ua;
  size_t ua_len;
  s = ucp_worker_get_address(u->worker, &ua, &ua_len);
  if (s != UCS_OK) {
    what = "ucp_worker_get_address";
    goto fail_ucp;
  }
  u->addr_len = FSDP_UCX_ADDRESS_HEADER_BYTES + ua_len;
  u->addr = malloc(u->addr_len);
  if (!u->addr) {
    ucp_worker_release_address(u->worker, ua);
    code = fsdp_status_set(st, -ENOMEM, "UCX transport: out of memory");
    goto fail;
  }
  fsdp_ucx_address_pack_header(ua_len, u->addr);
  memcpy(u->addr + FSDP_UCX_ADDRESS_HEADER_BYTES, ua, ua_len);
  ucp_worker_release_address(u->worker, ua);

  int efd;
  s = ucp_worker_get_efd(u->worker, &efd);
  if (s != UCS_OK) {
    what = "ucp_worker_get_efd";
    goto fail_ucp;
  }
  int r = uv_poll_init(loop, &u->poll, efd);
  if (r < 0) {
    code = fsdp_status_set(st, r, "UCX transport: watching the worker's event fd %d: %s", efd,
                           uv_strerror(r));
    goto fail;
  }
  uv_idle_init(loop, &u->idle);
  u->poll.data = u->idle.data = u;
  u->handles_open = 2;
  uv_poll_start(&u->poll, UV_READABLE, on_poll);
  u->poll_started = true;
  schedule(u); /* the first arm */
  *ret_ucx = u;
  return 0;

fail_ucp:
  code = fsdp_status_set(st, FSDP_E_UNAVAILABLE, "UCX transport: %s: %s", what,
                         ucs_status_string(s));
fail:
  destroy_ucp(u);
  free(u);
  return code;
}

static void on_handle_closed(uv_handle_t *h) {
  fsdp_ucx_t *u = h->data;
  if (--u->handles_open > 0)
    return;
  void (*cb)(void *) = u->close_cb;
  void *arg = u->close_arg;
  free(u);
  if (cb)
    cb(arg);
}

/* The last step of a close, from drive() when no callback is queued. Requests UCX still
 * holds after every endpoint was closed and every receive cancelled (a receive that was
 * being filled when its sender stopped) end with the worker, which is destroyed first so
 * that nothing touches their buffers after their callbacks. */
static void finish_close(fsdp_ucx_t *u) {
  if (u->destroyed)
    return;
  u->destroyed = true;
  ucp_worker_progress(u->worker);
  if (u->poll_started)
    uv_poll_stop(&u->poll);
  if (u->idle_started)
    uv_idle_stop(&u->idle);
  for (fsdp_ucx_peer_t *p = u->peers; p; p = p->next)
    for (fsdp_ucx_req_t *r = p->pending; r; r = r->next)
      r->ucp_req = NULL; /* freed with the worker */
  destroy_ucp(u);
  while (u->bounces) /* the copies of sends UCX never let go of */
    bounce_free(u->bounces);
  for (fsdp_ucx_peer_t *p = u->peers; p; p = p->next)
    while (p->pending) {
      fsdp_ucx_req_t *r = p->pending;
      r->status = FSDP_E_CANCELLED;
      r->done = true;
      pending_unlink(r);
      r->next = NULL;
      if (u->done_tail)
        u->done_tail->next = r;
      else
        u->done_head = r;
      u->done_tail = r;
    }
  while (u->done_head) {
    fsdp_ucx_req_t *r = u->done_head;
    u->done_head = r->next;
    if (!u->done_head)
      u->done_tail = NULL;
    r->next = NULL;
    r->peer->n_pending--;
    r->cb(r, r->status);
  }
  while (u->peers) {
    fsdp_ucx_peer_t *p = u->peers;
    u->peers = p->next;
    free(p);
  }
  uv_close((uv_handle_t *)&u->poll, on_handle_closed);
  uv_close((uv_handle_t *)&u->idle, on_handle_closed);
}

void fsdp_ucx_close(fsdp_ucx_t *u, void (*cb)(void *arg), void *arg) {
  if (!u || u->closing)
    return;
  u->closing = true;
  u->close_cb = cb;
  u->close_arg = arg;
  for (fsdp_ucx_peer_t *p = u->peers; p; p = p->next) {
    peer_mark_failed(p, "the transport is closing");
    p->needs_notify = false;
    peer_close_now(p);
  }
  /* Endpoint closes UCX did not finish at once complete in progress; drive() finishes the
   * close once the queue is empty. */
  schedule(u);
}
