/* Chunked, pipelined ring collectives over fsdp_ucx_t.
 *
 * A collective is T steps of one region each (n - 1 for all-gather and reduce-scatter,
 * 2(n - 1) for all-reduce), and each step is C chunks, so it moves T * C units, unit
 * u = t * C + k. Both directions walk the units in that one order: receives are posted in
 * it and sends are started in it, each with at most `window` in flight, and the send of
 * (t, k) waits only for the arrival (and sum) of (t - 1, k), or at t = 0 for this member's
 * produce of the chunk. Because the left neighbour sends in the order this member posts its
 * receives, the oldest send of any member always has its receive posted or about to be (the
 * receiver's slots are held only by earlier units, which have arrived and are being summed
 * or finalized, or wait for a produce, which depends on nothing the ring does), so the ring
 * cannot deadlock however the window is set.
 *
 * The tags and the control frame between members are defined in proto/host/formats.h. */
#include "collectives/ring.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/host/formats.h"

#define DEFAULT_CHUNK ((size_t)1 << 20)
#define DEFAULT_WINDOW 8u
/* Chunks produced at once on the thread pool: enough to keep its threads busy. */
#define LOCAL_WINDOW 4u
#define MAX_WINDOW 64u
#define MAX_CHUNKS FSDP_RING_TAG_CHUNKS
/* How long members waiting in a chain have to pass the name of the one they all wait for,
 * and how long transfers get to end after a failure before the neighbour is given up. */
#define GRACE_MS 50
#define DRAIN_MS 200

#define CTRL_SLOTS 4
#define NONE (-1)
/* Every step's tag and every member's index fit the tags and the control frame. */
_Static_assert(2 * (FSDP_RING_MAX - 1) < FSDP_RING_TAG_STEPS, "a step outside the data tags");
_Static_assert(FSDP_RING_MAX < FSDP_RING_FRAME_NOBODY, "a member outside the control frame");
enum { UNIT_RECV_DONE = 1 };

typedef struct xfer {
  fsdp_ucx_req_t req;
  fsdp_ring_t *ring;
  uv_work_t work;
  void *staging;
  char *dst;
  size_t unit, bytes;
  unsigned region; /* received chunks: where they go */
  int result;      /* of the work on the thread pool */
  const char *failed;
  /* final: the chunk holds its result once received (and added): finalize it.
   * add_waiting: arrived, but this member has not produced its part of the chunk yet. */
  bool busy, in_ucx, in_work, final, add_waiting;
} xfer_t;

/* A chunk this member makes itself: its produce, then its finalize if it is final then. */
typedef struct local_work {
  uv_work_t work;
  fsdp_ring_t *ring;
  unsigned region;
  size_t chunk;
  int result;
  const char *failed;
  bool busy, final;
} local_work_t;

typedef struct ctrl_slot {
  fsdp_ucx_req_t req;
  fsdp_ring_t *ring;
  fsdp_ucx_peer_t *peer;
  uint8_t msg[FSDP_RING_FRAME_BYTES];
  bool busy;
} ctrl_slot_t;

struct fsdp_ring {
  fsdp_ucx_t *ucx;
  uv_loop_t *loop;
  fsdp_ring_args_t a;
  fsdp_ucx_peer_t *peers[FSDP_RING_MAX];
  unsigned left, right;
  fsdp_ring_cb cb;
  void *cb_arg;
  size_t es, chunk, n_chunks, units;
  unsigned steps, window;
  uint64_t start_ms;
  uint8_t *state;
  size_t next_recv, next_send, recvs_done, sends_done;
  uint64_t bytes_sent; /* of the chunks whose send completed */
  xfer_t *rx, *tx;
  /* Chunks this member makes itself, in the order of local_regions; produced[region * n_chunks
   * + chunk] once made (with a produce hook only). */
  unsigned local_regions[FSDP_RING_MAX], n_local_regions;
  size_t local_units, next_local, locals_done;
  uint8_t *produced;
  local_work_t locals[LOCAL_WINDOW];
  void *scratch_owned;
  fsdp_ucx_req_t ctrl_rx;
  uint8_t ctrl_in[FSDP_RING_FRAME_BYTES];
  bool ctrl_rx_busy;
  ctrl_slot_t ctrl_tx[CTRL_SLOTS];
  unsigned reqs_out, works_out;
  uv_timer_t deadline, aux;
  int handles_open;
  bool failed, succeeded, timing_out, finished;
  int reported_culprit, timeout_culprit;
  fsdp_status_t status;
};

