/* A session's fast path: rings in a memfd, eventfd doorbells, operations to the data plane.
 * After traffic the loop looks at the request ring on each of its turns for a short while,
 * so that a trainer sending its next request then need not ring (proto/fastpath.h). */
#include "daemon/services/fastpath.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "daemon/services/unit_ops.h"
#include "proto/fastpath.h"

#define TRAINER_METHOD(name) "/fsdp.v1.Trainer/" name

/* How long the loop keeps polling a session's request ring after its last request or reply.
 * While it polls, libuv polls I/O without blocking, and the loop's thread spins: a trainer
 * that sends its next request within the window saves the daemon's wake-up, most of a round
 * trip; one that sends after a longer pause pays that wake-up as without the window, and an
 * idle daemon costs no CPU. */
#define POLL_WINDOW_NS 50000

/* Doorbells in a row with no request before the session's fast path stops. A trainer rings
 * only after it pushed a request, so it makes at most one or two in a row (a ring that races
 * the polling's last look); one that rings in a loop would otherwise hold the loop that
 * serves every other session. */
#define FRUITLESS_TURNS_MAX 64

/* An operation the data plane holds; its storage, until it is called back or cancelled. */
typedef struct fast_op {
  fsdp_fastpath_t *fp;
  bool busy;
  uint64_t seq;
  const char *method; /* prefixes its messages, as a gRPC handler's */
  fsdp_dataplane_op_t op;
} fast_op_t;

struct fsdp_fastpath {
  fsdp_services_context_t *ctx;
  fsdp_session_t *session;
  fsdp_fast_region_t *region;
  size_t bytes;
  int region_fd;
  int daemon_bell; /* the trainer writes it; the loop polls it */
  int trainer_bell;
  uv_poll_t poll;
  uv_idle_t idle;         /* active while the loop polls the request ring */
  bool polls;             /* whether it does, after a request: only with a CPU to spare */
  uint64_t poll_until_ns; /* fsdp_clock_now_ns() time */
  unsigned open_handles;  /* the last one's close callback frees the fast path */
  unsigned busy; /* ops in flight */
  unsigned fruitless; /* turns in a row that served nothing */
  char misused[160]; /* why the fast path stops, set by a turn; empty while used right */
  bool stopped;      /* misused: neither the doorbell nor the ring is looked at again */
  uint64_t dropped; /* replies that found no room, logged the first time and at the end */
  fast_op_t ops[FSDP_FASTPATH_ENTRIES];
};

static void on_poll_turn(uv_idle_t *handle);

/* Polls the request ring for POLL_WINDOW_NS from now, and says so to the trainer. */
static void keep_polling(fsdp_fastpath_t *fp) {
  if (!fp->polls || fp->stopped)
    return;
  fp->poll_until_ns = fsdp_clock_now_ns() + POLL_WINDOW_NS;
  if (uv_is_active((uv_handle_t *)&fp->idle))
    return;
  atomic_store_explicit(&fp->region->daemon_polling, 1, memory_order_relaxed);
  uv_idle_start(&fp->idle, on_poll_turn);
}

/* Rings the trainer if it sleeps. The fence pairs with the trainer's between setting
 * trainer_sleeping and its last look at the replies: one of the two sees the other. */
static void ring_trainer(fsdp_fastpath_t *fp) {
  atomic_thread_fence(memory_order_seq_cst);
  if (!atomic_load_explicit(&fp->region->trainer_sleeping, memory_order_relaxed))
    return;
  uint64_t one = 1;
  /* Fails only when the counter would overflow, which leaves it readable anyway. */
  (void)!write(fp->trainer_bell, &one, sizeof one);
}

