/* Buffers lent from an arena under a cap. */
#include "daemon/store/pool.h"

#include <assert.h>

void fsdp_pool_init(fsdp_pool_t *pool, fsdp_arena_t *arena, unsigned capacity) {
  assert(capacity >= 1 && capacity <= FSDP_POOL_CAPACITY_MAX);
  fsdp_arena_stats_t stats;
  fsdp_arena_get_stats(arena, &stats);
  *pool = (fsdp_pool_t){.arena = arena, .capacity = capacity, .page = stats.page_size};
  fsdp_list_init(&pool->waiters);
}

static void unmake(fsdp_pool_t *pool, unsigned i) {
  fsdp_arena_release(pool->arena, pool->buffers[i].offset);
  pool->buffers[i] = pool->buffers[--pool->n_buffers];
}

void fsdp_pool_cleanup(fsdp_pool_t *pool) {
  if (!pool)
    return;
  assert(fsdp_list_empty(&pool->waiters));
  while (pool->n_buffers > 0)
    unmake(pool, pool->n_buffers - 1);
}

static void lend(fsdp_pool_t *pool, unsigned i, uint64_t *ret_offset) {
  pool->buffers[i].lent = true;
  if (++pool->n_lent > pool->most_lent)
    pool->most_lent = pool->n_lent;
  *ret_offset = pool->buffers[i].offset;
}

/* Lends a buffer of at least bytes if one is free or can be made: 0, 1 when none can be
 * lent now, or an error from the arena. */
static int try_lend(fsdp_pool_t *pool, size_t bytes, uint64_t *ret_offset, fsdp_status_t *st) {
  int best = -1, small = -1;
  for (unsigned i = 0; i < pool->n_buffers; i++) {
    const fsdp_pool_buffer_t *b = &pool->buffers[i];
    if (b->lent)
      continue;
    if (b->bytes < bytes)
      small = (int)i;
    else if (best < 0 || b->bytes < pool->buffers[best].bytes)
      best = (int)i;
  }
  if (best >= 0) {
    lend(pool, (unsigned)best, ret_offset);
    return 0;
  }
  /* A free buffer too small for this take is remade at the largest size, so the number of
   * buffers never grows past what is lent at once. */
  if (small >= 0)
    unmake(pool, (unsigned)small);
  else if (pool->n_buffers >= pool->capacity)
    return 1;
  size_t make = bytes > pool->largest ? bytes : pool->largest;
  make = (make + pool->page - 1) / pool->page * pool->page;
  uint64_t offset;
  int r = fsdp_arena_alloc(pool->arena, make, pool->page, &offset, st);
  if (r < 0)
    return r;
  pool->largest = make;
  unsigned i = pool->n_buffers++;
  pool->buffers[i] = (fsdp_pool_buffer_t){.offset = offset,
                                          .bytes = fsdp_arena_block_size(pool->arena, offset)};
  lend(pool, i, ret_offset);
  return 0;
}

int fsdp_pool_take(fsdp_pool_t *pool, size_t bytes, fsdp_pool_waiter_t *waiter,
                   fsdp_pool_ready_fn ready, uint64_t *ret_offset, fsdp_status_t *st) {
  fsdp_list_init(&waiter->link);
  /* Waiters come first: a take never overtakes one waiting already. */
  int r = fsdp_list_empty(&pool->waiters) ? try_lend(pool, bytes, ret_offset, st) : 1;
  if (r != 1)
    return r;
  waiter->bytes = bytes;
  waiter->ready = ready;
  fsdp_list_push_back(&pool->waiters, &waiter->link);
  pool->n_waits++;
  return 1;
}

/* Lends to the waiters in arrival order while buffers can be lent. */
static void serve(fsdp_pool_t *pool) {
  fsdp_pool_waiter_t *w;
  while ((w = fsdp_list_first(&pool->waiters, fsdp_pool_waiter_t, link))) {
    uint64_t offset = 0;
    fsdp_status_t st = FSDP_STATUS_INIT;
    int r = try_lend(pool, w->bytes, &offset, &st);
    if (r == 1)
      return;
    fsdp_list_remove(&w->link);
    w->ready(w, offset, &st);
  }
}

void fsdp_pool_give(fsdp_pool_t *pool, uint64_t offset) {
  for (unsigned i = 0; i < pool->n_buffers; i++) {
    fsdp_pool_buffer_t *b = &pool->buffers[i];
    if (b->offset != offset || !b->lent)
      continue;
    b->lent = false;
    pool->n_lent--;
    if (pool->n_buffers > pool->capacity)
      unmake(pool, i);
    serve(pool);
    return;
  }
  assert(!"fsdp_pool_give: no buffer lent at this offset");
}

void fsdp_pool_cancel(fsdp_pool_waiter_t *waiter) {
  fsdp_list_remove(&waiter->link);
}

void fsdp_pool_set_capacity(fsdp_pool_t *pool, unsigned capacity) {
  assert(capacity >= 1 && capacity <= FSDP_POOL_CAPACITY_MAX);
  pool->capacity = capacity;
  for (unsigned i = pool->n_buffers; i-- > 0 && pool->n_buffers > capacity;)
    if (!pool->buffers[i].lent)
      unmake(pool, i);
  serve(pool);
}

size_t fsdp_pool_bytes(const fsdp_pool_t *pool) {
  size_t bytes = 0;
  for (unsigned i = 0; i < pool->n_buffers; i++)
    bytes += pool->buffers[i].bytes;
  return bytes;
}
