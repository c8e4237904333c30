/* The rendezvous of a job's local ranks (collectives/local.h), driven directly: completion
 * once every rank joined, a rank asking for another step or from another run, gone ranks,
 * withdrawals, the deadline naming the missing ranks, and reuse after a reset; and the host
 * sum of the ranks' gradients. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "collectives/local.h"

#define WORLD 4

static const fsdp_rank_set_t nobody_gone;

/* Rank `rank`'s request for step 7 of generation 1, due at 100 ms. */
static fsdp_collection_request_t request(uint32_t rank) {
  return (fsdp_collection_request_t){.rank = rank, .step = 7, .generation = 1,
                                     .deadline_ms = 100};
}

static fsdp_collection_outcome_t join(fsdp_collection_t *c, const fsdp_collection_request_t *rq) {
  return fsdp_collection_join(c, WORLD, rq, &nobody_gone);
}

/* Ranks [0, n) join with request(). */
static void join_first(fsdp_collection_t *c, uint32_t n) {
  for (uint32_t r = 0; r < n; r++) {
    fsdp_collection_request_t rq = request(r);
    assert_int_equal(join(c, &rq), FSDP_COLLECTION_JOINED);
  }
}

static void test_completes_when_every_rank_joined(void **state) {
  (void)state;
  fsdp_collection_t c = {0};
  assert_false(fsdp_collection_is_collecting(&c));
  join_first(&c, WORLD - 1);
  assert_true(fsdp_collection_is_collecting(&c));
  assert_int_equal(c.count, WORLD - 1);
  assert_false(c.running);
  assert_int_equal(c.step, 7);
  assert_int_equal(c.generation, 1);
  fsdp_collection_request_t last = request(WORLD - 1);
  last.deadline_ms = 500; /* only the first request sets the deadline */
  assert_int_equal(join(&c, &last), FSDP_COLLECTION_COMPLETE);
  assert_true(c.running);
  assert_false(fsdp_collection_is_collecting(&c));
  assert_int_equal(c.deadline_ms, 100);
  for (uint32_t r = 0; r < WORLD; r++)
    assert_true(fsdp_rank_set_has(&c.submitted, r));
}

static void test_another_step_aborts(void **state) {
  (void)state;
  fsdp_collection_t c = {0};
  join_first(&c, 2);
  fsdp_collection_request_t later = request(2);
  later.step = 8;
  assert_int_equal(join(&c, &later), FSDP_COLLECTION_OTHER_STEP);
  /* The same step's second gather is another collective too. */
  fsdp_collection_request_t again = request(2);
  again.regather = true;
  assert_int_equal(join(&c, &again), FSDP_COLLECTION_OTHER_STEP);
  /* Refused requests leave it as it was, for the caller to abort. */
  assert_int_equal(c.count, 2);
  assert_false(fsdp_rank_set_has(&c.submitted, 2));
  assert_int_equal(c.step, 7);
  assert_false(c.regather);
}

static void test_another_generation_aborts(void **state) {
  (void)state;
  fsdp_collection_t c = {0};
  join_first(&c, 1);
  fsdp_collection_request_t next_run = request(1);
  next_run.generation = 2;
  next_run.step = 8; /* the generation is checked first */
  assert_int_equal(join(&c, &next_run), FSDP_COLLECTION_OTHER_GENERATION);
  assert_int_equal(c.count, 1);
  assert_int_equal(c.generation, 1);
}

static void test_gone_ranks_abort(void **state) {
  (void)state;
  fsdp_collection_t c = {0};
  fsdp_rank_set_t gone = {0};
  fsdp_rank_set_put(&gone, WORLD, true); /* beyond the world: not one of its ranks */
  fsdp_collection_request_t rq = request(0);
  assert_int_equal(fsdp_collection_join(&c, WORLD, &rq, &gone), FSDP_COLLECTION_JOINED);
  fsdp_rank_set_put(&gone, 2, true);
  rq = request(1);
  rq.generation = 2; /* gone ranks are checked before anything else */
  assert_int_equal(fsdp_collection_join(&c, WORLD, &rq, &gone), FSDP_COLLECTION_RANKS_GONE);
  assert_int_equal(c.count, 1);
}

static void test_withdraw(void **state) {
  (void)state;
  fsdp_collection_t c = {0};
  join_first(&c, 2);
  fsdp_collection_withdraw(&c, 1);
  fsdp_collection_withdraw(&c, 1); /* once only */
  fsdp_collection_withdraw(&c, 3); /* never joined */
  assert_int_equal(c.count, 1);
  assert_false(fsdp_rank_set_has(&c.submitted, 1));
  /* The rank that withdrew joins again, and the others complete it. */
  for (uint32_t r = 1; r < WORLD; r++) {
    fsdp_collection_request_t rq = request(r);
    assert_int_equal(join(&c, &rq),
                     r == WORLD - 1 ? FSDP_COLLECTION_COMPLETE : FSDP_COLLECTION_JOINED);
  }
  /* A running collection keeps every rank. */
  fsdp_collection_withdraw(&c, 0);
  assert_int_equal(c.count, WORLD);
  assert_true(fsdp_rank_set_has(&c.submitted, 0));
}