/* Replies to seq. There is room: a request is taken only while its reply would fit. */
static void reply(fsdp_fastpath_t *fp, uint64_t seq, const char *method, const fsdp_status_t *st,
                  const fsdp_dataplane_lent_t *lent) {
  int slot = fsdp_fast_ring_slot(&fp->region->replies_ring);
  if (slot < 0) { /* once per session: a trainer that never reads would fill the log */
    if (fp->dropped++ == 0)
      log_warning("session %016llx: fast path reply to %llu dropped: the trainer consumes "
                  "none (further drops are counted, and logged when the session ends)",
                  (unsigned long long)fp->session->id, (unsigned long long)seq);
    return;
  }
  fsdp_fast_reply_t *r = &fp->region->replies[slot];
  memset(r, 0, offsetof(fsdp_fast_reply_t, message));
  r->seq = seq;
  r->code = st->code;
  r->message[0] = '\0';
  if (st->code < 0) { /* "method: message", cut at the end as gRPC's details would be */
    int n = snprintf(r->message, sizeof r->message, "%s: ", method);
    snprintf(r->message + n, sizeof r->message - (size_t)n, "%s", st->message);
  }
  if (lent && st->code == 0) {
    r->unsharded_memory = lent->unsharded_in_masters ? 0 : 1;
    r->unsharded_offset = lent->unsharded_offset;
    r->full_grad_offset = lent->full_grad_offset;
    r->full_grad_bytes = lent->full_grad_bytes;
  }
  fsdp_fast_ring_push(&fp->region->replies_ring);
  ring_trainer(fp);
}

static void on_op_done(void *data, const fsdp_status_t *st) {
  fast_op_t *o = data;
  fsdp_fastpath_t *fp = o->fp;
  reply(fp, o->seq, o->method, st, &o->op.lent);
  keep_polling(fp); /* a trainer answered often asks again soon */
  o->busy = false;
  fp->busy--;
  fsdp_session_call_ended(fp->session, uv_now(fp->ctx->loop));
}

static fast_op_t *free_op(fsdp_fastpath_t *fp) {
  for (size_t i = 0; i < FSDP_FASTPATH_ENTRIES; i++)
    if (!fp->ops[i].busy)
      return &fp->ops[i];
  return NULL;
}

/* Returns whether seq was in flight. */
static bool cancel(fsdp_fastpath_t *fp, uint64_t seq) {
  for (size_t i = 0; i < FSDP_FASTPATH_ENTRIES; i++) {
    fast_op_t *o = &fp->ops[i];
    if (o->busy && o->seq == seq) {
      fsdp_dataplane_cancel(&o->op);
      fsdp_status_t st;
      fsdp_status_set(&st, FSDP_E_CANCELLED, "the trainer gave up waiting");
      on_op_done(o, &st);
      return true;
    }
  }
  return false;
}

static const char *method_of(uint8_t kind) {
  switch (kind) {
  case FSDP_FAST_UNSHARD:
    return TRAINER_METHOD("Unshard");
  case FSDP_FAST_RESHARD:
    return TRAINER_METHOD("Reshard");
  case FSDP_FAST_REDUCE_SCATTER:
    return TRAINER_METHOD("ReduceScatter");
  case FSDP_FAST_ALL_REDUCE:
    return TRAINER_METHOD("AllReduce");
  default:
    return "fast path";
  }
}

/* Runs one request as its gRPC handler would, answering it now or from the data plane.
 * Returns whether it served it: handed it to the data plane, or resharded; a refusal, which
 * a correct trainer does not provoke over and over, serves nothing. */