static void pump(fsdp_ring_t *r);
static void maybe_finish(fsdp_ring_t *r);

const char *fsdp_ring_kind_name(fsdp_ring_kind_t kind) {
  switch (kind) {
  case FSDP_RING_ALL_GATHER:
    return "all-gather";
  case FSDP_RING_REDUCE_SCATTER:
    return "reduce-scatter";
  case FSDP_RING_ALL_REDUCE:
    return "all-reduce";
  }
  return "invalid collective";
}

/* ---- The schedule ---- */

static unsigned mod_n(const fsdp_ring_t *r, long v) {
  long n = (long)r->a.n;
  return (unsigned)(((v % n) + n) % n);
}

static bool step_is_reduce(const fsdp_ring_t *r, unsigned t) {
  return r->a.kind == FSDP_RING_REDUCE_SCATTER ||
         (r->a.kind == FSDP_RING_ALL_REDUCE && t < r->a.n - 1);
}

/* Reduce-scatter step t: send region i-t-1 (the partial sum received at t-1, plus ours),
 * receive region i-t-2; the last receive is region i. All-gather step t: send region i-t
 * (ours at t = 0, the one received at t-1 after), receive region i-t-1. */
static unsigned send_region(const fsdp_ring_t *r, unsigned t) {
  long i = r->a.self;
  if (step_is_reduce(r, t))
    return mod_n(r, i - (long)t - 1);
  long g = r->a.kind == FSDP_RING_ALL_REDUCE ? (long)t - (long)(r->a.n - 1) : (long)t;
  return mod_n(r, i - g);
}

static unsigned recv_region(const fsdp_ring_t *r, unsigned t) {
  return mod_n(r, (long)send_region(r, t) - 1);
}

static char *unit_ptr(const fsdp_ring_t *r, unsigned region, size_t k) {
  return (char *)r->a.buf + region * r->a.region_bytes + k * r->chunk;
}

static size_t unit_bytes(const fsdp_ring_t *r, size_t k) {
  size_t off = k * r->chunk;
  return r->a.region_bytes - off < r->chunk ? r->a.region_bytes - off : r->chunk;
}

static uint64_t data_tag(const fsdp_ring_t *r, unsigned t, size_t k) {
  return fsdp_ring_tag_data(r->a.op_id, t, (uint32_t)k);
}

static const char *label_of(const fsdp_ring_t *r, unsigned j) {
  if (j == r->a.self)
    return "this member";
  return r->peers[j] ? fsdp_ucx_peer_label(r->peers[j]) : "not connected here";
}

/* ---- Failure ---- */

static void ctrl_send(fsdp_ring_t *r, unsigned to, unsigned kind, int culprit, int code,
                      const char *text);
static void on_aux(uv_timer_t *h);

static void cancel_all(fsdp_ring_t *r) {
  for (unsigned w = 0; w < r->window; w++) {
    xfer_t *x = &r->rx[w];
    if (x->in_ucx)
      fsdp_ucx_cancel(&x->req);
    if (x->in_work)
      uv_cancel((uv_req_t *)&x->work);
    if (x->add_waiting)
      x->add_waiting = x->busy = false;
  }
  for (unsigned w = 0; w < LOCAL_WINDOW; w++)
    if (r->locals[w].busy)
      uv_cancel((uv_req_t *)&r->locals[w].work);
  if (r->ctrl_rx_busy)
    fsdp_ucx_cancel(&r->ctrl_rx);
}

/* Records the first failure, tells the neighbours (all but `from`, which told us), and
 * starts ending every transfer. */
