/* fsdp_pool_t: a bounded set of buffers in one arena, lent out and given back.
 *
 * Why: FSDP holds a unit's unsharded copy and its full gradients only while the unit is in
 * flight, so that memory grows with the number of units in flight (limit_all_gathers), not
 * with the model. A job has one pool of unsharded copies and, per local rank, one pool of
 * full-gradient buffers; each lends at most `capacity` buffers at once, and a take that
 * finds them all lent waits, in arrival order, until one is given back.
 *
 * Buffers are made on first need and kept: their pages stay populated (the arena never
 * gives them back to the kernel), so a pool costs its high-water mark, which is at most
 * capacity buffers. Every buffer is made the size of the largest take so far, so that units
 * of different sizes reuse each other's buffers instead of churning the arena; a free buffer
 * smaller than a take is remade at the new size. A buffer is whole pages of the arena,
 * starting on one, so that a trainer can map it alone.
 *
 * Loop thread only, like the arena. */
#ifndef FSDP_POOL_H
#define FSDP_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/list.h"
#include "common/status.h"
#include "daemon/store/arena.h"

/* The most buffers a pool lends at once (the in-flight cap's range). */
#define FSDP_POOL_CAPACITY_MAX 64

typedef struct fsdp_pool_waiter fsdp_pool_waiter_t;

/* A waiting take ended: st->code 0 and the buffer's offset, or an error (the arena could not
 * make the buffer) with offset 0. The waiter is unlinked before the call. */
typedef void (*fsdp_pool_ready_fn)(fsdp_pool_waiter_t *waiter, uint64_t offset,
                                   const fsdp_status_t *st);

/* A take's storage while it waits, the caller's; data is the caller's too. */
struct fsdp_pool_waiter {
  fsdp_list_t link;
  size_t bytes;
  fsdp_pool_ready_fn ready;
  void *data;
};

typedef struct fsdp_pool_buffer {
  uint64_t offset;
  size_t bytes;
  bool lent;
} fsdp_pool_buffer_t;

typedef struct fsdp_pool {
  fsdp_arena_t *arena; /* borrowed */
  size_t page;         /* the arena's */
  unsigned capacity;
  size_t largest; /* the largest take so far: the size new buffers are made */
  fsdp_pool_buffer_t buffers[FSDP_POOL_CAPACITY_MAX];
  unsigned n_buffers; /* made; more than capacity only while a lowered capacity drains */
  unsigned n_lent;
  unsigned most_lent; /* the most buffers lent at once */
  uint64_t n_waits;   /* takes that found every buffer lent */
  fsdp_list_t waiters;
} fsdp_pool_t;

/* capacity in [1, FSDP_POOL_CAPACITY_MAX]; no buffer is made yet. */
void fsdp_pool_init(fsdp_pool_t *pool, fsdp_arena_t *arena, unsigned capacity);
/* Gives every buffer back to the arena, lent ones too (their users must be gone); nothing may
 * wait. NULL-safe. */
void fsdp_pool_cleanup(fsdp_pool_t *pool);

/* Lends a buffer of at least `bytes`: returns 0 with its offset in *ret_offset; 1 when every
 * buffer is lent, with waiter linked until a buffer is given back (waiter->ready is called
 * then, unless fsdp_pool_cancel comes first); or an error with st naming the arena's
 * shortage (RESOURCE_EXHAUSTED) when a buffer cannot be made. */
int fsdp_pool_take(fsdp_pool_t *pool, size_t bytes, fsdp_pool_waiter_t *waiter,
                   fsdp_pool_ready_fn ready, uint64_t *ret_offset, fsdp_status_t *st);

/* Gives back the buffer lent at offset, and lends it (or what it makes room for) to the
 * waiters that now fit, in arrival order. */
void fsdp_pool_give(fsdp_pool_t *pool, uint64_t offset);

/* A waiting take gives up; it is not called back. Does nothing for a waiter not waiting. */
void fsdp_pool_cancel(fsdp_pool_waiter_t *waiter);

/* A new cap (SetSchedule's max_inflight): buffers above it go back to the arena as they are
 * given back; a higher one serves waiters at once. */
void fsdp_pool_set_capacity(fsdp_pool_t *pool, unsigned capacity);

/* Bytes of the buffers made (what the pool costs now). */
size_t fsdp_pool_bytes(const fsdp_pool_t *pool);

#endif
