/* The fast path: a trainer's unit operations (Unshard, Reshard, ReduceScatter, AllReduce)
 * through shared memory instead of gRPC, with the same meaning, deadlines and errors.
 *
 * Why: a unit operation over gRPC costs a round trip of the HTTP/2 stack on both sides
 * (hundreds of microseconds on these machines), paid several times per unit and step. The
 * fast path costs at most two eventfd wake-ups, and none while both sides poll.
 *
 * The daemon makes one region per session and hands it over on the memory channel
 * (ChannelWelcome.fast_path, proto/fsdp/v1/channel.proto) with two eventfd doorbells. The
 * trainer pushes requests and writes the daemon's doorbell; the daemon pushes one reply per
 * operation (a cancelled one too) and writes the trainer's. Each ring has one producer and
 * one consumer: `head` counts the entries produced and `tail` those consumed (free-running,
 * entry i in slot i % FSDP_FASTPATH_ENTRIES); the producer writes the entry, then stores head
 * with release; the consumer loads head with acquire, reads the entry, then stores tail
 * with release. A trainer keeps at most FSDP_FASTPATH_MAX_INFLIGHT operations without their
 * reply, so that its cancels always find room and the replies never overflow.
 *
 * A doorbell is rung only when its consumer may be asleep (the idea of io_uring's SQPOLL
 * NEED_WAKEUP): the wake-up it costs is most of a round trip. The daemon sets
 * daemon_polling while its loop looks at the request ring on every turn, which it does for
 * a short while after traffic; the trainer sets trainer_sleeping while it sleeps on its
 * doorbell. Each side pairs its flag with the other's ring as in Dekker's algorithm, so a
 * request or reply is never left without a wake-up: the producer stores head, issues a
 * seq_cst fence and reads the consumer's flag, ringing unless the flag says the consumer
 * looks; the consumer clears (daemon) or sets (trainer) its flag, issues a seq_cst fence and
 * looks at the ring once more before it sleeps. The daemon trusts neither flag for more
 * than whether to ring: both are in memory the trainer can write.
 *
 * This layout is part of the protocol (FSDP_FASTPATH_VERSION): both sides compile it, and
 * the static assertions below pin it. */
#ifndef FSDP_PROTO_FASTPATH_H
#define FSDP_PROTO_FASTPATH_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define FSDP_FASTPATH_MAGIC 0x68747066u /* "fpth" */
#define FSDP_FASTPATH_VERSION 3u
#define FSDP_FASTPATH_ENTRIES 64u
#define FSDP_FASTPATH_MAX_INFLIGHT (FSDP_FASTPATH_ENTRIES / 2)

typedef enum fsdp_fast_kind {
  FSDP_FAST_UNSHARD = 1,
  FSDP_FAST_RESHARD = 2,
  FSDP_FAST_REDUCE_SCATTER = 3,
  FSDP_FAST_ALL_REDUCE = 4,
  FSDP_FAST_CANCEL = 5, /* of the operation `seq` names; its own reply says CANCELLED */
} fsdp_fast_kind_t;

/* fsdp_fast_request_t.reduce_flags */
#define FSDP_FAST_DEFER_ALL_REDUCE 0x1u
#define FSDP_FAST_STEP_OPTIMIZER 0x2u
#define FSDP_FAST_STEP_ONLY 0x4u

typedef struct fsdp_fast_request {
  uint64_t seq;     /* the trainer's, echoed in the reply */
  uint64_t step;
  uint32_t unit_id; /* RegisterUnitReply.unit_id */
  uint8_t kind;     /* fsdp_fast_kind_t */
  uint8_t backward; /* Unshard */
  uint8_t accumulate; /* ReduceScatter, AllReduce */
  uint8_t reduce_flags; /* ReduceScatter, AllReduce: FSDP_FAST_* below, UnitOpRequest's */
  uint16_t event;   /* UnitOpRequest.event: 0, or i + 1 for the session's CUDA event i */
  uint8_t reserved[6];
} fsdp_fast_request_t;

