/* The completion-queue-to-loop bridge (daemon/rpc/cq_bridge.h): what another thread posts
 * reaches the loop in order, a real gRPC completion passes the queue's thread and then the
 * loop, and close calls back once, later, never inside the call. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "daemon/rpc/cq_bridge.h"

#define N_POSTS 1000

typedef struct fixture {
  uv_loop_t loop;
  pthread_t loop_thread;
  fsdp_cq_bridge_t *bridge;
  uintptr_t tags[N_POSTS];
  bool successes[N_POSTS];
  unsigned n_events, n_drained, n_done;
  unsigned n_cq_events;
  bool cq_event_off_loop;
  bool closing_now; /* inside fsdp_cq_bridge_close */
} fixture_t;

static void on_done(void *data) {
  fixture_t *f = data;
  assert_false(f->closing_now);
  f->n_done++;
}

static void close_bridge(fixture_t *f) {
  f->closing_now = true;
  fsdp_cq_bridge_close(f->bridge, on_done, f);
  f->closing_now = false;
}

static void on_event(void *data, void *tag, bool success) {
  fixture_t *f = data;
  assert_true(pthread_equal(pthread_self(), f->loop_thread));
  assert_true(f->n_events < N_POSTS);
  f->tags[f->n_events] = (uintptr_t)tag;
  f->successes[f->n_events++] = success;
}

static void on_drained(void *data) {
  ((fixture_t *)data)->n_drained++;
}

static void on_cq_event(void *data, void *tag, bool success) {
  fixture_t *f = data;
  f->cq_event_off_loop = !pthread_equal(pthread_self(), f->loop_thread);
  f->n_cq_events++;
  fsdp_cq_bridge_post(f->bridge, tag, success);
}

static void setup(fixture_t *f, const fsdp_cq_bridge_ops_t *ops) {
  memset(f, 0, sizeof *f);
  f->loop_thread = pthread_self();
  assert_int_equal(uv_loop_init(&f->loop), 0);
  assert_int_equal(fsdp_cq_bridge_new(&f->loop, ops, f, &f->bridge), 0);
  assert_int_equal(fsdp_cq_bridge_start(f->bridge), 0);
}

static void *poster(void *arg) {
  fixture_t *f = arg;
  for (uintptr_t i = 1; i <= N_POSTS; i++)
    fsdp_cq_bridge_post(f->bridge, (void *)i, i % 3 != 0);
  return NULL;
}

static void test_posts_reach_the_loop_in_order(void **state) {
  (void)state;
  grpc_init();
  fixture_t f;
  setup(&f, &(fsdp_cq_bridge_ops_t){.on_event = on_event, .on_drained = on_drained});
  pthread_t thread;
  assert_int_equal(pthread_create(&thread, NULL, poster, &f), 0);
  while (f.n_events < N_POSTS)
    uv_run(&f.loop, UV_RUN_ONCE);
  pthread_join(thread, NULL); /* no post may race the close */
  close_bridge(&f);
  assert_int_equal(f.n_done, 0); /* later, not inside the close */
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_int_equal(f.n_events, N_POSTS);
  for (unsigned i = 0; i < N_POSTS; i++) {
    assert_int_equal(f.tags[i], i + 1);
    assert_int_equal(f.successes[i], (i + 1) % 3 != 0);
  }
  /* Wake-ups coalesce, but each drain is followed by on_drained, until the close. */
  assert_true(f.n_drained >= 1 && f.n_drained <= N_POSTS);
  assert_int_equal(f.n_done, 1);
  assert_int_equal(uv_loop_close(&f.loop), 0);
  grpc_shutdown();
}

/* A call to a port where nobody listens ends at once with UNAVAILABLE: one completion. */
static void test_a_grpc_completion_passes_the_queue_thread(void **state) {
  (void)state;
  grpc_init();
  fixture_t f;
  setup(&f,
        &(fsdp_cq_bridge_ops_t){.on_event = on_event, .on_drained = on_drained,
                                .on_cq_event = on_cq_event});
  grpc_channel_credentials *creds = grpc_insecure_credentials_create();
  /* No proxy from the environment between us and the refusal. */
  grpc_arg arg = {GRPC_ARG_INTEGER, GRPC_ARG_ENABLE_HTTP_PROXY, {.integer = 0}};
  grpc_channel_args args = {1, &arg};
  grpc_channel *channel = grpc_channel_create("127.0.0.1:1", creds, &args);
  grpc_channel_credentials_release(creds);
  gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                       gpr_time_from_millis(10000, GPR_TIMESPAN));
  grpc_call *call = grpc_channel_create_call(channel, NULL, GRPC_PROPAGATE_DEFAULTS,
                                             fsdp_cq_bridge_queue(f.bridge),
                                             grpc_slice_from_static_string("/x.Y/Z"), NULL,
                                             deadline, NULL);
  grpc_metadata_array trailing;
  grpc_metadata_array_init(&trailing);
  grpc_status_code status = GRPC_STATUS_OK;
  grpc_slice details;
  grpc_op ops[2];
  memset(ops, 0, sizeof ops);
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  ops[1].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  ops[1].data.recv_status_on_client.trailing_metadata = &trailing;
  ops[1].data.recv_status_on_client.status = &status;
  ops[1].data.recv_status_on_client.status_details = &details;
  static int tag;
  assert_int_equal(grpc_call_start_batch(call, ops, 2, &tag, NULL), GRPC_CALL_OK);
  while (f.n_events == 0)
    uv_run(&f.loop, UV_RUN_ONCE);
  assert_int_equal(f.n_cq_events, 1);
  assert_true(f.cq_event_off_loop);
  assert_int_equal(f.n_events, 1);
  assert_ptr_equal((void *)f.tags[0], &tag);
  assert_true(f.successes[0]);
  assert_int_equal(status, GRPC_STATUS_UNAVAILABLE);
  grpc_slice_unref(details);
  grpc_metadata_array_destroy(&trailing);
  grpc_call_unref(call);
  grpc_channel_destroy(channel);

  close_bridge(&f);
  assert_int_equal(f.n_done, 0); /* later, not inside the close */
  uv_run(&f.loop, UV_RUN_DEFAULT);
  assert_int_equal(f.n_done, 1);
  assert_int_equal(uv_loop_close(&f.loop), 0);
  grpc_shutdown();
}

static void test_a_bridge_never_started_is_freed(void **state) {
  (void)state;
  grpc_init();
  uv_loop_t loop;
  assert_int_equal(uv_loop_init(&loop), 0);
  fsdp_cq_bridge_t *bridge;
  assert_int_equal(
      fsdp_cq_bridge_new(&loop, &(fsdp_cq_bridge_ops_t){.on_event = on_event}, NULL, &bridge),
      0);
  assert_non_null(fsdp_cq_bridge_queue(bridge));
  fsdp_cq_bridge_free(bridge);
  fsdp_cq_bridge_free(NULL);
  assert_int_equal(uv_loop_close(&loop), 0);
  grpc_shutdown();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_posts_reach_the_loop_in_order),
      cmocka_unit_test(test_a_grpc_completion_passes_the_queue_thread),
      cmocka_unit_test(test_a_bridge_never_started_is_freed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