static bool run(fsdp_fastpath_t *fp, const fsdp_fast_request_t *rq) {
  fsdp_services_context_t *ctx = fp->ctx;
  fsdp_session_t *s = fp->session;
  const char *method = method_of(rq->kind);
  fsdp_status_t st = FSDP_STATUS_INIT;
  uint64_t now = uv_now(ctx->loop);
  if (now > s->last_call_ms)
    s->last_call_ms = now; /* a request names the session, as a call does */
  if (rq->kind < FSDP_FAST_UNSHARD || rq->kind > FSDP_FAST_ALL_REDUCE) {
    fsdp_status_set(&st, FSDP_E_INVALID_ARGUMENT, "request kind %u is not a unit operation",
                    rq->kind);
    reply(fp, rq->seq, method, &st, NULL);
    return false;
  }
  if (ctx->lifecycle.state(ctx->lifecycle.data) != FSDP_SERVICES_SERVING) {
    fsdp_status_set(&st, FSDP_E_UNAVAILABLE, "fsdpd is draining and takes no new work");
    reply(fp, rq->seq, method, &st, NULL);
    return true; /* the daemon's refusal, not the trainer's fault */
  }
  fsdp_job_t *job = fsdp_store_find_job(ctx->store, s->job);
  fsdp_unit_t *u = job ? fsdp_store_unit_by_id(job, rq->unit_id) : NULL;
  char name[32];
  snprintf(name, sizeof name, "#%u", rq->unit_id);
  bool all_reduce = rq->kind == FSDP_FAST_ALL_REDUCE;
  if (fsdp_unit_ops_check_unit(s, u, u ? u->spec->unit : name, &st) < 0 ||
      ((rq->kind == FSDP_FAST_REDUCE_SCATTER || all_reduce) &&
       fsdp_unit_ops_check_reduce(u, all_reduce, &st) < 0) ||
      (rq->kind != FSDP_FAST_RESHARD &&
       fsdp_unit_ops_check_step(job, u, rq->step, &st) < 0) ||
      fsdp_unit_ops_order_after_trainer(s, rq->event, &st) < 0) {
    reply(fp, rq->seq, method, &st, NULL);
    return false;
  }
  fsdp_dataplane_rank_t who = fsdp_unit_ops_rank(s);
  if (rq->kind == FSDP_FAST_RESHARD) {
    int r = fsdp_dataplane_reshard(job, u, &who, &st);
    reply(fp, rq->seq, method, &st, NULL);
    return r >= 0;
  }
  fast_op_t *o = free_op(fp);
  if (!o) {
    fsdp_status_set(&st, FSDP_E_RESOURCE_EXHAUSTED,
                    "the session has %u fast path operations in flight, the most it may",
                    FSDP_FASTPATH_ENTRIES);
    reply(fp, rq->seq, method, &st, NULL);
    return false;
  }
  *o = (fast_op_t){.fp = fp, .busy = true, .seq = rq->seq, .method = method};
  fp->busy++;
  fsdp_session_call_parked(s);
  if (rq->kind == FSDP_FAST_UNSHARD) {
    fsdp_dataplane_unshard(ctx->dataplane, job, u, &who, rq->step, rq->backward,
                           fsdp_unit_ops_deadline(ctx), &o->op, on_op_done, o);
  } else {
    fsdp_dataplane_reduce_how_t how = {
        .accumulate = rq->accumulate,
        .defer_all_reduce = rq->reduce_flags & FSDP_FAST_DEFER_ALL_REDUCE,
        .step_optimizer = rq->reduce_flags & FSDP_FAST_STEP_OPTIMIZER,
        .step_only = rq->reduce_flags & FSDP_FAST_STEP_ONLY};
    fsdp_dataplane_reduce(ctx->dataplane, job, u, &who, rq->step, &how,
                          fsdp_unit_ops_deadline(ctx), &o->op, on_op_done, o);
  }
  return true;
}

/* Whether a ring's counters say what its producer and consumer can make: at most a ring's
 * worth unread. A trainer writes one counter of each ring, and could claim billions. */
static bool ring_is_sane(fsdp_fast_ring_t *ring, const char *which, fsdp_fastpath_t *fp) {
  uint32_t unread = atomic_load_explicit(&ring->head, memory_order_acquire) -
                    atomic_load_explicit(&ring->tail, memory_order_acquire);
  if (unread <= FSDP_FASTPATH_ENTRIES)
    return true;
  snprintf(fp->misused, sizeof fp->misused,
           "its fast path's %s ring claims %u unread entries, more than its %u: the trainer "
           "forged its counters",
           which, unread, FSDP_FASTPATH_ENTRIES);
  return false;
}

/* Takes the trainer's requests while their replies are sure to find room (each operation in
 * flight, and each reply not yet read, holds one), and at most a ring's worth: the counters
 * are in the trainer's memory, and a trainer that forged them must not hold the loop that
 * serves every other session. Returns how many it served (run), and counts the turn as
 * fruitless when that is none: after FRUITLESS_TURNS_MAX in a row, or counters no trainer
 * can make, fp->misused says why the fast path must stop. */
