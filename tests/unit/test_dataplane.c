/* The data plane driven through its header on a real libuv loop, with no daemon, no RPC and
 * no socket: the rendezvous of the local ranks and the results it computes, the order of a
 * rank's steps, the deadline of a rank that never asks, the loss of a rank's session, a
 * cancelled operation, every refusal with the message the daemon gives, the memory model
 * (copies and gradient buffers lent from bounded pools and given back), and reduces held
 * for a checkpoint's snapshot. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "daemon/dataplane/dataplane.h"

#define NUMEL 1000 /* not a multiple of the ranks: the last shard holds padding */
#define MAX_RANKS 4

/* What one operation's callback heard. */
typedef struct result {
  unsigned calls;
  int code;
  char message[FSDP_STATUS_MESSAGE_MAX];
} result_t;

static void on_done(void *data, const fsdp_status_t *st) {
  result_t *r = data;
  r->calls++;
  r->code = st->code;
  snprintf(r->message, sizeof r->message, "%s", st->message);
}

/* One job "j" of `world` local ranks with one registered unit "u" of NUMEL fp32 parameters,
 * FULL_SHARD, unsharded in param_dtype. */
typedef struct fixture {
  uv_loop_t loop;
  fsdp_store_t store;
  fsdp_dataplane_t dp;
  fsdp_job_owner_t owner;
  fsdp_store_rank_t store_ranks[MAX_RANKS];
  fsdp_dataplane_rank_t ranks[MAX_RANKS];
  unsigned world;
  fsdp_job_t *job;
  fsdp_unit_t *unit;
} fixture_t;

static fsdp_unit_t *add_unit(fixture_t *f, const char *name, fsdp_unit_strategy_t strategy,
                             fsdp_unit_dtype_t param_dtype);

static void fixture_init(fixture_t *f, unsigned world, fsdp_unit_dtype_t param_dtype) {
  memset(f, 0, sizeof *f);
  f->world = world;
  assert_int_equal(uv_loop_init(&f->loop), 0);
  fsdp_store_init(&f->store);
  f->store.max_jobs = 1;
  f->store.arena_capacity = 4 << 20;
  f->store.memory_limit = 64 << 20;
  f->store.topology = (fsdp_topology_t){.hosts = 1, .host_rank = 0, .shard_group_hosts = 1};
  f->store.max_inflight = 2;
  fsdp_dataplane_hook_store(&f->store.hooks);
  fsdp_status_t st;
  assert_int_equal(fsdp_dataplane_init(&f->dp, &f->loop, 2, &st), 0);

  f->owner.uid = getuid();
  for (unsigned r = 0; r < world; r++) {
    f->store_ranks[r] = (fsdp_store_rank_t){.job = "j", .local_rank = r,
                                            .local_world_size = world, .owner = &f->owner};
    f->ranks[r] = (fsdp_dataplane_rank_t){.local_rank = r, .session_id = 10 + r, .serial = r};
  }
  f->unit = add_unit(f, "u", FSDP_UNIT_FULL_SHARD, param_dtype);
}

/* Unit `name` of NUMEL fp32 parameters registered by every rank, its buffers ready; its
 * masters hold exact bf16 values (i + seed) % 256 - 128. */
static fsdp_unit_t *add_unit(fixture_t *f, const char *name, fsdp_unit_strategy_t strategy,
                             fsdp_unit_dtype_t param_dtype) {
  uint64_t shape[] = {NUMEL};
  fsdp_param_spec_t param = {.name = "weight", .shape = shape, .n_shape = 1,
                             .dtype = FSDP_UNIT_DTYPE_FP32, .requires_grad = true};
  fsdp_unit_spec_t spec = {.unit = (char *)name, .params = &param, .n_params = 1,
                           .strategy = strategy, .param_dtype = param_dtype};
  result_t registered[MAX_RANKS] = {0};
  fsdp_dataplane_op_t ops[MAX_RANKS];
  fsdp_unit_t *unit = NULL;
  fsdp_status_t st;
  for (unsigned r = 0; r < f->world; r++) {
    assert_int_equal(fsdp_store_register_unit(&f->store, &f->store_ranks[r], &spec, &unit, &st),
                     0);
    f->job = fsdp_store_find_job(&f->store, "j");
    fsdp_dataplane_register(&f->dp, f->job, unit, &f->ranks[r], &ops[r], on_done,
                            &registered[r]);
  }
  /* The first registration pre-faults the buffers on the thread pool; all wait for it. */
  assert_int_equal(registered[0].calls, 0);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  for (unsigned r = 0; r < f->world; r++) {
    assert_int_equal(registered[r].calls, 1);
    assert_int_equal(registered[r].code, 0);
  }
  assert_int_equal(unit->flight->state, FSDP_UNIT_READY);
  float *master = (float *)(void *)((char *)fsdp_arena_base(f->job->arena) + unit->master_offset);
  for (unsigned i = 0; i < NUMEL; i++)
    master[i] = (float)((i + name[0]) % 256) - 128;
  return unit;
}

static void fixture_cleanup(fixture_t *f) {
  assert_false(fsdp_dataplane_uses_job(&f->dp, f->job));
  fsdp_dataplane_cleanup(&f->dp);
  fsdp_store_cleanup(&f->store);
  assert_int_equal(uv_loop_close(&f->loop), 0);
  fsdp_dataplane_cleanup(NULL);
  fsdp_store_cleanup(NULL);
}

static void expect(const result_t *r, int code, const char *message) {
  assert_int_equal(r->calls, 1);
  if (r->code != code)
    fail_msg("code %d (%s), expected %d", r->code, r->message, code);
  assert_string_equal(r->message, message);
}

static void unshard_unit(fixture_t *f, fsdp_unit_t *unit, unsigned rank, uint64_t step,
                         bool backward, uint64_t deadline_ms, fsdp_dataplane_op_t *op,
                         result_t *result) {
  fsdp_dataplane_unshard(&f->dp, f->job, unit, &f->ranks[rank], step, backward, deadline_ms,
                         op, on_done, result);
}