typedef struct fsdp_fast_reply {
  uint64_t seq;
  int32_t code;   /* 0, or an fsdp error (fsdp_error.h) that message explains */
  uint32_t unsharded_memory; /* as UnitOpReply's: 0 the arena (masters), 1 the shared one */
  uint64_t unsharded_offset;
  uint64_t full_grad_offset;
  uint64_t full_grad_bytes;
  char message[FSDP_STATUS_MESSAGE_MAX];
} fsdp_fast_reply_t;

/* head and tail on cache lines of their own: producer and consumer write one each. */
typedef struct fsdp_fast_ring {
  _Alignas(64) _Atomic uint32_t head;
  _Alignas(64) _Atomic uint32_t tail;
} fsdp_fast_ring_t;

typedef struct fsdp_fast_region {
  uint32_t magic;
  uint32_t version;
  uint32_t entries;
  fsdp_fast_ring_t requests_ring;
  fsdp_fast_ring_t replies_ring;
  /* On cache lines of their own: each is written by one side and read by the other on
   * every push. */
  _Alignas(64) _Atomic uint32_t daemon_polling;   /* 1: the daemon needs no ring */
  _Alignas(64) _Atomic uint32_t trainer_sleeping; /* 1: the trainer needs one */
  _Alignas(64) fsdp_fast_request_t requests[FSDP_FASTPATH_ENTRIES];
  fsdp_fast_reply_t replies[FSDP_FASTPATH_ENTRIES];
} fsdp_fast_region_t;

_Static_assert(sizeof(fsdp_fast_request_t) == 32, "fast path request layout");
_Static_assert(sizeof(fsdp_fast_reply_t) == 40 + FSDP_STATUS_MESSAGE_MAX, "fast path reply layout");
_Static_assert(offsetof(fsdp_fast_region_t, requests_ring) == 64, "fast path region layout");
_Static_assert(offsetof(fsdp_fast_region_t, daemon_polling) == 320, "fast path region layout");
_Static_assert(offsetof(fsdp_fast_region_t, trainer_sleeping) == 384, "fast path region layout");
_Static_assert(offsetof(fsdp_fast_region_t, requests) == 448, "fast path region layout");
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "the rings need atomics that work between processes");

/* The free slot of ring for its next entry, or -1 when it is full. Producer side. */
static inline int fsdp_fast_ring_slot(fsdp_fast_ring_t *ring) {
  uint32_t head = atomic_load_explicit(&ring->head, memory_order_relaxed);
  uint32_t tail = atomic_load_explicit(&ring->tail, memory_order_acquire);
  if (head - tail >= FSDP_FASTPATH_ENTRIES)
    return -1;
  return (int)(head % FSDP_FASTPATH_ENTRIES);
}

/* Publishes the entry written at the slot fsdp_fast_ring_slot gave. */
static inline void fsdp_fast_ring_push(fsdp_fast_ring_t *ring) {
  uint32_t head = atomic_load_explicit(&ring->head, memory_order_relaxed);
  atomic_store_explicit(&ring->head, head + 1, memory_order_release);
}

/* The slot of the oldest entry not consumed, or -1 when there is none. Consumer side. */
static inline int fsdp_fast_ring_peek(fsdp_fast_ring_t *ring) {
  uint32_t tail = atomic_load_explicit(&ring->tail, memory_order_relaxed);
  uint32_t head = atomic_load_explicit(&ring->head, memory_order_acquire);
  if (head == tail)
    return -1;
  return (int)(tail % FSDP_FASTPATH_ENTRIES);
}

/* Consumes the entry fsdp_fast_ring_peek gave. */
static inline void fsdp_fast_ring_pop(fsdp_fast_ring_t *ring) {
  uint32_t tail = atomic_load_explicit(&ring->tail, memory_order_relaxed);
  atomic_store_explicit(&ring->tail, tail + 1, memory_order_release);
}

#endif
