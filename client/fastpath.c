/* The trainer's side of the fast path: send, wait (spinning briefly, then on the doorbell),
 * cancel. */
#include "client/fastpath.h"

#include <errno.h>
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/clock.h"
#include <fsdp/fsdp_error.h>

/* A reply is usually back within tens of microseconds: the wait polls the ring that long
 * before it sleeps on the doorbell, which costs a wake-up of its own. */
#define SPIN_NS 50000

/* An operation sent and not yet answered to its caller. */
typedef struct in_flight {
  uint64_t seq; /* 0: the entry is free */
  bool answered;
  bool abandoned; /* cancelled: its reply is dropped */
  fsdp_fast_reply_t reply;
} in_flight_t;

struct fsdp_fast_client {
  fsdp_fast_region_t *region;
  size_t bytes;
  int daemon_bell, trainer_bell;
  int lifeline;
  uint64_t next_seq;
  uint64_t spin_ns; /* how long a wait polls the reply ring before it sleeps */
  in_flight_t ops[FSDP_FASTPATH_MAX_INFLIGHT];
};

int fsdp_fast_client_open(int region_fd, size_t bytes, int daemon_bell, int trainer_bell,
                          int lifeline, bool spin, fsdp_fast_client_t **ret_client) {
  fsdp_fast_client_t *fc = calloc(1, sizeof *fc);
  void *p = bytes >= sizeof(fsdp_fast_region_t)
                ? mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, region_fd, 0)
                : MAP_FAILED;
  int r = !fc ? -ENOMEM : p == MAP_FAILED ? (bytes ? -errno : -EINVAL) : 0;
  close(region_fd);
  if (r == 0) {
    const fsdp_fast_region_t *region = p;
    if (region->magic != FSDP_FASTPATH_MAGIC || region->version != FSDP_FASTPATH_VERSION ||
        region->entries != FSDP_FASTPATH_ENTRIES)
      r = FSDP_E_PROTOCOL_VERSION;
  }
  if (r < 0) {
    if (p != MAP_FAILED)
      munmap(p, bytes);
    close(daemon_bell);
    close(trainer_bell);
    free(fc);
    return r;
  }
  *fc = (fsdp_fast_client_t){.region = p, .bytes = bytes, .daemon_bell = daemon_bell,
                             .trainer_bell = trainer_bell, .lifeline = lifeline,
                             .next_seq = 1, .spin_ns = spin ? SPIN_NS : 0};
  *ret_client = fc;
  return 0;
}

void fsdp_fast_client_close(fsdp_fast_client_t *fc) {
  if (!fc)
    return;
  munmap(fc->region, fc->bytes);
  close(fc->daemon_bell);
  close(fc->trainer_bell);
  free(fc);
}

static in_flight_t *find(fsdp_fast_client_t *fc, uint64_t seq) {
  for (size_t i = 0; i < FSDP_FASTPATH_MAX_INFLIGHT; i++)
    if (fc->ops[i].seq == seq)
      return &fc->ops[i];
  return NULL;
}

/* Pushes one request, and rings unless the daemon polls the ring; there is room: requests
 * are at most the operations in flight plus one cancel each. The fence pairs with the
 * daemon's between clearing daemon_polling and its last look at the ring: one of the two
 * sees the other. */
static void push(fsdp_fast_client_t *fc, const fsdp_fast_request_t *rq) {
  int slot = fsdp_fast_ring_slot(&fc->region->requests_ring);
  if (slot < 0)
    return; /* only a daemon that stopped reading: the caller's deadline ends the wait */
  fc->region->requests[slot] = *rq;
  fsdp_fast_ring_push(&fc->region->requests_ring);
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load_explicit(&fc->region->daemon_polling, memory_order_relaxed))
    return;
  uint64_t one = 1;
  (void)!write(fc->daemon_bell, &one, sizeof one);
}

uint64_t fsdp_fast_client_send(fsdp_fast_client_t *fc, fsdp_fast_request_t *rq) {
  in_flight_t *op = find(fc, 0);
  if (!op)
    return 0;
  rq->seq = fc->next_seq++;
  *op = (in_flight_t){.seq = rq->seq};
  push(fc, rq);
  return rq->seq;
}

/* Files every reply the daemon has pushed with its operation. */
static void take_replies(fsdp_fast_client_t *fc) {
  int slot;
  while ((slot = fsdp_fast_ring_peek(&fc->region->replies_ring)) >= 0) {
    const fsdp_fast_reply_t *r = &fc->region->replies[slot];
    in_flight_t *op = find(fc, r->seq);
    if (op && op->abandoned) {
      op->seq = 0;
    } else if (op) {
      op->reply = *r;
      op->answered = true;
    }
    fsdp_fast_ring_pop(&fc->region->replies_ring);
  }
}

/* Sleeps until the daemon rings, its channel ends or timeout_ms pass, unless a reply came
 * meanwhile; false when the channel ended. trainer_sleeping asks the daemon to ring; the
 * fence pairs with the daemon's between its push of a reply and its reading of the flag:
 * either the last look below finds the reply, or the daemon rings. */
static bool sleep_for_reply(fsdp_fast_client_t *fc, int timeout_ms) {
  bool open = true;
  atomic_store_explicit(&fc->region->trainer_sleeping, 1, memory_order_relaxed);
  atomic_thread_fence(memory_order_seq_cst);
  if (fsdp_fast_ring_peek(&fc->region->replies_ring) < 0) {
    /* The daemon sends nothing on the channel after its welcome: any event is its end. */
    struct pollfd pfd[2] = {{.fd = fc->trainer_bell, .events = POLLIN},
                            {.fd = fc->lifeline, .events = POLLIN}};
    if (poll(pfd, 2, timeout_ms) > 0) {
      if (pfd[0].revents) {
        uint64_t rings;
        (void)!read(fc->trainer_bell, &rings, sizeof rings);
      } else if (pfd[1].revents) {
        open = false;
      }
    }
  }
  atomic_store_explicit(&fc->region->trainer_sleeping, 0, memory_order_relaxed);
  return open;
}

int fsdp_fast_client_wait(fsdp_fast_client_t *fc, uint64_t seq, int64_t deadline_ms,
                          fsdp_fast_reply_t *ret_reply) {
  in_flight_t *op = find(fc, seq);
  if (!op || op->abandoned)
    return -EINVAL;
  uint64_t spin_until = fsdp_clock_now_ns() + fc->spin_ns;
  for (;;) {
    take_replies(fc);
    if (op->answered) {
      *ret_reply = op->reply;
      op->seq = 0;
      return 0;
    }
    if (fsdp_clock_now_ns() < spin_until)
      continue;
    int left = fsdp_clock_left_ms(deadline_ms);
    if (left == 0)
      return -ETIMEDOUT;
    if (!sleep_for_reply(fc, left)) {
      take_replies(fc); /* the daemon's last replies precede its closing */
      if (!op->answered)
        return -EPIPE;
    }
  }
}

void fsdp_fast_client_cancel(fsdp_fast_client_t *fc, uint64_t seq) {
  if (!fc)
    return; /* the fast path is gone, and what was in flight with it */
  in_flight_t *op = find(fc, seq);
  if (!op || op->abandoned)
    return;
  if (op->answered) {
    op->seq = 0;
    return;
  }
  op->abandoned = true;
  fsdp_fast_request_t rq = {.seq = seq, .kind = FSDP_FAST_CANCEL};
  push(fc, &rq);
}