static void unshard(fixture_t *f, unsigned rank, uint64_t step, uint64_t deadline_ms,
                    fsdp_dataplane_op_t *op, result_t *result) {
  unshard_unit(f, f->unit, rank, step, false, deadline_ms, op, result);
}

/* Every rank's Unshard for the backward of step, run to completion: each rank's gradient
 * buffer is then lent (ops[r].lent). */
static void lend_gradients(fixture_t *f, uint64_t step, fsdp_dataplane_op_t *ops) {
  result_t results[MAX_RANKS] = {0};
  for (unsigned r = 0; r < f->world; r++)
    unshard_unit(f, f->unit, r, step, true, UINT64_MAX, &ops[r], &results[r]);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  for (unsigned r = 0; r < f->world; r++) {
    expect(&results[r], 0, "");
    assert_true(ops[r].lent.full_grad_bytes > 0);
  }
}

static void reduce(fixture_t *f, unsigned rank, uint64_t step, bool accumulate,
                   fsdp_dataplane_op_t *op, result_t *result) {
  fsdp_dataplane_reduce_how_t how = {.accumulate = accumulate};
  fsdp_dataplane_reduce(&f->dp, f->job, f->unit, &f->ranks[rank], step, &how, UINT64_MAX, op,
                        on_done, result);
}


static char *arena(const fixture_t *f) {
  return fsdp_arena_base(f->job->arena);
}

static void test_buffers_of_each_rank(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 3, FSDP_UNIT_DTYPE_UNSPECIFIED);
  const fsdp_unit_layout_t *l = &f.unit->layout;
  assert_int_equal(l->padded_numel, 1002);
  assert_int_equal(l->shard_numel, 334);
  fsdp_dataplane_buffers_t b[3];
  for (unsigned r = 0; r < 3; r++) {
    fsdp_dataplane_buffers(f.unit, r, &b[r]);
    assert_int_equal(b[r].shard, r);
    assert_int_equal(b[r].host_first_shard, 0);
    assert_int_equal(b[r].host_shards, 3);
    assert_int_equal(b[r].gathered_step, 0);
    assert_int_equal(b[r].reduced_step, 0);
    assert_int_equal(b[r].master_offset, b[0].master_offset);
  }
  /* The backward's Unshard lends each rank a full gradient of its own, none overlapping
   * another's or the shards. */
  fsdp_dataplane_op_t ops[3];
  lend_gradients(&f, 1, ops);
  for (unsigned r = 0; r < 3; r++) {
    uint64_t at = ops[r].lent.full_grad_offset, end = at + 1002 * 4;
    assert_true(at >= b[r].grad_offset + 1002 * 4 || end <= b[r].master_offset);
    for (unsigned q = 0; q < r; q++)
      assert_true(at >= ops[q].lent.full_grad_offset + 1002 * 4 ||
                  end <= ops[q].lent.full_grad_offset);
  }
  for (unsigned r = 0; r < 3; r++) {
    assert_int_equal(f.job->grad_pools[r].n_lent, 1);
    fsdp_status_t st;
    assert_int_equal(fsdp_dataplane_reshard(f.job, f.unit, &f.ranks[r], &st), 0);
  }
  /* A session's end gives its buffer back. */
  for (unsigned r = 0; r < 3; r++) {
    fsdp_dataplane_release_session(f.job, r, f.ranks[r].session_id, "detached", 10 + r);
    assert_int_equal(f.job->grad_pools[r].n_lent, 0);
  }
  fixture_cleanup(&f);
}

/* The gather runs once every rank has asked, and casts the fp32 masters into bf16. */
static void test_unshard_waits_for_every_rank(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 3, FSDP_UNIT_DTYPE_BF16);
  float *master = (float *)(void *)(arena(&f) + f.unit->master_offset);
  for (unsigned i = 0; i < NUMEL; i++)
    master[i] = (float)(i % 256) - 128; /* exact in bf16 */

  fsdp_dataplane_op_t ops[3];
  result_t results[3] = {0};
  unshard(&f, 2, 1, UINT64_MAX, &ops[2], &results[2]);
  unshard(&f, 0, 1, UINT64_MAX, &ops[0], &results[0]);
  uv_run(&f.loop, UV_RUN_DEFAULT); /* nothing to run: rank 1 has not asked */
  assert_int_equal(results[0].calls + results[2].calls, 0);
  assert_int_equal(f.unit->flight->gather.count, 2);
  unshard(&f, 1, 1, UINT64_MAX, &ops[1], &results[1]);
  assert_int_equal(results[1].calls, 0); /* the gather is on the thread pool */
  uv_run(&f.loop, UV_RUN_DEFAULT);
  for (unsigned r = 0; r < 3; r++)
    expect(&results[r], 0, "");

  const uint16_t *unsharded =
      (const uint16_t *)(const void *)((char *)fsdp_arena_base(f.job->shared_arena) +
                                       f.unit->flight->copy_offset);
  for (unsigned r = 0; r < 3; r++) {
    assert_false(ops[r].lent.unsharded_in_masters);
    assert_int_equal(ops[r].lent.unsharded_offset, f.unit->flight->copy_offset);
    assert_int_equal(ops[r].lent.full_grad_bytes, 0); /* a forward's Unshard */
  }
  for (unsigned i = 0; i < NUMEL; i++) {
    uint32_t bits;
    memcpy(&bits, &master[i], sizeof bits);
    assert_int_equal(unsharded[i], bits >> 16);
  }
  fsdp_dataplane_buffers_t b;
  fsdp_dataplane_buffers(f.unit, 0, &b);
  assert_int_equal(b.gathered_step, 1);

  /* The step's copy is there: answered before the call returns, with no collective. */
  result_t again = {0};
  unshard(&f, 1, 1, UINT64_MAX, &ops[1], &again);
  expect(&again, 0, "");
  assert_int_equal(f.unit->flight->gather.count, 0);
  fixture_cleanup(&f);
}

