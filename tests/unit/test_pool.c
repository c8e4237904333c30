/* The buffer pool: the cap, waiting in arrival order, reuse at the largest size, a lowered
 * cap draining, cancels, and the arena's shortage reported. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/store/pool.h"

#define KiB ((size_t)1 << 10)

typedef struct waiting_take {
  fsdp_pool_waiter_t waiter;
  int calls;
  uint64_t offset;
  int code;
} waiting_take_t;

static void on_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st) {
  waiting_take_t *t = (waiting_take_t *)waiter;
  t->calls++;
  t->offset = offset;
  t->code = st->code;
}

static fsdp_arena_t *new_arena(size_t capacity) {
  fsdp_arena_options_t options = FSDP_ARENA_OPTIONS_INIT;
  options.prefault = FSDP_ARENA_PREFAULT_NONE;
  options.hugetlb = FSDP_ARENA_HUGETLB_NEVER;
  fsdp_arena_t *arena = NULL;
  fsdp_status_t st;
  assert_int_equal(fsdp_arena_new("pool-test", capacity, &options, &arena, &st), 0);
  return arena;
}

static uint64_t take_now(fsdp_pool_t *pool, size_t bytes) {
  waiting_take_t t = {0};
  uint64_t offset = UINT64_MAX;
  fsdp_status_t st;
  assert_int_equal(fsdp_pool_take(pool, bytes, &t.waiter, on_ready, &offset, &st), 0);
  assert_int_not_equal(offset, UINT64_MAX);
  return offset;
}

static void test_cap_and_arrival_order(void **state) {
  (void)state;
  fsdp_arena_t *arena = new_arena(1 << 20);
  fsdp_pool_t pool;
  fsdp_pool_init(&pool, arena, 2);
  uint64_t a = take_now(&pool, 4 * KiB), b = take_now(&pool, 4 * KiB);
  assert_int_not_equal(a, b);

  waiting_take_t first = {0}, second = {0};
  uint64_t unused = UINT64_MAX;
  fsdp_status_t st;
  assert_int_equal(fsdp_pool_take(&pool, 4 * KiB, &first.waiter, on_ready, &unused, &st), 1);
  assert_int_equal(fsdp_pool_take(&pool, 4 * KiB, &second.waiter, on_ready, &unused, &st), 1);
  assert_int_equal(unused, UINT64_MAX); /* written only when lent at once */
  assert_int_equal(pool.n_lent, 2);
  assert_int_equal(pool.n_waits, 2);

  fsdp_pool_give(&pool, b);
  assert_int_equal(first.calls, 1);
  assert_int_equal(first.code, 0);
  assert_int_equal(first.offset, b); /* the buffer given back, not a third one */
  assert_int_equal(second.calls, 0);
  fsdp_pool_give(&pool, a);
  assert_int_equal(second.calls, 1);
  assert_int_equal(second.offset, a);
  assert_int_equal(pool.n_buffers, 2);
  assert_int_equal(pool.most_lent, 2);

  fsdp_pool_give(&pool, first.offset);
  fsdp_pool_give(&pool, second.offset);
  assert_int_equal(pool.n_lent, 0);
  fsdp_pool_cleanup(&pool);
  fsdp_arena_stats_t stats;
  fsdp_arena_get_stats(arena, &stats);
  assert_int_equal(stats.used, 0);
  fsdp_arena_free(arena);
}

/* A new take waits behind the waiters already there, even when a buffer would fit it. */
static void test_no_overtaking(void **state) {
  (void)state;
  fsdp_arena_t *arena = new_arena(1 << 20);
  fsdp_pool_t pool;
  fsdp_pool_init(&pool, arena, 1);
  uint64_t a = take_now(&pool, 8 * KiB);
  waiting_take_t big = {0}, small = {0};
  uint64_t unused;
  fsdp_status_t st;
  assert_int_equal(fsdp_pool_take(&pool, 8 * KiB, &big.waiter, on_ready, &unused, &st), 1);
  assert_int_equal(fsdp_pool_take(&pool, 4 * KiB, &small.waiter, on_ready, &unused, &st), 1);
  fsdp_pool_give(&pool, a);
  assert_int_equal(big.calls, 1);
  assert_int_equal(small.calls, 0);
  fsdp_pool_give(&pool, big.offset);
  assert_int_equal(small.calls, 1);
  fsdp_pool_give(&pool, small.offset);
  fsdp_pool_cleanup(&pool);
  fsdp_arena_free(arena);
}

/* Buffers are made at the largest size asked so far; a free one too small is remade, so the
 * pool never holds more buffers than it lent at once. */
static void test_grows_to_the_largest(void **state) {
  (void)state;
  fsdp_arena_t *arena = new_arena(1 << 20);
  fsdp_pool_t pool;
  fsdp_pool_init(&pool, arena, 2);
  fsdp_pool_give(&pool, take_now(&pool, 4 * KiB));
  assert_int_equal(fsdp_pool_bytes(&pool), 4 * KiB);
  uint64_t big = take_now(&pool, 12 * KiB);
  assert_int_equal(pool.n_buffers, 1);
  assert_int_equal(fsdp_pool_bytes(&pool), 12 * KiB);
  uint64_t small = take_now(&pool, 4 * KiB); /* made at the largest size */
  assert_int_equal(fsdp_pool_bytes(&pool), 24 * KiB);
  fsdp_pool_give(&pool, big);
  fsdp_pool_give(&pool, small);
  for (int i = 0; i < 10; i++) {
    uint64_t x = take_now(&pool, 12 * KiB), y = take_now(&pool, 4 * KiB);
    fsdp_pool_give(&pool, x);
    fsdp_pool_give(&pool, y);
  }
  assert_int_equal(pool.n_buffers, 2);
  assert_int_equal(fsdp_pool_bytes(&pool), 24 * KiB);
  fsdp_arena_stats_t stats;
  fsdp_arena_get_stats(arena, &stats);
  assert_int_equal(stats.used, 24 * KiB);
  fsdp_pool_cleanup(&pool);
  fsdp_arena_free(arena);
}