static unsigned take_requests(fsdp_fastpath_t *fp, bool rung) {
  fsdp_fast_region_t *region = fp->region;
  unsigned taken = 0, served = 0;
  if (!ring_is_sane(&region->requests_ring, "request", fp) ||
      !ring_is_sane(&region->replies_ring, "reply", fp))
    return 0;
  for (; taken < FSDP_FASTPATH_ENTRIES; taken++) {
    uint32_t unread = atomic_load_explicit(&region->replies_ring.head, memory_order_relaxed) -
                      atomic_load_explicit(&region->replies_ring.tail, memory_order_acquire);
    if (fp->busy + unread >= FSDP_FASTPATH_ENTRIES)
      break;
    int slot = fsdp_fast_ring_peek(&region->requests_ring);
    if (slot < 0)
      break;
    fsdp_fast_request_t rq = region->requests[slot]; /* a copy the trainer cannot change */
    fsdp_fast_ring_pop(&region->requests_ring);
    if (rq.kind == FSDP_FAST_CANCEL ? cancel(fp, rq.seq) : run(fp, &rq))
      served++;
  }
  /* A request refused is no fruitless turn: the trainer reads its reply before it may push
   * more, as a gRPC caller would, and one retrying in a loop must not lose its fast path. */
  if (served || taken) {
    fp->fruitless = 0;
  } else if (rung && ++fp->fruitless >= FRUITLESS_TURNS_MAX) {
    snprintf(fp->misused, sizeof fp->misused,
             "its fast path's doorbell rang %u times in a row with no request: the trainer "
             "rings in a loop",
             fp->fruitless);
  }
  return served;
}

/* A turn found the fast path misused: it stops for good, its doorbell and ring no longer
 * looked at, so that the trainer costs the loop nothing more; the session goes on through
 * gRPC, which has limits of its own (ending it instead let an abuser attach again, each
 * time at the cost of an Attach and its log lines). Operations in flight still answer. */
static bool stop_if_misused(fsdp_fastpath_t *fp) {
  if (!fp->misused[0])
    return false;
  if (fp->stopped)
    return true;
  log_warning("session %016llx (job '%s' local rank %u): %s; its fast path stops (the session "
              "goes on through gRPC)",
              (unsigned long long)fp->session->id, fp->session->job, fp->session->local_rank,
              fp->misused);
  fp->stopped = true;
  uv_poll_stop(&fp->poll);
  uv_idle_stop(&fp->idle);
  atomic_store_explicit(&fp->region->daemon_polling, 0, memory_order_relaxed);
  return true;
}

/* The trainer rang: it found the daemon not polling. */
static void on_doorbell(uv_poll_t *handle, int status, int events) {
  (void)status;
  (void)events;
  fsdp_fastpath_t *fp = handle->data;
  uint64_t rings;
  (void)!read(fp->daemon_bell, &rings, sizeof rings);
  unsigned served = take_requests(fp, true);
  if (stop_if_misused(fp))
    return;
  if (served > 0)
    keep_polling(fp);
}

/* One turn of the loop while it polls: takes what came, or ends the window. Ending it clears
 * daemon_polling, then looks once more: the fence pairs with the trainer's between its push
 * and its reading of the flag, so a request pushed meanwhile is either seen here or rung.
 * Only turns that serve something keep the window open. */
static void on_poll_turn(uv_idle_t *handle) {
  fsdp_fastpath_t *fp = handle->data;
  unsigned served = take_requests(fp, false);
  if (stop_if_misused(fp))
    return;
  if (served > 0) {
    keep_polling(fp);
    return;
  }
  if (fsdp_clock_now_ns() < fp->poll_until_ns)
    return;
  uv_idle_stop(handle);
  atomic_store_explicit(&fp->region->daemon_polling, 0, memory_order_relaxed);
  atomic_thread_fence(memory_order_seq_cst);
  served = take_requests(fp, false);
  if (stop_if_misused(fp))
    return;
  if (served > 0)
    keep_polling(fp);
}