/* Every rank's full gradient, averaged over the ranks (the default factors), lands in the
 * fp32 gradient shards; with accumulate the next step's adds to them. */
static void test_reduce_scatter_averages_the_ranks(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 2, FSDP_UNIT_DTYPE_UNSPECIFIED);
  fsdp_dataplane_op_t ops[2];
  lend_gradients(&f, 1, ops);
  for (unsigned r = 0; r < 2; r++) {
    float *full = (float *)(void *)(arena(&f) + ops[r].lent.full_grad_offset);
    for (unsigned i = 0; i < NUMEL; i++)
      full[i] = (float)((r + 1) * i);
  }
  result_t results[2] = {0};
  reduce(&f, 0, 1, false, &ops[0], &results[0]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_int_equal(results[0].calls, 0);
  reduce(&f, 1, 1, false, &ops[1], &results[1]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  expect(&results[0], 0, "");
  expect(&results[1], 0, "");
  const float *grad = (const float *)(const void *)(arena(&f) + f.unit->grad_offset);
  for (unsigned i = 0; i < NUMEL; i++)
    assert_true(grad[i] == 1.5f * (float)i);
  /* The reduce gave the buffers back; a rank must be lent one before it reduces again. */
  for (unsigned r = 0; r < 2; r++)
    assert_int_equal(f.job->grad_pools[r].n_lent, 0);
  result_t unlent = {0};
  reduce(&f, 0, 2, true, &ops[0], &unlent);
  expect(&unlent, FSDP_E_FAILED_PRECONDITION,
         "unit 'u' step 2: local rank 0 holds no full-gradient buffer to reduce: the Unshard "
         "for the unit's backward lends it");

  lend_gradients(&f, 2, ops);
  for (unsigned r = 0; r < 2; r++) {
    float *full = (float *)(void *)(arena(&f) + ops[r].lent.full_grad_offset);
    for (unsigned i = 0; i < NUMEL; i++)
      full[i] = (float)((r + 1) * i);
  }
  memset(results, 0, sizeof results);
  reduce(&f, 1, 2, true, &ops[1], &results[1]);
  reduce(&f, 0, 2, true, &ops[0], &results[0]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  expect(&results[0], 0, "");
  expect(&results[1], 0, "");
  for (unsigned i = 0; i < NUMEL; i++)
    assert_true(grad[i] == 3.0f * (float)i);
  fsdp_dataplane_buffers_t b;
  fsdp_dataplane_buffers(f.unit, 1, &b);
  assert_int_equal(b.reduced_step, 2);
  fixture_cleanup(&f);
}

/* A rank's steps go forward: an older step than the copy holds, a step other than the one
 * the other ranks asked for, and a second submission of a gradient are refused. */
static void test_steps_in_order(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 2, FSDP_UNIT_DTYPE_UNSPECIFIED);
  fsdp_dataplane_op_t ops[2];
  result_t results[2] = {0};
  unshard(&f, 0, 5, UINT64_MAX, &ops[0], &results[0]);
  unshard(&f, 1, 5, UINT64_MAX, &ops[1], &results[1]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  expect(&results[0], 0, "");

  result_t older = {0};
  unshard(&f, 0, 4, UINT64_MAX, &ops[0], &older);
  expect(&older, FSDP_E_FAILED_PRECONDITION,
         "unit 'u': local rank 0 asked for step 4, but the unsharded copy already holds step 5");

  /* Another step than the others': the collective ends for everyone. */
  memset(results, 0, sizeof results);
  unshard(&f, 0, 6, UINT64_MAX, &ops[0], &results[0]);
  unshard(&f, 1, 7, UINT64_MAX, &ops[1], &results[1]);
  const char *mismatch = "unit 'u': local rank 1 asked to unshard step 7 while the other ranks "
                         "asked for step 6";
  expect(&results[0], FSDP_E_FAILED_PRECONDITION, mismatch);
  expect(&results[1], FSDP_E_FAILED_PRECONDITION, mismatch);
  assert_int_equal(f.unit->flight->gather.count, 0);

  /* A repeated submission of a gradient. */
  lend_gradients(&f, 9, ops);
  memset(results, 0, sizeof results);
  fsdp_dataplane_op_t again;
  result_t repeated = {0};
  reduce(&f, 0, 1, false, &ops[0], &results[0]);
  reduce(&f, 0, 1, false, &again, &repeated);
  expect(&repeated, FSDP_E_FAILED_PRECONDITION,
         "unit 'u' step 1: local rank 0 already submitted its gradient");
  assert_int_equal(results[0].calls, 0); /* the first still waits */
  reduce(&f, 1, 1, false, &ops[1], &results[1]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  expect(&results[0], 0, "");
  expect(&results[1], 0, "");

  /* The ranks of a reduce-scatter agree on accumulating, or it ends for everyone. */
  lend_gradients(&f, 9, ops);
  memset(results, 0, sizeof results);
  reduce(&f, 1, 2, true, &ops[1], &results[1]);
  reduce(&f, 0, 2, false, &ops[0], &results[0]);
  const char *accumulate = "unit 'u' step 2: local rank 0 submitted with accumulate false while "
                           "the other ranks submitted with accumulate true";
  expect(&results[0], FSDP_E_FAILED_PRECONDITION, accumulate);
  expect(&results[1], FSDP_E_FAILED_PRECONDITION, accumulate);
  assert_int_equal(f.unit->flight->reduce.count, 0);

  /* Ranks of two runs of the job never meet in a collective. */
  memset(results, 0, sizeof results);
  f.ranks[1].generation = 1;
  unshard(&f, 0, 10, UINT64_MAX, &ops[0], &results[0]);
  unshard(&f, 1, 10, UINT64_MAX, &ops[1], &results[1]);
  const char *runs = "unit 'u' step 10: local rank 1 attached with generation 1 while the other "
                     "ranks attached with generation 0: ranks of two runs of job 'j' cannot "
                     "unshard together";
  expect(&results[0], FSDP_E_FAILED_PRECONDITION, runs);
  expect(&results[1], FSDP_E_FAILED_PRECONDITION, runs);
  fixture_cleanup(&f);
}

typedef struct expiry {
  fsdp_store_t *store;
  const result_t *waiting;
} expiry_t;

/* The daemon's housekeeping, as often as a test wants: ends what is past its deadline. */
static void on_housekeeping(uv_timer_t *timer) {
  expiry_t *e = timer->data;
  fsdp_dataplane_expire(e->store, uv_now(timer->loop), NULL, NULL);
  if (e->waiting->calls)
    uv_close((uv_handle_t *)timer, NULL);
}

/* A rank that never asks: the others hear ABORTED naming it once the deadline passes. */
static void test_deadline_names_the_missing_rank(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 3, FSDP_UNIT_DTYPE_UNSPECIFIED);
  fsdp_dataplane_op_t ops[2];
  result_t results[2] = {0};
  uint64_t deadline = uv_now(&f.loop) + 20;
  unshard(&f, 0, 1, deadline, &ops[0], &results[0]);
  unshard(&f, 2, 1, UINT64_MAX, &ops[1], &results[1]); /* the first one's deadline holds */
  fsdp_dataplane_expire(&f.store, deadline - 1, NULL, NULL);
  assert_int_equal(results[0].calls + results[1].calls, 0);

  expiry_t e = {&f.store, &results[0]};
  uv_timer_t timer;
  uv_timer_init(&f.loop, &timer);
  timer.data = &e;
  uv_timer_start(&timer, on_housekeeping, 5, 5);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  const char *late = "unit 'u' step 1: local rank(s) 1 of job 'j' did not ask to unshard in time "
                     "(store.collective_timeout)";
  expect(&results[0], FSDP_E_ABORTED, late);
  expect(&results[1], FSDP_E_ABORTED, late);
  assert_int_equal(f.unit->flight->gather.count, 0);
  fixture_cleanup(&f);
}

/* A rank's session ends: its own waiting operation, and those of the ranks waiting for it,
 * end ABORTED; a session older than the rank's end finds it gone until it attaches again. */
static void test_lost_session(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 3, FSDP_UNIT_DTYPE_BF16); /* a gather that runs on the thread pool */
  fsdp_dataplane_op_t ops[3];
  result_t results[3] = {0};
  unshard(&f, 0, 1, UINT64_MAX, &ops[0], &results[0]);
  unshard(&f, 1, 1, UINT64_MAX, &ops[1], &results[1]);
  fsdp_dataplane_release_session(f.job, 1, f.ranks[1].session_id, "detached", 3);
  expect(&results[1], FSDP_E_ABORTED,
         "session 000000000000000b (job 'j' local rank 1) ended while the call waited: detached");
  expect(&results[0], FSDP_E_ABORTED,
         "unit 'u' step 1: local rank 1 of job 'j' is gone (detached) before its unshard");

  /* Rank 2's session (serial 2) was there when rank 1 went. */
  unshard(&f, 2, 2, UINT64_MAX, &ops[2], &results[2]);
  expect(&results[2], FSDP_E_ABORTED,
         "unit 'u' step 2: local rank(s) 1 of job 'j' ended their session and have not "
         "attached again; the unshard cannot complete without them");

  /* Rank 1 attaches again (serial 3): the collective waits for it like for any rank. */
  fsdp_job_t *job;
  fsdp_status_t st;
  assert_int_equal(fsdp_store_job_for(&f.store, &f.store_ranks[1], &job, &st), 0);
  f.ranks[1].session_id = 21;
  f.ranks[1].serial = 3;
  memset(results, 0, sizeof results);
  for (unsigned r = 0; r < 3; r++)
    unshard(&f, r, 2, UINT64_MAX, &ops[r], &results[r]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  for (unsigned r = 0; r < 3; r++)
    expect(&results[r], 0, "");

  /* A session ending while its collective runs still ends its own operation ABORTED. */
  memset(results, 0, sizeof results);
  for (unsigned r = 0; r < 3; r++)
    unshard(&f, r, 3, UINT64_MAX, &ops[r], &results[r]);
  assert_true(f.unit->flight->gather.running);
  fsdp_dataplane_release_session(f.job, 0, f.ranks[0].session_id, "no call for 5000 ms", 4);
  expect(&results[0], FSDP_E_ABORTED,
         "session 000000000000000a (job 'j' local rank 0) ended while the call waited: no call "
         "for 5000 ms");
  uv_run(&f.loop, UV_RUN_DEFAULT);
  expect(&results[1], 0, "");
  expect(&results[2], 0, "");
  fixture_cleanup(&f);
}

/* A cancelled operation is not called back, and its rank no longer counts: the collective
 * waits for it to ask again. */
static void test_cancel_withdraws_the_rank(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 2, FSDP_UNIT_DTYPE_UNSPECIFIED);
  fsdp_dataplane_op_t ops[2];
  result_t results[2] = {0};
  unshard(&f, 0, 1, UINT64_MAX, &ops[0], &results[0]);
  fsdp_dataplane_cancel(&ops[0]);
  assert_int_equal(f.unit->flight->gather.count, 0);
  unshard(&f, 1, 1, UINT64_MAX, &ops[1], &results[1]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_int_equal(results[0].calls + results[1].calls, 0);
  result_t again = {0};
  unshard(&f, 0, 1, UINT64_MAX, &ops[0], &again);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  expect(&again, 0, "");
  expect(&results[1], 0, "");
  assert_int_equal(results[0].calls, 0);
  fixture_cleanup(&f);
}

/* Operations on a unit whose RegisterUnit has not completed are refused at once. */
static void test_no_buffers_yet(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 1, FSDP_UNIT_DTYPE_UNSPECIFIED);
  f.unit->flight->state = FSDP_UNIT_ALLOCATING;
  const char *message = "unit 'u' has no buffers yet: its RegisterUnit has not succeeded";
  fsdp_status_t st;
  assert_int_equal(fsdp_dataplane_reshard(f.job, f.unit, &f.ranks[0], &st),
                   FSDP_E_FAILED_PRECONDITION);
  assert_string_equal(st.message, message);
  fsdp_dataplane_op_t op;
  result_t result = {0};
  reduce(&f, 0, 1, false, &op, &result);
  expect(&result, FSDP_E_FAILED_PRECONDITION, message);
  f.unit->flight->state = FSDP_UNIT_READY;
  assert_int_equal(fsdp_dataplane_reshard(f.job, f.unit, &f.ranks[0], &st), 0);
  fixture_cleanup(&f);
}

/* Every rank's op on unit for step, run to completion, each answered OK. */
static void on_every_rank(fixture_t *f, fsdp_unit_t *unit, uint64_t step, bool backward,
                          fsdp_dataplane_op_t *ops) {
  result_t results[MAX_RANKS] = {0};
  for (unsigned r = 0; r < f->world; r++)
    unshard_unit(f, unit, r, step, backward, UINT64_MAX, &ops[r], &results[r]);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  for (unsigned r = 0; r < f->world; r++)
    expect(&results[r], 0, "");
}

static void reshard_unit(fixture_t *f, fsdp_unit_t *unit, unsigned rank) {
  fsdp_status_t st;
  assert_int_equal(fsdp_dataplane_reshard(f->job, unit, &f->ranks[rank], &st), 0);
}

/* The copy in bf16 at offset of the shared arena against unit's masters. */
static void check_copy(const fixture_t *f, const fsdp_unit_t *unit, uint64_t offset) {
  const uint16_t *copy = (const uint16_t *)(const void *)(
      (char *)fsdp_arena_base(f->job->shared_arena) + offset);
  const float *master =
      (const float *)(const void *)((char *)fsdp_arena_base(f->job->arena) + unit->master_offset);
  for (unsigned i = 0; i < NUMEL; i++) {
    uint32_t bits;
    memcpy(&bits, &master[i], sizeof bits);
    assert_int_equal(copy[i], bits >> 16);
  }
}

/* fp32 parameters on a host that holds every shard: the masters are the copy; the pool of
 * copies makes nothing. */
static void test_masters_are_the_copy(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 2, FSDP_UNIT_DTYPE_FP32);
  fsdp_dataplane_op_t ops[2];
  on_every_rank(&f, f.unit, 1, false, ops);
  for (unsigned r = 0; r < 2; r++) {
    assert_true(ops[r].lent.unsharded_in_masters);
    assert_int_equal(ops[r].lent.unsharded_offset, f.unit->master_offset);
  }
  assert_int_equal(f.job->copies.n_buffers, 0);
  fsdp_arena_stats_t stats;
  fsdp_arena_get_stats(f.job->shared_arena, &stats);
  assert_int_equal(stats.used, 0);
  fixture_cleanup(&f);
}