static void test_capacity_changes(void **state) {
  (void)state;
  fsdp_arena_t *arena = new_arena(1 << 20);
  fsdp_pool_t pool;
  fsdp_pool_init(&pool, arena, 1);
  uint64_t a = take_now(&pool, 4 * KiB);
  waiting_take_t w = {0};
  uint64_t unused;
  fsdp_status_t st;
  assert_int_equal(fsdp_pool_take(&pool, 4 * KiB, &w.waiter, on_ready, &unused, &st), 1);
  fsdp_pool_set_capacity(&pool, 3); /* a higher cap serves the waiter at once */
  assert_int_equal(w.calls, 1);
  assert_int_not_equal(w.offset, a);
  uint64_t c = take_now(&pool, 4 * KiB);
  assert_int_equal(pool.n_buffers, 3);

  fsdp_pool_set_capacity(&pool, 1); /* all lent: they go as they come back */
  assert_int_equal(pool.n_buffers, 3);
  fsdp_pool_give(&pool, a);
  fsdp_pool_give(&pool, c);
  assert_int_equal(pool.n_buffers, 1);
  assert_int_equal(fsdp_pool_bytes(&pool), 4 * KiB);
  fsdp_pool_give(&pool, w.offset);
  assert_int_equal(pool.n_buffers, 1);
  fsdp_pool_cleanup(&pool);
  fsdp_arena_free(arena);
}

static void test_cancel(void **state) {
  (void)state;
  fsdp_arena_t *arena = new_arena(1 << 20);
  fsdp_pool_t pool;
  fsdp_pool_init(&pool, arena, 1);
  uint64_t a = take_now(&pool, 4 * KiB);
  waiting_take_t gone = {0}, next = {0};
  uint64_t unused;
  fsdp_status_t st;
  assert_int_equal(fsdp_pool_take(&pool, 4 * KiB, &gone.waiter, on_ready, &unused, &st), 1);
  assert_int_equal(fsdp_pool_take(&pool, 4 * KiB, &next.waiter, on_ready, &unused, &st), 1);
  fsdp_pool_cancel(&gone.waiter);
  fsdp_pool_cancel(&gone.waiter); /* again: nothing */
  fsdp_pool_give(&pool, a);
  assert_int_equal(gone.calls, 0);
  assert_int_equal(next.calls, 1);
  fsdp_pool_give(&pool, next.offset);
  /* A take lent at once can be cancelled too, harmlessly. */
  waiting_take_t now = {0};
  assert_int_equal(fsdp_pool_take(&pool, 4 * KiB, &now.waiter, on_ready, &a, &st), 0);
  fsdp_pool_cancel(&now.waiter);
  fsdp_pool_give(&pool, a);
  fsdp_pool_cleanup(&pool);
  fsdp_arena_free(arena);
}

/* A buffer the arena cannot hold: RESOURCE_EXHAUSTED, at once or to the waiter. */
static void test_arena_shortage(void **state) {
  (void)state;
  fsdp_arena_t *arena = new_arena(64 * KiB);
  fsdp_pool_t pool;
  fsdp_pool_init(&pool, arena, 2);
  uint64_t a = take_now(&pool, 40 * KiB);
  waiting_take_t t = {0};
  uint64_t unused;
  fsdp_status_t st;
  assert_int_equal(fsdp_pool_take(&pool, 40 * KiB, &t.waiter, on_ready, &unused, &st),
                   FSDP_E_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(st.message, "pool-test"));
  assert_int_equal(pool.n_lent, 1);
  fsdp_pool_set_capacity(&pool, 1);
  assert_int_equal(fsdp_pool_take(&pool, 40 * KiB, &t.waiter, on_ready, &unused, &st), 1);
  fsdp_pool_give(&pool, a); /* the waiter gets a's buffer: it fits */
  assert_int_equal(t.calls, 1);
  assert_int_equal(t.code, 0);
  fsdp_pool_give(&pool, t.offset);
  /* A waiter needing more than the arena can give gets the error when served. */
  a = take_now(&pool, 40 * KiB);
  waiting_take_t huge = {0};
  assert_int_equal(fsdp_pool_take(&pool, 80 * KiB, &huge.waiter, on_ready, &unused, &st), 1);
  fsdp_pool_give(&pool, a);
  assert_int_equal(huge.calls, 1);
  assert_int_equal(huge.code, FSDP_E_RESOURCE_EXHAUSTED);
  assert_int_equal(pool.n_lent, 0);
  fsdp_pool_cleanup(&pool);
  fsdp_arena_free(arena);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cap_and_arrival_order), cmocka_unit_test(test_no_overtaking),
      cmocka_unit_test(test_grows_to_the_largest),  cmocka_unit_test(test_capacity_changes),
      cmocka_unit_test(test_cancel),                cmocka_unit_test(test_arena_shortage),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