static void release(fsdp_fastpath_t *fp) {
  if (fp->region)
    munmap(fp->region, fp->bytes);
  int fds[3] = {fp->region_fd, fp->daemon_bell, fp->trainer_bell};
  for (size_t i = 0; i < 3; i++)
    if (fds[i] >= 0)
      close(fds[i]);
  free(fp);
}

static void on_closed(uv_handle_t *handle) {
  fsdp_fastpath_t *fp = handle->data;
  if (--fp->open_handles == 0)
    release(fp);
}

int fsdp_fastpath_open(fsdp_services_context_t *ctx, fsdp_session_t *session, int ret_fds[3],
                       size_t *ret_bytes, fsdp_status_t *st) {
  fsdp_fastpath_t *fp = calloc(1, sizeof *fp);
  if (!fp)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for the fast path");
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  fp->ctx = ctx;
  fp->session = session;
  /* Where the job's ranks on this host outnumber the CPUs, the loop's spinning takes the
   * CPU a rank needs, which costs more than the wake-up it saves. */
  fp->polls = session->local_world_size <= (unsigned long)sysconf(_SC_NPROCESSORS_ONLN);
  fp->bytes = (sizeof *fp->region + page - 1) / page * page;
  fp->region_fd = memfd_create("fsdpd-fast-path", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  fp->daemon_bell = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  fp->trainer_bell = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  int err = 0;
  /* Sealed at its size: the trainer gets a writable descriptor, and must not make host memory
   * out of it beyond what memory.limit counts. */
  if (fp->region_fd < 0 || fp->daemon_bell < 0 || fp->trainer_bell < 0 ||
      ftruncate(fp->region_fd, (off_t)fp->bytes) < 0 ||
      fcntl(fp->region_fd, F_ADD_SEALS, F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL) < 0)
    err = -errno;
  if (!err) {
    void *p = mmap(NULL, fp->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fp->region_fd, 0);
    if (p == MAP_FAILED)
      err = -errno;
    else
      fp->region = p;
  }
  if (!err)
    err = uv_poll_init(ctx->loop, &fp->poll, fp->daemon_bell);
  if (err) {
    release(fp);
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "cannot make the fast path: %s",
                           strerror(-err));
  }
  (void)uv_idle_init(ctx->loop, &fp->idle); /* cannot fail: it only links the handle */
  fp->poll.data = fp;
  fp->idle.data = fp;
  fp->open_handles = 2;
  fp->region->magic = FSDP_FASTPATH_MAGIC;
  fp->region->version = FSDP_FASTPATH_VERSION;
  fp->region->entries = FSDP_FASTPATH_ENTRIES;
  uv_poll_start(&fp->poll, UV_READABLE, on_doorbell);
  session->fast_path = fp;
  ret_fds[0] = fp->region_fd;
  ret_fds[1] = fp->daemon_bell;
  ret_fds[2] = fp->trainer_bell;
  *ret_bytes = fp->bytes;
  return 0;
}

void fsdp_fastpath_close(fsdp_fastpath_t *fp) {
  if (!fp)
    return;
  if (fp->dropped > 1)
    log_warning("session %016llx: %llu fast path replies dropped in all: the trainer consumed "
                "none of them",
                (unsigned long long)fp->session->id, (unsigned long long)fp->dropped);
  fsdp_status_t st;
  fsdp_status_set(&st, FSDP_E_ABORTED, "session %016llx ended", (unsigned long long)fp->session->id);
  for (size_t i = 0; i < FSDP_FASTPATH_ENTRIES; i++)
    if (fp->ops[i].busy) {
      fsdp_dataplane_cancel(&fp->ops[i].op);
      on_op_done(&fp->ops[i], &st);
    }
  fp->session->fast_path = NULL;
  uv_close((uv_handle_t *)&fp->poll, on_closed);
  uv_close((uv_handle_t *)&fp->idle, on_closed); /* stops the polling the cancels started */
}