/* At most max_inflight copies are lent at once: the third unit's gather waits until every
 * rank has let go of one, and then reuses its buffer. */
static void test_pool_caps_the_copies(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 2, FSDP_UNIT_DTYPE_BF16);
  fsdp_unit_t *v = add_unit(&f, "v", FSDP_UNIT_FULL_SHARD, FSDP_UNIT_DTYPE_BF16);
  fsdp_unit_t *w = add_unit(&f, "w", FSDP_UNIT_FULL_SHARD, FSDP_UNIT_DTYPE_BF16);
  fsdp_dataplane_op_t ops[2], w_ops[2];
  on_every_rank(&f, f.unit, 1, false, ops);
  uint64_t u_copy = ops[0].lent.unsharded_offset;
  on_every_rank(&f, v, 1, false, ops);
  assert_int_equal(f.job->copies.n_lent, 2);

  result_t waiting[2] = {0};
  for (unsigned r = 0; r < 2; r++)
    unshard_unit(&f, w, r, 1, false, UINT64_MAX, &w_ops[r], &waiting[r]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_int_equal(waiting[0].calls + waiting[1].calls, 0);
  assert_true(w->flight->gather.running);
  reshard_unit(&f, f.unit, 0);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_int_equal(waiting[0].calls + waiting[1].calls, 0); /* rank 1 still reads u */
  reshard_unit(&f, f.unit, 1);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  for (unsigned r = 0; r < 2; r++) {
    expect(&waiting[r], 0, "");
    assert_int_equal(w_ops[r].lent.unsharded_offset, u_copy);
  }
  check_copy(&f, w, u_copy);
  assert_int_equal(f.job->copies.most_lent, 2);
  assert_int_equal(f.job->copies.n_buffers, 2);
  assert_int_equal(f.job->copies.n_waits, 1);

  /* FULL_SHARD's backward gathers again, into whichever buffer is free. */
  for (unsigned r = 0; r < 2; r++)
    reshard_unit(&f, v, r);
  on_every_rank(&f, f.unit, 1, true, ops);
  check_copy(&f, f.unit, ops[0].lent.unsharded_offset);
  for (unsigned r = 0; r < 2; r++) {
    reshard_unit(&f, w, r);
    reshard_unit(&f, f.unit, r);
    fsdp_dataplane_release_session(f.job, r, f.ranks[r].session_id, "detached", 10 + r);
  }
  assert_int_equal(f.job->copies.n_lent, 0);
  fixture_cleanup(&f);
}