__attribute__((format(printf, 4, 5))) static void ring_fail(fsdp_ring_t *r, int code, int from,
                                                            const char *fmt, ...) {
  if (r->failed || r->succeeded || r->finished)
    return;
  r->failed = true;
  char what[FSDP_STATUS_MESSAGE_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  fsdp_status_set(&r->status, code, "%s op %u (member %u of %u): %s",
                  fsdp_ring_kind_name(r->a.kind), r->a.op_id, r->a.self, r->a.n, what);
  uv_timer_stop(&r->deadline);
  if (r->a.n > 1) {
    if ((int)r->left != from)
      ctrl_send(r, r->left, FSDP_RING_FRAME_ABORT, NONE, code, r->status.message);
    if (r->right != r->left && (int)r->right != from)
      ctrl_send(r, r->right, FSDP_RING_FRAME_ABORT, NONE, code, r->status.message);
  }
  cancel_all(r);
  uv_timer_stop(&r->aux);
  uv_timer_start(&r->aux, on_aux, DRAIN_MS, 0);
  maybe_finish(r);
}

/* A failed data or control request, as a failure of the collective naming the peer. */
static void fail_request(fsdp_ring_t *r, int status, unsigned member, const char *what,
                         unsigned t, size_t k, size_t got, size_t want) {
  fsdp_ucx_peer_t *p = r->peers[member];
  if (status == FSDP_E_CANCELLED) {
    /* Ours after a failure; otherwise the transport is closing under the collective. */
    ring_fail(r, FSDP_E_CANCELLED, NONE, "the UCX transport closed during the %s of step %u",
              what, t);
  } else if (status == FSDP_E_DATA_LOSS) {
    ring_fail(r, FSDP_E_DATA_LOSS, NONE,
              "member %u (%s) sent %zu bytes for step %u chunk %zu, expected %zu", member,
              label_of(r, member), got, t, k, want);
  } else {
    const char *why = p ? fsdp_ucx_peer_error(p) : NULL;
    ring_fail(r, status, NONE, "member %u (%s) failed during the %s of step %u chunk %zu: %s",
              member, label_of(r, member), what, t, k, why ? why : fsdp_strerror(status));
  }
}

/* A produce, finalize or sum that returned an error. */
static void fail_work(fsdp_ring_t *r, const char *what, unsigned region, size_t chunk,
                      int result) {
  size_t off = chunk * r->chunk;
  ring_fail(r, FSDP_E_INTERNAL, NONE, "the %s of region %u bytes %zu..%zu failed: %s", what,
            region, off, off + unit_bytes(r, chunk), strerror(-result));
}

/* ---- Control messages ---- */

static void on_ctrl_sent(fsdp_ucx_req_t *req, int status) {
  (void)status; /* best effort: a neighbour that cannot hear it fails on its own */
  ctrl_slot_t *s = req->data;
  fsdp_ring_t *r = s->ring;
  s->busy = false;
  r->reqs_out--;
  maybe_finish(r);
}

static void ctrl_send(fsdp_ring_t *r, unsigned to, unsigned kind, int culprit, int code,
                      const char *text) {
  fsdp_ucx_peer_t *p = r->peers[to];
  if (!p || fsdp_ucx_peer_error(p))
    return;
  ctrl_slot_t *s = NULL;
  for (unsigned i = 0; i < CTRL_SLOTS && !s; i++)
    if (!r->ctrl_tx[i].busy)
      s = &r->ctrl_tx[i];
  if (!s)
    return;
  fsdp_ring_frame_t f = {.kind = (uint8_t)kind,
                         .sender = (uint8_t)r->a.self,
                         .culprit = (uint8_t)(culprit < 0 ? FSDP_RING_FRAME_NOBODY : culprit),
                         .code = code};
  snprintf(f.text, sizeof f.text, "%s", text ? text : "");
  fsdp_ring_frame_pack(&f, s->msg);
  s->ring = r;
  s->peer = p;
  s->req.data = s;
  if (fsdp_ucx_send(&s->req, p, s->msg, sizeof s->msg, NULL,
                    fsdp_ring_tag_control(r->a.op_id, r->a.self, kind), on_ctrl_sent) == 0) {
    s->busy = true;
    r->reqs_out++;
  }
}

static void on_ctrl(fsdp_ucx_req_t *req, int status);

static void post_ctrl_rx(fsdp_ring_t *r) {
  if (r->ctrl_rx_busy || r->failed || r->succeeded || r->a.n < 2)
    return;
  r->ctrl_rx.data = r;
  int rc = fsdp_ucx_recv(&r->ctrl_rx, r->peers[r->left], r->ctrl_in, sizeof r->ctrl_in, NULL,
                         fsdp_ring_tag_control(r->a.op_id, 0, 0), FSDP_RING_TAG_CONTROL_MASK,
                         on_ctrl);
  if (rc == 0) {
    r->ctrl_rx_busy = true;
    r->reqs_out++;
  } else {
    fail_request(r, rc, r->left, "control receive", 0, 0, 0, 0);
  }
}

static void on_ctrl(fsdp_ucx_req_t *req, int status) {
  fsdp_ring_t *r = req->data;
  r->ctrl_rx_busy = false;
  r->reqs_out--;
  if (status != 0) {
    if (!(status == FSDP_E_CANCELLED && (r->failed || r->succeeded)))
      fail_request(r, status, r->left, "control receive", 0, 0, req->received,
                   sizeof r->ctrl_in);
    maybe_finish(r);
    return;
  }
  fsdp_ring_frame_t f;
  fsdp_status_t why;
  if (fsdp_ring_frame_unpack(r->ctrl_in, sizeof r->ctrl_in, &f, &why) < 0) {
    ring_fail(r, why.code, NONE, "%s", why.message);
    maybe_finish(r);
    return;
  }
  unsigned sender = f.sender, culprit = f.culprit;
  if (sender >= r->a.n || sender == r->a.self) {
    ring_fail(r, FSDP_E_PROTOCOL_VERSION, NONE,
              "control message from member %u, expected one from a member other than %u of %u",
              sender, r->a.self, r->a.n);
    maybe_finish(r);
    return;
  }
  if (f.kind == FSDP_RING_FRAME_ABORT) {
    int code = f.code;
    if (!fsdp_error_name(code))
      code = FSDP_E_ABORTED;
    ring_fail(r, code, (int)sender, "member %u (%s) ended it: %s", sender, label_of(r, sender),
              f.text);
  } else if (f.kind == FSDP_RING_FRAME_TIMEOUT && culprit < r->a.n && culprit != r->a.self) {
    /* The left neighbour waits for `culprit` as well: it is the one to name, and the member
     * on the right, which waits for us, learns it from us. */
    r->reported_culprit = (int)culprit;
    if (r->timing_out && r->timeout_culprit != (int)culprit) {
      r->timeout_culprit = (int)culprit;
      ctrl_send(r, r->right, FSDP_RING_FRAME_TIMEOUT, (int)culprit, FSDP_E_DEADLINE_EXCEEDED, "");
    }
  }
  post_ctrl_rx(r);
  maybe_finish(r);
}

/* ---- Timers ---- */

static void fail_timeout(fsdp_ring_t *r, int culprit, unsigned waiting_for) {
  uint64_t elapsed = uv_now(r->loop) - r->start_ms;
  char chain[160] = "";
  if (culprit != (int)waiting_for)
    snprintf(chain, sizeof chain, " (member %u (%s) was waiting for it too)", waiting_for,
             label_of(r, waiting_for));
  ring_fail(r, FSDP_E_DEADLINE_EXCEEDED, NONE,
            "deadline passed %llu ms after the start, waiting for member %u (%s)%s; %zu of %zu "
            "chunks received, %zu of %zu sent",
            (unsigned long long)elapsed, (unsigned)culprit, label_of(r, (unsigned)culprit), chain,
            r->recvs_done, r->units, r->sends_done, r->units);
}

static void on_deadline(uv_timer_t *h) {
  fsdp_ring_t *r = h->data;
  if (r->failed || r->succeeded || r->timing_out)
    return;
  bool recv_waiting = false, send_waiting = false, local_waiting = r->works_out > 0;
  for (unsigned w = 0; w < r->window; w++) {
    recv_waiting |= r->rx[w].in_ucx;
    send_waiting |= r->tx[w].in_ucx;
    local_waiting |= r->rx[w].add_waiting;
  }
  if (!recv_waiting && send_waiting && !local_waiting) {
    fail_timeout(r, (int)r->right, r->right);
    return;
  }
  if (!recv_waiting) { /* this member's own work is what is late */
    uint64_t elapsed = uv_now(r->loop) - r->start_ms;
    ring_fail(r, FSDP_E_DEADLINE_EXCEEDED, NONE,
              "deadline passed %llu ms after the start with %u local sums, produces or "
              "finalizes still running",
              (unsigned long long)elapsed, r->works_out);
    return;
  }
  int culprit = r->reported_culprit != NONE ? r->reported_culprit : (int)r->left;
  if (r->a.n <= 2) {
    fail_timeout(r, culprit, r->left);
    return;
  }
  r->timing_out = true;
  r->timeout_culprit = culprit;
  ctrl_send(r, r->right, FSDP_RING_FRAME_TIMEOUT, culprit, FSDP_E_DEADLINE_EXCEEDED, "");
  uv_timer_start(&r->aux, on_aux, GRACE_MS, 0);
}

/* The aux timer: the first pump, the end of the deadline grace, the end of the drain. */
static void on_aux(uv_timer_t *h) {
  fsdp_ring_t *r = h->data;
  if (r->timing_out && !r->failed) {
    fail_timeout(r, r->timeout_culprit, r->left);
    return;
  }
  if (r->failed) {
    /* Transfers still in flight: the neighbour does not answer. Failing its connection
     * completes them, which is the only way to get the memory back from UCX. */
    bool left_busy = r->ctrl_rx_busy, right_busy = false;
    for (unsigned w = 0; w < r->window; w++) {
      left_busy |= r->rx[w].in_ucx;
      right_busy |= r->tx[w].in_ucx;
    }
    for (unsigned i = 0; i < CTRL_SLOTS; i++)
      if (r->ctrl_tx[i].busy)
        fsdp_ucx_peer_fail(r->ctrl_tx[i].peer, "a collective with it failed and it did not "
                                                "take its messages within 200 ms");
    if (left_busy)
      fsdp_ucx_peer_fail(r->peers[r->left], "a collective with it failed and its transfers "
                                            "did not end within 200 ms");
    if (right_busy)
      fsdp_ucx_peer_fail(r->peers[r->right], "a collective with it failed and its transfers "
                                             "did not end within 200 ms");
    return;
  }
  pump(r);
}

/* ---- Data ---- */

static void on_recv(fsdp_ucx_req_t *req, int status);
static void on_sent(fsdp_ucx_req_t *req, int status);

/* Whether this member's own part of a chunk is there to be sent or added to. */
static bool local_ready(const fsdp_ring_t *r, unsigned region, size_t chunk) {
  return !r->a.produce || r->produced[region * r->n_chunks + chunk];
}

static void mark_arrived(fsdp_ring_t *r, size_t unit) {
  r->state[unit] |= UNIT_RECV_DONE;
  r->recvs_done++;
}

/* On a pool thread: a received chunk's sum into the buffer, then its finalize. */
static void xfer_work(uv_work_t *w) {
  xfer_t *x = w->data;
  fsdp_ring_t *r = x->ring;
  size_t chunk = x->unit % r->n_chunks;
  x->result = 0;
  if (x->staging) {
    x->failed = "sum";
    x->result = fsdp_add(x->dst, x->staging, r->a.dtype, x->bytes / r->es);
  }
  if (x->result == 0 && x->final) {
    x->failed = "finalize";
    x->result = r->a.finalize(r->a.hook_arg, x->region, chunk * r->chunk, x->bytes);
  }
}

static void after_xfer_work(uv_work_t *w, int status) {
  xfer_t *x = w->data;
  fsdp_ring_t *r = x->ring;
  x->in_work = false;
  x->busy = false;
  r->works_out--;
  if (status == 0 && x->result < 0)
    fail_work(r, x->failed, x->region, x->unit % r->n_chunks, x->result);
  else if (status == 0 && !r->failed && x->staging)
    mark_arrived(r, x->unit); /* a direct receive was marked when it arrived */
  pump(r);
}

static void start_xfer_work(fsdp_ring_t *r, xfer_t *x) {
  x->add_waiting = false;
  x->work.data = x;
  int rc = uv_queue_work(r->loop, &x->work, xfer_work, after_xfer_work);
  if (rc < 0) {
    x->busy = false;
    ring_fail(r, FSDP_E_INTERNAL, NONE, "cannot queue work on the thread pool: %s",
              uv_strerror(rc));
    return;
  }
  x->in_work = true;
  r->works_out++;
}

static void on_recv(fsdp_ucx_req_t *req, int status) {
  xfer_t *x = req->data;
  fsdp_ring_t *r = x->ring;
  x->in_ucx = false;
  r->reqs_out--;
  if (status != 0 || r->failed) {
    x->busy = false;
    if (status != 0 && !(status == FSDP_E_CANCELLED && r->failed))
      fail_request(r, status, r->left, "receive", (unsigned)(x->unit / r->n_chunks),
                   x->unit % r->n_chunks, req->received, x->bytes);
    maybe_finish(r);
    return;
  }
  if (x->staging) {
    /* The sum goes on once this member's own part of the chunk is made (pump). */
    if (local_ready(r, x->region, x->unit % r->n_chunks))
      start_xfer_work(r, x);
    else
      x->add_waiting = true;
  } else {
    mark_arrived(r, x->unit);
    if (x->final)
      start_xfer_work(r, x); /* the slot stays taken until the finalize returned */
    else
      x->busy = false;
  }
  pump(r);
}

/* On a pool thread: one chunk this member makes itself. */
static void local_work(uv_work_t *w) {
  local_work_t *l = w->data;
  fsdp_ring_t *r = l->ring;
  size_t off = l->chunk * r->chunk, bytes = unit_bytes(r, l->chunk);
  l->result = 0;
  if (r->a.produce) {
    l->failed = "produce";
    l->result = r->a.produce(r->a.hook_arg, l->region, off, bytes);
  }
  if (l->result == 0 && l->final) {
    l->failed = "finalize";
    l->result = r->a.finalize(r->a.hook_arg, l->region, off, bytes);
  }
}

static void after_local_work(uv_work_t *w, int status) {
  local_work_t *l = w->data;
  fsdp_ring_t *r = l->ring;
  l->busy = false;
  r->works_out--;
  if (status == 0 && l->result < 0) {
    fail_work(r, l->failed, l->region, l->chunk, l->result);
  } else if (status == 0 && !r->failed) {
    if (r->produced)
      r->produced[l->region * r->n_chunks + l->chunk] = 1;
    r->locals_done++;
  }
  pump(r);
}

/* The regions this member makes itself, in the order the ring needs them: its own for an
 * all-gather; for a sum, from the one it sends first (i - 1) down to its own, which it
 * receives last. Without a produce hook only the chunks that are final from the start need
 * local work, for their finalize. */
static void plan_local_work(fsdp_ring_t *r) {
  bool gather = r->a.kind == FSDP_RING_ALL_GATHER;
  if (gather && (r->a.produce || r->a.finalize)) {
    r->local_regions[0] = r->a.self;
    r->n_local_regions = 1;
  } else if (r->a.produce) {
    for (unsigned j = 0; j < r->a.n; j++)
      r->local_regions[j] = mod_n(r, (long)r->a.self - 1 - (long)j);
    r->n_local_regions = r->a.n;
  } else if (r->a.finalize && r->a.n == 1) {
    r->local_regions[0] = 0;
    r->n_local_regions = 1;
  }
  r->local_units = r->n_local_regions * r->n_chunks;
}

static void pump_local(fsdp_ring_t *r) {
  for (unsigned w = 0; w < LOCAL_WINDOW && !r->failed && r->next_local < r->local_units; w++) {
    local_work_t *l = &r->locals[w];
    if (l->busy)
      continue;
    size_t p = r->next_local;
    l->ring = r;
    l->region = r->local_regions[p / r->n_chunks];
    l->chunk = p % r->n_chunks;
    l->final = r->a.finalize && (r->a.kind == FSDP_RING_ALL_GATHER || r->a.n == 1);
    l->work.data = l;
    int rc = uv_queue_work(r->loop, &l->work, local_work, after_local_work);
    if (rc < 0) {
      ring_fail(r, FSDP_E_INTERNAL, NONE, "cannot queue work on the thread pool: %s",
                uv_strerror(rc));
      return;
    }
    l->busy = true;
    r->works_out++;
    r->next_local++;
  }
  for (unsigned w = 0; w < r->window && !r->failed; w++) {
    xfer_t *x = &r->rx[w];
    if (x->add_waiting && local_ready(r, x->region, x->unit % r->n_chunks))
      start_xfer_work(r, x);
  }
}

static void on_sent(fsdp_ucx_req_t *req, int status) {
  xfer_t *x = req->data;
  fsdp_ring_t *r = x->ring;
  x->in_ucx = false;
  x->busy = false;
  r->reqs_out--;
  if (status != 0) {
    if (!(status == FSDP_E_CANCELLED && r->failed))
      fail_request(r, status, r->right, "send", (unsigned)(x->unit / r->n_chunks),
                   x->unit % r->n_chunks, 0, 0);
  } else {
    r->sends_done++;
    r->bytes_sent += x->bytes;
  }
  pump(r);
}

static xfer_t *free_slot(xfer_t *slots, unsigned n) {
  for (unsigned w = 0; w < n; w++)
    if (!slots[w].busy)
      return &slots[w];
  return NULL;
}

static void pump(fsdp_ring_t *r) {
  pump_local(r);
  while (!r->failed && r->next_recv < r->units) {
    xfer_t *x = free_slot(r->rx, r->window);
    if (!x)
      break;
    size_t u = r->next_recv;
    unsigned t = (unsigned)(u / r->n_chunks);
    size_t k = u % r->n_chunks;
    x->unit = u;
    x->bytes = unit_bytes(r, k);
    x->region = recv_region(r, t);
    x->dst = unit_ptr(r, x->region, k);
    x->staging = step_is_reduce(r, t) ? (char *)r->a.scratch + (size_t)(x - r->rx) * r->chunk
                                      : NULL;
    /* The last sum step gives this member's own region its result; an all-gather's
     * chunks, and those of an all-reduce's second half, arrive final. */
    x->final = r->a.finalize && (r->a.kind == FSDP_RING_ALL_GATHER || t + 2 >= r->a.n);
    x->req.data = x;
    int rc = fsdp_ucx_recv(&x->req, r->peers[r->left], x->staging ? x->staging : x->dst,
                           x->bytes, x->staging ? r->a.scratch_mem : r->a.buf_mem,
                           data_tag(r, t, k), ~(uint64_t)0, on_recv);
    if (rc != 0) {
      fail_request(r, rc, r->left, "receive", t, k, 0, 0);
      break;
    }
    x->busy = x->in_ucx = true;
    r->reqs_out++;
    r->next_recv++;
  }
  while (!r->failed && r->next_send < r->units) {
    size_t u = r->next_send;
    unsigned t = (unsigned)(u / r->n_chunks);
    size_t k = u % r->n_chunks;
    if (t > 0 ? !(r->state[u - r->n_chunks] & UNIT_RECV_DONE)
              : !local_ready(r, send_region(r, 0), k))
      break;
    xfer_t *x = free_slot(r->tx, r->window);
    if (!x)
      break;
    x->unit = u;
    x->bytes = unit_bytes(r, k);
    x->req.data = x;
    int rc = fsdp_ucx_send(&x->req, r->peers[r->right], unit_ptr(r, send_region(r, t), k),
                           x->bytes, r->a.buf_mem, data_tag(r, t, k), on_sent);
    if (rc != 0) {
      fail_request(r, rc, r->right, "send", t, k, 0, 0);
      break;
    }
    x->busy = x->in_ucx = true;
    r->reqs_out++;
    r->next_send++;
  }
  if (!r->failed && !r->succeeded && r->recvs_done == r->units && r->sends_done == r->units &&
      r->locals_done == r->local_units && r->works_out == 0) {
    r->succeeded = true;
    uv_timer_stop(&r->deadline);
    if (r->ctrl_rx_busy)
      fsdp_ucx_cancel(&r->ctrl_rx);
  }
  maybe_finish(r);
}

uint64_t fsdp_ring_bytes_sent(const fsdp_ring_t *r) {
  return r->bytes_sent;
}

/* ---- Start and end ---- */

static void free_ring(fsdp_ring_t *r) {
  free(r->state);
  free(r->produced);
  free(r->rx);
  free(r->tx);
  free(r->scratch_owned);
  free(r);
}

static void on_closed(uv_handle_t *h) {
  fsdp_ring_t *r = h->data;
  if (--r->handles_open > 0)
    return;
  r->cb(r, &r->status, r->cb_arg);
  free_ring(r);
}

/* Ends the collective once nothing borrows its memory: no UCX request, no queued sum. */
static void maybe_finish(fsdp_ring_t *r) {
  if (r->finished || !(r->failed || r->succeeded) || r->reqs_out > 0 || r->works_out > 0)
    return;
  r->finished = true;
  uv_close((uv_handle_t *)&r->deadline, on_closed);
  uv_close((uv_handle_t *)&r->aux, on_closed);
}

void fsdp_ring_cancel(fsdp_ring_t *r) {
  if (r)
    ring_fail(r, FSDP_E_CANCELLED, NONE, "cancelled by the caller");
}

int fsdp_ring_start(fsdp_ucx_t *ucx, const fsdp_ring_args_t *args, fsdp_ring_cb cb, void *arg,
                    fsdp_ring_t **ret_ring, fsdp_status_t *st) {
  const fsdp_ring_args_t *a = args;
  const char *kind = fsdp_ring_kind_name(a->kind);
  if (!ucx || !cb)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "ring %s: no transport or callback",
                           kind);
  if (a->kind != FSDP_RING_ALL_GATHER && a->kind != FSDP_RING_REDUCE_SCATTER &&
      a->kind != FSDP_RING_ALL_REDUCE)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "ring collective kind %d is not one of "
                           "all-gather, reduce-scatter, all-reduce", (int)a->kind);
  if (a->n < 1 || a->n > FSDP_RING_MAX || a->self >= a->n)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "%s op %u: member %u of %u, expected 1..%u members and a member "
                           "below their count", kind, a->op_id, a->self, a->n, FSDP_RING_MAX);
  if (!fsdp_dtype_is_valid(a->dtype))
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "%s op %u: dtype %d is not fp32, bf16 "
                           "or fp16", kind, a->op_id, (int)a->dtype);
  size_t es = fsdp_dtype_size(a->dtype);
  if (a->region_bytes % es != 0 || (a->region_bytes > 0 && !a->buf) ||
      a->region_bytes > SIZE_MAX / a->n)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "%s op %u: region of %zu bytes (buffer %p), expected whole %s "
                           "elements in a buffer", kind, a->op_id, a->region_bytes, a->buf,
                           fsdp_dtype_name(a->dtype));
  unsigned left = (a->self + a->n - 1) % a->n, right = (a->self + 1) % a->n;
  if (a->n > 1 && (!a->peers || !a->peers[left] || !a->peers[right]))
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "%s op %u: member %u needs its neighbours %u and %u connected", kind,
                           a->op_id, a->self, left, right);
  size_t chunk = a->chunk_bytes ? a->chunk_bytes / es * es : DEFAULT_CHUNK;
  unsigned window = a->window ? a->window : DEFAULT_WINDOW;
  if (chunk == 0 || window > MAX_WINDOW)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "%s op %u: chunk of %zu bytes and window of %u, expected at least one "
                           "%s element and at most %u chunks", kind, a->op_id, a->chunk_bytes,
                           window, fsdp_dtype_name(a->dtype), MAX_WINDOW);
  size_t n_chunks = a->region_bytes == 0 ? 0 : (a->region_bytes + chunk - 1) / chunk;
  if (n_chunks >= MAX_CHUNKS)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "%s op %u: region of %zu bytes is %zu chunks of %zu, at most %zu",
                           kind, a->op_id, a->region_bytes, n_chunks, chunk, MAX_CHUNKS - 1);
  unsigned steps = a->n == 1 ? 0 : a->kind == FSDP_RING_ALL_REDUCE ? 2 * (a->n - 1) : a->n - 1;
  bool reduce = a->kind != FSDP_RING_ALL_GATHER && steps > 0 && n_chunks > 0;
  if (reduce && a->scratch && a->scratch_bytes < (size_t)window * chunk)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "%s op %u: scratch of %zu bytes, expected window %u x chunk %zu = %zu",
                           kind, a->op_id, a->scratch_bytes, window, chunk,
                           (size_t)window * chunk);

  fsdp_ring_t *r = calloc(1, sizeof *r);
  if (!r)
    return fsdp_status_set(st, -ENOMEM, "%s op %u: out of memory", kind, a->op_id);
  r->ucx = ucx;
  r->loop = fsdp_ucx_loop(ucx);
  r->a = *a;
  r->a.peers = NULL;
  for (unsigned j = 0; a->peers && j < a->n; j++)
    r->peers[j] = j == a->self ? NULL : a->peers[j];
  r->left = left;
  r->right = right;
  r->cb = cb;
  r->cb_arg = arg;
  r->es = es;
  r->chunk = chunk;
  r->window = window;
  r->n_chunks = n_chunks;
  r->steps = steps;
  r->units = (size_t)steps * n_chunks;
  r->reported_culprit = r->timeout_culprit = NONE;
  r->state = calloc(r->units ? r->units : 1, 1);
  r->rx = calloc(window, sizeof *r->rx);
  r->tx = calloc(window, sizeof *r->tx);
  plan_local_work(r);
  if (a->produce)
    r->produced = calloc(a->n * n_chunks + 1, 1);
  if (reduce && !a->scratch) {
    r->scratch_owned = malloc((size_t)window * chunk);
    r->a.scratch = r->scratch_owned;
  }
  if (!r->state || !r->rx || !r->tx || (reduce && !r->a.scratch) ||
      (a->produce && !r->produced)) {
    free_ring(r);
    return fsdp_status_set(st, -ENOMEM, "%s op %u: out of memory for %u chunks of %zu bytes",
                           kind, a->op_id, window, chunk);
  }
  for (unsigned w = 0; w < window; w++)
    r->rx[w].ring = r->tx[w].ring = r;
  uv_timer_init(r->loop, &r->deadline);
  uv_timer_init(r->loop, &r->aux);
  r->deadline.data = r->aux.data = r;
  r->handles_open = 2;
  r->start_ms = uv_now(r->loop);
  uint64_t now = r->start_ms;
  uv_timer_start(&r->deadline, on_deadline, a->deadline_ms > now ? a->deadline_ms - now : 0, 0);
  /* The first pump runs from the loop, so that the callback never runs inside this call. */
  uv_timer_start(&r->aux, on_aux, 0, 0);
  post_ctrl_rx(r);
  *ret_ring = r;
  return 0;
}