static void test_deadline_names_the_missing_ranks(void **state) {
  (void)state;
  fsdp_collection_t c = {0};
  fsdp_rank_set_t missing = {0};
  assert_false(fsdp_collection_expired(&c, WORLD, 1000, &missing)); /* nobody asked */
  fsdp_collection_request_t rq = request(1);
  assert_int_equal(join(&c, &rq), FSDP_COLLECTION_JOINED);
  rq = request(3);
  assert_int_equal(join(&c, &rq), FSDP_COLLECTION_JOINED);
  assert_false(fsdp_collection_expired(&c, WORLD, 99, &missing));
  assert_true(fsdp_collection_expired(&c, WORLD, 100, &missing));
  char names[64];
  fsdp_rank_set_format(&missing, true, FSDP_LOCAL_WORLD_MAX, names, sizeof names);
  assert_string_equal(names, "0, 2");
  /* A running collection waits for nobody. */
  join_first(&c, 1);
  rq = request(2);
  assert_int_equal(join(&c, &rq), FSDP_COLLECTION_COMPLETE);
  assert_false(fsdp_collection_expired(&c, WORLD, 1000, &missing));
}

static void test_reset_and_reuse(void **state) {
  (void)state;
  fsdp_collection_t c = {0};
  join_first(&c, WORLD - 1);
  fsdp_collection_request_t last = request(WORLD - 1);
  assert_int_equal(join(&c, &last), FSDP_COLLECTION_COMPLETE);
  fsdp_collection_reset(&c);
  assert_false(c.running);
  assert_int_equal(c.count, 0);
  assert_false(fsdp_rank_set_has(&c.submitted, 0));
  /* The next collection takes its step, generation and deadline from its first request. */
  fsdp_collection_request_t next = {.rank = 2, .step = 9, .regather = true, .generation = 3,
                                    .deadline_ms = 300};
  assert_int_equal(join(&c, &next), FSDP_COLLECTION_JOINED);
  assert_int_equal(c.step, 9);
  assert_true(c.regather);
  assert_int_equal(c.generation, 3);
  assert_int_equal(c.deadline_ms, 300);
  /* Reset while collecting: what an abort does once the waiters are answered. */
  fsdp_collection_reset(&c);
  fsdp_collection_request_t rq = request(0);
  assert_int_equal(join(&c, &rq), FSDP_COLLECTION_JOINED);
  assert_int_equal(c.step, 7);
  assert_false(c.regather);
}

/* Three ranks' bf16 gradients 1, 2 and 3, halved and summed over elements [2, 6) of 8: 3
 * in fp32 and in bf16 (0x4040); elements outside the range are not touched. */
static void test_host_sum(void **state) {
  (void)state;
  enum { N = 8, BEGIN = 2, END = 6 };
  static const uint16_t bf16_values[3] = {0x3f80, 0x4000, 0x4040}; /* 1, 2, 3 */
  uint16_t grads[3][N];
  const void *srcs[3];
  for (unsigned k = 0; k < 3; k++) {
    for (unsigned i = 0; i < N; i++)
      grads[k][i] = bf16_values[k];
    srcs[k] = grads[k];
  }
  float sum_fp32[N];
  uint16_t sum[N];
  for (unsigned i = 0; i < N; i++) {
    sum_fp32[i] = -1.0f;
    sum[i] = 0xffff;
  }
  assert_int_equal(fsdp_host_sum_range(sum, sum_fp32, srcs, 3, FSDP_DTYPE_BF16,
                                       FSDP_DTYPE_BF16, 0.5f, BEGIN, END),
                   0);
  for (unsigned i = 0; i < N; i++) {
    bool in = i >= BEGIN && i < END;
    assert_true(sum_fp32[i] == (in ? 3.0f : -1.0f));
    assert_int_equal(sum[i], in ? 0x4040 : 0xffff);
  }
  /* An fp32 reduce: the fp32 sum is the sum. */
  assert_int_equal(fsdp_host_sum_range(sum_fp32, sum_fp32, srcs, 3, FSDP_DTYPE_BF16,
                                       FSDP_DTYPE_FP32, 1.0f, 0, N),
                   0);
  for (unsigned i = 0; i < N; i++)
    assert_true(sum_fp32[i] == 6.0f);
  assert_int_equal(fsdp_host_sum_range(sum, sum_fp32, srcs, 0, FSDP_DTYPE_BF16,
                                       FSDP_DTYPE_BF16, 1.0f, 0, N),
                   -EINVAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_completes_when_every_rank_joined),
      cmocka_unit_test(test_another_step_aborts),
      cmocka_unit_test(test_another_generation_aborts),
      cmocka_unit_test(test_gone_ranks_abort),
      cmocka_unit_test(test_withdraw),
      cmocka_unit_test(test_deadline_names_the_missing_ranks),
      cmocka_unit_test(test_reset_and_reuse),
      cmocka_unit_test(test_host_sum),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