/* A gather waiting for a copy past the deadline ends ABORTED, naming who holds them. */
static void test_pool_wait_expires(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 2, FSDP_UNIT_DTYPE_BF16);
  fsdp_unit_t *v = add_unit(&f, "v", FSDP_UNIT_FULL_SHARD, FSDP_UNIT_DTYPE_BF16);
  fsdp_unit_t *w = add_unit(&f, "w", FSDP_UNIT_FULL_SHARD, FSDP_UNIT_DTYPE_BF16);
  fsdp_dataplane_op_t ops[2], w_ops[2];
  on_every_rank(&f, f.unit, 1, false, ops);
  on_every_rank(&f, v, 1, false, ops);
  reshard_unit(&f, v, 0);
  result_t waiting[2] = {0};
  uint64_t deadline = uv_now(&f.loop) + 20;
  for (unsigned r = 0; r < 2; r++)
    unshard_unit(&f, w, r, 1, false, deadline, &w_ops[r], &waiting[r]);
  fsdp_dataplane_expire(&f.store, deadline - 1, NULL, NULL);
  assert_int_equal(waiting[0].calls + waiting[1].calls, 0);
  fsdp_dataplane_expire(&f.store, deadline, NULL, NULL);
  const char *full = "unit 'w' step 1: no unsharded copy of job 'j' came free in time "
                     "(store.collective_timeout): its 2 (max_inflight) are held by 'u' (ranks "
                     "0, 1), 'v' (ranks 1)";
  for (unsigned r = 0; r < 2; r++)
    expect(&waiting[r], FSDP_E_ABORTED, full);
  assert_false(w->flight->gather.running);
  for (unsigned r = 0; r < 2; r++)
    fsdp_dataplane_release_session(f.job, r, f.ranks[r].session_id, "detached", 10 + r);
  assert_int_equal(f.job->copies.n_lent, 0);
  fixture_cleanup(&f);
}

/* SHARD_GRAD_OP keeps every copy from the forward to the backward, as FSDP does: its copies
 * and gradient buffers are the units' own, outside the cap, and go back to the arena when
 * let go. */
static void test_kept_copies_are_not_capped(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 2, FSDP_UNIT_DTYPE_BF16);
  fsdp_unit_t *units[3];
  for (unsigned k = 0; k < 3; k++)
    units[k] = add_unit(&f, (const char *[]){"v", "w", "x"}[k], FSDP_UNIT_SHARD_GRAD_OP,
                        FSDP_UNIT_DTYPE_BF16);
  fsdp_dataplane_op_t ops[2];
  for (unsigned k = 0; k < 3; k++) {
    on_every_rank(&f, units[k], 1, false, ops);
    check_copy(&f, units[k], ops[0].lent.unsharded_offset);
  }
  assert_int_equal(f.job->copies.n_lent, 0);
  /* Their backward's gradient buffers are their own too: more than max_inflight of them. */
  fsdp_arena_stats_t before, stats;
  fsdp_arena_get_stats(f.job->arena, &before);
  for (unsigned k = 0; k < 3; k++)
    on_every_rank(&f, units[k], 1, true, ops);
  assert_int_equal(f.job->grad_pools[0].n_lent + f.job->grad_pools[1].n_lent, 0);
  fsdp_arena_get_stats(f.job->arena, &stats);
  assert_true(stats.used >= before.used + 3 * 2 * NUMEL * sizeof(uint16_t));
  for (unsigned r = 0; r < 2; r++) {
    for (unsigned k = 0; k < 3; k++)
      reshard_unit(&f, units[k], r);
    fsdp_dataplane_release_session(f.job, r, f.ranks[r].session_id, "detached", 10 + r);
  }
  fsdp_arena_get_stats(f.job->arena, &stats);
  assert_int_equal(stats.used, before.used);
  fsdp_arena_get_stats(f.job->shared_arena, &stats);
  assert_int_equal(stats.used, 0);
  fixture_cleanup(&f);
}

/* The backward of a unit resharded after its forward is the step's second gather, which
 * every rank joins, even one that asks while another still holds the forward's copy: every
 * host then runs the same gathers, however its ranks interleave. */
static void test_backward_gathers_again(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 2, FSDP_UNIT_DTYPE_BF16);
  fsdp_dataplane_op_t ops[2];
  on_every_rank(&f, f.unit, 1, false, ops);
  reshard_unit(&f, f.unit, 1);
  result_t results[2] = {0};
  unshard_unit(&f, f.unit, 1, 1, true, UINT64_MAX, &ops[1], &results[1]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_int_equal(results[1].calls, 0); /* no fast path on rank 0's forward copy */
  result_t stale = {0};
  fsdp_dataplane_op_t stale_op;
  unshard_unit(&f, f.unit, 1, 1, false, UINT64_MAX, &stale_op, &stale);
  expect(&stale, FSDP_E_FAILED_PRECONDITION,
         "unit 'u': local rank 1 asked for step 1 while its request for step 1 (its backward) "
         "waits");
  reshard_unit(&f, f.unit, 0);
  unshard_unit(&f, f.unit, 0, 1, true, UINT64_MAX, &ops[0], &results[0]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  for (unsigned r = 0; r < 2; r++)
    expect(&results[r], 0, "");
  assert_true(f.unit->flight->gathered_again);
  check_copy(&f, f.unit, ops[0].lent.unsharded_offset);
  unshard_unit(&f, f.unit, 0, 1, false, UINT64_MAX, &stale_op, &stale);
  assert_int_equal(stale.calls, 2);
  assert_string_equal(stale.message, "unit 'u': local rank 0 asked for step 1, but the "
                                     "unsharded copy already holds step 1 (its backward)");
  for (unsigned r = 0; r < 2; r++)
    fsdp_dataplane_release_session(f.job, r, f.ranks[r].session_id, "detached", 10 + r);
  fixture_cleanup(&f);
}

/* The schedule's prefetch: once every rank asked for u in step 1, the daemon gathers the
 * next unit in the forward order on their behalf, and a rank's Unshard of it finds the copy
 * there; the one after that waits for a pool buffer like any gather. In backward it gathers
 * the unit before again (its backward's gather) once nobody holds its copy. */
static void test_prefetch_follows_the_order(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 2, FSDP_UNIT_DTYPE_BF16);
  fsdp_unit_t *v = add_unit(&f, "v", FSDP_UNIT_FULL_SHARD, FSDP_UNIT_DTYPE_BF16);
  fsdp_unit_t *w = add_unit(&f, "w", FSDP_UNIT_FULL_SHARD, FSDP_UNIT_DTYPE_BF16);
  fsdp_unit_t *order[] = {f.unit, v, w};
  fsdp_dataplane_set_order(f.job, order, 3);
  f.job->flight->forward_prefetch = f.job->flight->backward_prefetch = 1;
  fsdp_dataplane_op_t ops[2];
  on_every_rank(&f, f.unit, 1, false, ops);
  assert_true(v->flight->gathered && v->flight->gathered_step == 1 && !v->flight->gathered_again);
  check_copy(&f, v, v->flight->copy_offset);
  assert_int_equal(f.job->copies.n_lent, 2);
  /* Asking v now is answered at once, and asks for w, which waits for a buffer. */
  result_t got = {0};
  unshard_unit(&f, v, 0, 1, false, UINT64_MAX, &ops[0], &got);
  expect(&got, 0, "");
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_true(w->flight->gather.running && !w->flight->gathered);
  for (unsigned r = 0; r < 2; r++)
    reshard_unit(&f, f.unit, r);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_true(w->flight->gathered && w->flight->gathered_step == 1);
  check_copy(&f, w, w->flight->copy_offset);
  /* Backward: w's own Unshard gathers it again; v, which nobody holds any more, follows. */
  for (unsigned r = 0; r < 2; r++) {
    reshard_unit(&f, v, r);
    reshard_unit(&f, w, r);
  }
  on_every_rank(&f, w, 1, true, ops);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_true(v->flight->gathered && v->flight->gathered_step == 1 && v->flight->gathered_again);
  on_every_rank(&f, v, 1, true, ops); /* found there, with a gradient buffer each */
  for (unsigned r = 0; r < 2; r++) {
    assert_int_equal(ops[r].lent.unsharded_offset, v->flight->copy_offset);
    assert_true(ops[r].lent.full_grad_bytes > 0);
    fsdp_dataplane_release_session(f.job, r, f.ranks[r].session_id, "detached", 10 + r);
  }
  /* The gather of u ahead of its backward (it waited for a buffer) ends for nobody. */
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_false(f.unit->flight->gathered);
  assert_int_equal(f.job->copies.n_lent, 0);
  fixture_cleanup(&f);
}

/* With a given order, a rank's forward asks for its units one after the other: another
 * unit is refused naming the one expected; the same one again is not. */
static void test_out_of_order_asks(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 1, FSDP_UNIT_DTYPE_FP32);
  fsdp_unit_t *v = add_unit(&f, "v", FSDP_UNIT_FULL_SHARD, FSDP_UNIT_DTYPE_FP32);
  fsdp_unit_t *order[] = {f.unit, v};
  fsdp_dataplane_set_order(f.job, order, 2);
  fsdp_dataplane_op_t op;
  result_t r1 = {0}, r2 = {0}, r3 = {0}, r4 = {0};
  unshard_unit(&f, v, 0, 1, false, UINT64_MAX, &op, &r1);
  expect(&r1, FSDP_E_FAILED_PRECONDITION,
         "unit 'v': local rank 0 asked for it in the forward of step 1, but the forward order "
         "(SetSchedule) has 'u' next");
  on_every_rank(&f, f.unit, 1, false, &op);
  on_every_rank(&f, f.unit, 1, false, &op); /* again: free */
  on_every_rank(&f, v, 1, false, &op);
  unshard_unit(&f, f.unit, 0, 1, false, UINT64_MAX, &op, &r2);
  expect(&r2, FSDP_E_FAILED_PRECONDITION,
         "unit 'u': local rank 0 asked for it in the forward of step 1, but the forward order "
         "(SetSchedule) has no unit next");
  unshard_unit(&f, f.unit, 0, 1, true, UINT64_MAX, &op, &r3); /* the backward: any order */
  uv_run(&f.loop, UV_RUN_DEFAULT);
  expect(&r3, 0, "");
  /* A rank that comes back starts the order anew, even within the step it left. */
  on_every_rank(&f, f.unit, 2, false, &op);
  fsdp_dataplane_release_session(f.job, 0, f.ranks[0].session_id, "detached", 10);
  unshard_unit(&f, f.unit, 0, 2, false, UINT64_MAX, &op, &r4);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  expect(&r4, 0, "");
  fsdp_dataplane_release_session(f.job, 0, f.ranks[0].session_id, "detached", 10);
  fixture_cleanup(&f);
}

/* A rank holds at most max_inflight gradient buffers: the next backward's Unshard waits
 * until a reduce gives one back. */
static void test_gradient_buffers_wait_for_a_reduce(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 1, FSDP_UNIT_DTYPE_BF16);
  fsdp_unit_t *v = add_unit(&f, "v", FSDP_UNIT_FULL_SHARD, FSDP_UNIT_DTYPE_BF16);
  fsdp_unit_t *w = add_unit(&f, "w", FSDP_UNIT_FULL_SHARD, FSDP_UNIT_DTYPE_BF16);
  fsdp_dataplane_op_t u_op, v_op, w_op, reduce_op;
  on_every_rank(&f, f.unit, 1, true, &u_op);
  reshard_unit(&f, f.unit, 0);
  on_every_rank(&f, v, 1, true, &v_op);
  reshard_unit(&f, v, 0);
  assert_int_equal(f.job->grad_pools[0].n_lent, 2);
  result_t waiting = {0}, reduced = {0};
  unshard_unit(&f, w, 0, 1, true, UINT64_MAX, &w_op, &waiting);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_int_equal(waiting.calls, 0);
  assert_int_equal(f.job->grad_pools[0].n_waits, 1);
  fsdp_dataplane_reduce_how_t how = {0};
  fsdp_dataplane_reduce(&f.dp, f.job, f.unit, &f.ranks[0], 1, &how, UINT64_MAX, &reduce_op,
                        on_done, &reduced);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  expect(&reduced, 0, "");
  expect(&waiting, 0, "");
  assert_int_equal(w_op.lent.full_grad_offset, u_op.lent.full_grad_offset);
  assert_int_equal(f.job->grad_pools[0].most_lent, 2);
  reshard_unit(&f, w, 0);
  fsdp_dataplane_release_session(f.job, 0, f.ranks[0].session_id, "detached", 10);
  assert_int_equal(f.job->grad_pools[0].n_lent, 0);
  fixture_cleanup(&f);
}

static void count_quiet(void *arg) {
  (*(unsigned *)arg)++;
}

/* A checkpoint's hold on the job's reduces: it hears when the reduce that runs has ended,
 * the next step's gather goes on, and the next step's reduce waits until let go. */
static void test_held_reduces_start_when_let_go(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 2, FSDP_UNIT_DTYPE_UNSPECIFIED);
  fsdp_dataplane_op_t ops[2];
  result_t results[2] = {0};
  unsigned quiet = 0;
  lend_gradients(&f, 1, ops);
  for (unsigned r = 0; r < 2; r++)
    reduce(&f, r, 1, false, &ops[r], &results[r]); /* queued: it runs with the loop */
  assert_false(fsdp_dataplane_hold_reduces(&f.dp, f.job, 1, count_quiet, &quiet));
  uv_run(&f.loop, UV_RUN_DEFAULT);
  expect(&results[0], 0, "");
  expect(&results[1], 0, "");
  assert_int_equal(quiet, 1);

  lend_gradients(&f, 2, ops);
  memset(results, 0, sizeof results);
  for (unsigned r = 0; r < 2; r++)
    reduce(&f, r, 2, false, &ops[r], &results[r]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_int_equal(results[0].calls + results[1].calls, 0);
  assert_int_equal(f.unit->flight->reduced_step, 1);
  fsdp_dataplane_release_reduces(&f.dp, f.job);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  expect(&results[0], 0, "");
  expect(&results[1], 0, "");
  assert_int_equal(f.unit->flight->reduced_step, 2);
  assert_int_equal(quiet, 1);
  assert_true(fsdp_dataplane_hold_reduces(&f.dp, f.job, 2, count_quiet, &quiet));
  fsdp_dataplane_release_reduces(&f.dp, f.job);
  fixture_cleanup(&f);
}

/* While a hold waits for the running reduce of step 1, another unit's reduce of that step
 * still starts, so that the step ends; the holder hears once when both have. */
static void test_a_hold_lets_the_step_under_way_end(void **state) {
  (void)state;
  fixture_t f;
  fixture_init(&f, 2, FSDP_UNIT_DTYPE_UNSPECIFIED);
  fsdp_unit_t *v = add_unit(&f, "v", FSDP_UNIT_FULL_SHARD, FSDP_UNIT_DTYPE_UNSPECIFIED);
  fsdp_dataplane_op_t u_ops[2], v_ops[2];
  on_every_rank(&f, f.unit, 1, true, u_ops);
  on_every_rank(&f, v, 1, true, v_ops);
  result_t u_results[2] = {0}, v_results[2] = {0};
  unsigned quiet = 0;
  for (unsigned r = 0; r < 2; r++)
    reduce(&f, r, 1, false, &u_ops[r], &u_results[r]);
  assert_false(fsdp_dataplane_hold_reduces(&f.dp, f.job, 1, count_quiet, &quiet));
  fsdp_dataplane_reduce_how_t how = {0};
  for (unsigned r = 0; r < 2; r++)
    fsdp_dataplane_reduce(&f.dp, f.job, v, &f.ranks[r], 1, &how, UINT64_MAX, &v_ops[r],
                          on_done, &v_results[r]);
  uv_run(&f.loop, UV_RUN_DEFAULT);
  for (unsigned r = 0; r < 2; r++) {
    expect(&u_results[r], 0, "");
    expect(&v_results[r], 0, "");
  }
  assert_int_equal(v->flight->reduced_step, 1);
  assert_int_equal(quiet, 1);
  fsdp_dataplane_release_reduces(&f.dp, f.job);
  fixture_cleanup(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_buffers_of_each_rank),
      cmocka_unit_test(test_unshard_waits_for_every_rank),
      cmocka_unit_test(test_reduce_scatter_averages_the_ranks),
      cmocka_unit_test(test_steps_in_order),
      cmocka_unit_test(test_deadline_names_the_missing_rank),
      cmocka_unit_test(test_lost_session),
      cmocka_unit_test(test_cancel_withdraws_the_rank),
      cmocka_unit_test(test_no_buffers_yet),
      cmocka_unit_test(test_masters_are_the_copy),
      cmocka_unit_test(test_pool_caps_the_copies),
      cmocka_unit_test(test_pool_wait_expires),
      cmocka_unit_test(test_kept_copies_are_not_capped),
      cmocka_unit_test(test_backward_gathers_again),
      cmocka_unit_test(test_prefetch_follows_the_order),
      cmocka_unit_test(test_out_of_order_asks),
      cmocka_unit_test(test_gradient_buffers_wait_for_a_reduce),
      cmocka_unit_test(test_held_reduces_start_when_let_go),
      cmocka_unit_test(test_a_hold_lets_the_step_under_way_end),
  };
  return cmocka_run_group_tests_name("dataplane", tests, NULL, NULL);
}
