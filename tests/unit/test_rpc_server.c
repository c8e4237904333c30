/* The RPC adapter, in process: a server on a libuv loop with test handlers on the Operator
 * service descriptor, driven over TCP loopback by the client library from another thread.
 * Covers replies, mapped errors, unimplemented and unknown methods, malformed requests,
 * deferred replies, parked calls cancelled by the client's deadline, the in-flight limit,
 * and a stop that cancels parked calls after the drain time.
 *
 * cmocka's asserts must run on the test's thread, so client threads only record results. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "fsdp/v1/operator.pb-c.h"

#include "client/client_rpc.h"
#include "common/clock.h"
#include "daemon/rpc/rpc_server.h"

typedef struct result {
  int code;
  char message[512];
  char version[64];
} result_t;

typedef struct fixture fixture_t;
typedef void (*client_fn)(fixture_t *f);

struct fixture {
  uv_loop_t loop;
  fsdp_rpc_server_t *server;
  fsdp_rpc_service_t service;
  char target[64];
  uv_async_t client_done;
  uv_timer_t timer;
  client_fn client;
  uint64_t drain_ms;
  bool stop_when_parked; /* the Drain handler stops the server itself */

  /* Written by the loop, read by client threads. */
  atomic_int parked;
  atomic_int cancels;
  fsdp_rpc_call_t *deferred;

  result_t results[4];
  bool stopped;
};

static void record(result_t *r, fsdp_client_t *client, int code, ProtobufCMessage *reply) {
  r->code = code;
  snprintf(r->message, sizeof r->message, "%s", fsdp_client_last_error(client));
  if (reply) {
    snprintf(r->version, sizeof r->version, "%s", ((Fsdp__V1__StatusReply *)reply)->version);
    protobuf_c_message_free_unpacked(reply, NULL);
  }
}

static void call(fixture_t *f, const char *method, int timeout_ms, result_t *r) {
  fsdp_client_t *client;
  if (fsdp_client_connect(f->target, NULL, &client) < 0) {
    r->code = -999;
    return;
  }
  Fsdp__V1__StatusRequest rq = FSDP__V1__STATUS_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  int code = fsdp_client_call(client, method, &rq.base, &fsdp__v1__status_reply__descriptor,
                              timeout_ms, &reply);
  record(r, client, code, reply);
  fsdp_client_close(client);
}

/* Handlers. */

static void status_handler(fsdp_rpc_call_t *c, const ProtobufCMessage *request, void *data) {
  (void)request;
  (void)data;
  Fsdp__V1__StatusReply reply = FSDP__V1__STATUS_REPLY__INIT;
  reply.version = "test-1";
  fsdp_rpc_call_reply(c, &reply.base);
}

static void failing_handler(fsdp_rpc_call_t *c, const ProtobufCMessage *request, void *data) {
  (void)request;
  (void)data;
  fsdp_rpc_call_fail(c, FSDP_E_ALREADY_EXISTS, "unit '%s' already registered", "layer3");
}

static void on_parked_cancel(fsdp_rpc_call_t *c, void *data) {
  (void)c;
  fixture_t *f = data;
  atomic_fetch_sub(&f->parked, 1);
  atomic_fetch_add(&f->cancels, 1);
}

static void stop_server(fixture_t *f);

static void on_stop_timer(uv_timer_t *timer) {
  stop_server(timer->data);
}

static void parking_handler(fsdp_rpc_call_t *c, const ProtobufCMessage *request, void *data) {
  (void)request;
  fixture_t *f = data;
  fsdp_rpc_call_on_cancel(c, on_parked_cancel, f);
  atomic_fetch_add(&f->parked, 1);
  if (f->stop_when_parked)
    uv_timer_start(&f->timer, on_stop_timer, 10, 0);
}

static void on_deferred_timer(uv_timer_t *timer) {
  fixture_t *f = timer->data;
  Fsdp__V1__StatusReply reply = FSDP__V1__STATUS_REPLY__INIT;
  reply.version = "deferred";
  fsdp_rpc_call_reply(f->deferred, &reply.base);
  f->deferred = NULL;
}

static void deferring_handler(fsdp_rpc_call_t *c, const ProtobufCMessage *request, void *data) {
  (void)request;
  fixture_t *f = data;
  f->deferred = c;
  uv_timer_start(&f->timer, on_deferred_timer, 30, 0);
  if (f->stop_when_parked)
    stop_server(f);
}

static void draining_handler(fsdp_rpc_call_t *c, const ProtobufCMessage *request, void *data) {
  fixture_t *f = data;
  fsdp_rpc_server_set_draining(f->server, true);
  status_handler(c, request, data);
}

/* ListUnits has no handler on purpose: the adapter must answer UNIMPLEMENTED. */
static const fsdp_rpc_handler_t handlers[] = {
    {"Status", status_handler, false},
    {"ReloadConfig", failing_handler, false},
    {"Drain", parking_handler, false},
    {"Resume", deferring_handler, false},
    {"SaveCheckpoint", draining_handler, true},
    {"LoadCheckpoint", status_handler, true},
};

/* Harness. */

static void on_server_stopped(void *data) {
  fixture_t *f = data;
  fsdp_rpc_server_free(f->server);
  f->server = NULL;
  f->stopped = true;
}

static void on_closed(uv_handle_t *handle) {
  (void)handle;
}

static void stop_server(fixture_t *f) {
  if (f->server)
    fsdp_rpc_server_stop(f->server, f->drain_ms, on_server_stopped, f);
}

static void on_client_done(uv_async_t *async) {
  fixture_t *f = async->data;
  stop_server(f);
  uv_close((uv_handle_t *)&f->client_done, on_closed);
  uv_close((uv_handle_t *)&f->timer, on_closed);
}

static void *client_thread(void *arg) {
  fixture_t *f = arg;
  f->client(f);
  uv_async_send(&f->client_done);
  return NULL;
}

static fixture_t *run(client_fn client, unsigned max_inflight, uint64_t drain_ms,
                      bool stop_when_parked) {
  fixture_t *f = calloc(1, sizeof *f);
  assert_non_null(f);
  f->client = client;
  f->drain_ms = drain_ms;
  f->stop_when_parked = stop_when_parked;
  assert_int_equal(uv_loop_init(&f->loop), 0);
  uv_async_init(&f->loop, &f->client_done, on_client_done);
  uv_timer_init(&f->loop, &f->timer);
  f->client_done.data = f->timer.data = f;

  fsdp_rpc_server_options_t options = {.max_message_size = 1 << 20};
  fsdp_rpc_endpoint_options_t endpoint_options = {.max_inflight_calls = max_inflight,
                                                  .limit_name = "test.limit"};
  assert_int_equal(fsdp_rpc_server_new(&f->loop, &options, &f->server), 0);
  f->service = (fsdp_rpc_service_t){&fsdp__v1__operator__descriptor, handlers,
                                    sizeof handlers / sizeof handlers[0], f};
  fsdp_rpc_endpoint_t *endpoint;
  assert_int_equal(
      fsdp_rpc_server_add_endpoint(f->server, "test", &f->service, 1, &endpoint_options, &endpoint),
      0);
  int port = 0;
  fsdp_status_t st;
  assert_int_equal(fsdp_rpc_endpoint_listen(endpoint, "127.0.0.1:0", &port, &st), 0);
  snprintf(f->target, sizeof f->target, "127.0.0.1:%d", port);
  assert_int_equal(fsdp_rpc_server_start(f->server), 0);

  pthread_t thread;
  assert_int_equal(pthread_create(&thread, NULL, client_thread, f), 0);
  uv_run(&f->loop, UV_RUN_DEFAULT);
  pthread_join(thread, NULL);
  assert_true(f->stopped);
  assert_int_equal(uv_loop_close(&f->loop), 0);
  return f;
}

static void wait_parked(fixture_t *f, int n) {
  for (int i = 0; i < 5000 && atomic_load(&f->parked) < n; i++)
    usleep(1000);
}

/* Tests. */

static void unary_calls(fixture_t *f) {
  call(f, "/fsdp.v1.Operator/Status", 2000, &f->results[0]);
  call(f, "/fsdp.v1.Operator/ReloadConfig", 2000, &f->results[1]);
  call(f, "/fsdp.v1.Operator/ListUnits", 2000, &f->results[2]);
  call(f, "/fsdp.v1.Nope/Nothing", 2000, &f->results[3]);
}

static void test_replies_errors_and_unimplemented(void **state) {
  (void)state;
  fixture_t *f = run(unary_calls, 16, 100, false);
  assert_int_equal(f->results[0].code, 0);
  assert_string_equal(f->results[0].version, "test-1");
  assert_int_equal(f->results[1].code, FSDP_E_ALREADY_EXISTS);
  assert_string_equal(f->results[1].message, "unit 'layer3' already registered");
  assert_int_equal(f->results[2].code, FSDP_E_UNIMPLEMENTED);
  assert_non_null(strstr(f->results[2].message, "/fsdp.v1.Operator/ListUnits is not implemented"));
  assert_int_equal(f->results[3].code, FSDP_E_UNIMPLEMENTED);
  assert_string_equal(f->results[3].message, "unknown method '/fsdp.v1.Nope/Nothing' on the test endpoint");
  free(f);
}

static void malformed_request(fixture_t *f) {
  fsdp_client_t *client;
  if (fsdp_client_connect(f->target, NULL, &client) < 0)
    return;
  const uint8_t truncated[] = {0x0a, 0x05, 'x'}; /* a 5-byte field with 1 byte */
  uint8_t *reply = NULL;
  size_t len = 0;
  int code = fsdp_client_call_raw(client, "/fsdp.v1.Operator/Status", truncated, sizeof truncated,
                                  2000, &reply, &len);
  record(&f->results[0], client, code, NULL);
  free(reply);
  /* The server is still fine afterwards. */
  Fsdp__V1__StatusRequest rq = FSDP__V1__STATUS_REQUEST__INIT;
  ProtobufCMessage *ok = NULL;
  code = fsdp_client_call(client, "/fsdp.v1.Operator/Status", &rq.base,
                          &fsdp__v1__status_reply__descriptor, 2000, &ok);
  record(&f->results[1], client, code, ok);
  fsdp_client_close(client);
}

static void test_malformed_request_is_invalid_argument(void **state) {
  (void)state;
  fixture_t *f = run(malformed_request, 16, 100, false);
  assert_int_equal(f->results[0].code, FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(f->results[0].message,
                      "/fsdp.v1.Operator/Status: malformed fsdp.v1.StatusRequest: 3 bytes do not "
                      "decode as this message");
  assert_int_equal(f->results[1].code, 0);
  free(f);
}

static void deferred_reply(fixture_t *f) {
  call(f, "/fsdp.v1.Operator/Resume", 2000, &f->results[0]);
}

static void test_deferred_reply(void **state) {
  (void)state;
  fixture_t *f = run(deferred_reply, 16, 100, false);
  assert_int_equal(f->results[0].code, 0);
  assert_string_equal(f->results[0].version, "deferred");
  free(f);
}

typedef struct parked_call_args {
  fixture_t *f;
  int timeout_ms;
} parked_call_args_t;

static void *parked_caller(void *arg) {
  fixture_t *f = arg;
  call(f, "/fsdp.v1.Operator/Drain", 400, &f->results[0]);
  return NULL;
}

static void deadline_and_limit(fixture_t *f) {
  pthread_t parked;
  pthread_create(&parked, NULL, parked_caller, f);
  wait_parked(f, 1);
  /* With max_inflight_calls = 1 the parked call fills the daemon. */
  call(f, "/fsdp.v1.Operator/Status", 2000, &f->results[1]);
  pthread_join(parked, NULL);
  /* The deadline frees the slot once the server has heard of the cancellation, which races
   * with the client's own deadline: retry for a while. */
  for (int i = 0; i < 200; i++) {
    call(f, "/fsdp.v1.Operator/Status", 2000, &f->results[2]);
    if (f->results[2].code != FSDP_E_RESOURCE_EXHAUSTED)
      break;
    usleep(10000);
  }
}

static void test_deadline_cancels_parked_call_and_limit_holds(void **state) {
  (void)state;
  fixture_t *f = run(deadline_and_limit, 1, 100, false);
  assert_int_equal(f->results[0].code, FSDP_E_DEADLINE_EXCEEDED);
  assert_int_equal(f->results[1].code, FSDP_E_RESOURCE_EXHAUSTED);
  assert_string_equal(f->results[1].message,
                      "/fsdp.v1.Operator/Status: the test endpoint already holds 1 calls of work "
                      "(test.limit = 1)");
  assert_int_equal(f->results[2].code, 0);
  assert_int_equal(atomic_load(&f->cancels), 1);
  assert_int_equal(atomic_load(&f->parked), 0);
  free(f);
}

static void parked_through_stop(fixture_t *f) {
  fsdp_client_t *client;
  if (fsdp_client_connect(f->target, NULL, &client) < 0)
    return;
  Fsdp__V1__StatusRequest rq = FSDP__V1__STATUS_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  int64_t t0 = fsdp_clock_now_ms();
  int code = fsdp_client_call(client, "/fsdp.v1.Operator/Drain", &rq.base,
                              &fsdp__v1__status_reply__descriptor, 10000, &reply);
  int64_t t1 = fsdp_clock_now_ms();
  record(&f->results[0], client, code, reply);
  f->results[1].code = (int)(t1 - t0);
  fsdp_client_close(client);
}

static void test_stop_cancels_parked_calls_after_drain(void **state) {
  (void)state;
  fixture_t *f = run(parked_through_stop, 16, 400, true);
  assert_int_equal(f->results[0].code, FSDP_E_UNAVAILABLE);
  /* The client may add that the daemon is gone by the time it reads the status. */
  assert_non_null(strstr(f->results[0].message, "fsdpd is shutting down"));
  assert_int_equal(atomic_load(&f->cancels), 1);
  /* The stop began 10 ms after parking; held work ends once the drain time less the grace
   * for final replies (a quarter, at most 250 ms) is up: near 310 ms, far before 10 s. */
  assert_in_range(f->results[1].code, 300, 2000);
  free(f);
}

static void work_done_during_stop(fixture_t *f) {
  int64_t t0 = fsdp_clock_now_ms();
  call(f, "/fsdp.v1.Operator/Resume", 10000, &f->results[0]);
  f->results[1].code = (int)(fsdp_clock_now_ms() - t0);
}

static void test_stop_ends_as_soon_as_work_is_done(void **state) {
  (void)state;
  int64_t t0 = fsdp_clock_now_ms();
  /* A 5 s drain; the deferred reply comes after 30 ms and the stop follows it at once. */
  fixture_t *f = run(work_done_during_stop, 16, 5000, true);
  int64_t elapsed_ms = fsdp_clock_now_ms() - t0;
  assert_int_equal(f->results[0].code, 0);
  assert_string_equal(f->results[0].version, "deferred");
  assert_in_range(elapsed_ms, 0, 2000);
  free(f);
}

static void draining_calls(fixture_t *f) {
  call(f, "/fsdp.v1.Operator/Status", 2000, &f->results[0]);
  call(f, "/fsdp.v1.Operator/SaveCheckpoint", 2000, &f->results[1]); /* starts draining */
  call(f, "/fsdp.v1.Operator/Status", 2000, &f->results[2]);
  call(f, "/fsdp.v1.Operator/LoadCheckpoint", 2000, &f->results[3]);
}

static void test_draining_refuses_work_and_serves_the_rest(void **state) {
  (void)state;
  fixture_t *f = run(draining_calls, 16, 100, false);
  assert_int_equal(f->results[0].code, 0);
  assert_int_equal(f->results[1].code, 0);
  assert_int_equal(f->results[2].code, FSDP_E_UNAVAILABLE);
  assert_string_equal(f->results[2].message,
                      "/fsdp.v1.Operator/Status: fsdpd is draining and takes no new work");
  assert_int_equal(f->results[3].code, 0); /* served while draining */
  assert_string_equal(f->results[3].version, "test-1");
  free(f);
}

static void test_handler_for_unknown_method_is_refused(void **state) {
  (void)state;
  uv_loop_t loop;
  uv_loop_init(&loop);
  fsdp_rpc_server_t *server;
  fsdp_rpc_server_options_t options = {.max_message_size = 4096};
  fsdp_rpc_endpoint_options_t endpoint_options = {.max_inflight_calls = 4, .limit_name = "x"};
  assert_int_equal(fsdp_rpc_server_new(&loop, &options, &server), 0);
  static const fsdp_rpc_handler_t typo[] = {{"Stauts", status_handler, false}};
  fsdp_rpc_service_t service = {&fsdp__v1__operator__descriptor, typo, 1, NULL};
  fsdp_rpc_endpoint_t *endpoint;
  assert_int_equal(
      fsdp_rpc_server_add_endpoint(server, "typo", &service, 1, &endpoint_options, &endpoint),
      -EINVAL);
  fsdp_rpc_server_free(server);
  uv_run(&loop, UV_RUN_DEFAULT);
  assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_replies_errors_and_unimplemented),
      cmocka_unit_test(test_malformed_request_is_invalid_argument),
      cmocka_unit_test(test_deferred_reply),
      cmocka_unit_test(test_deadline_cancels_parked_call_and_limit_holds),
      cmocka_unit_test(test_stop_cancels_parked_calls_after_drain),
      cmocka_unit_test(test_stop_ends_as_soon_as_work_is_done),
      cmocka_unit_test(test_draining_refuses_work_and_serves_the_rest),
      cmocka_unit_test(test_handler_for_unknown_method_is_refused),
  };
  return cmocka_run_group_tests_name("rpc_server", tests, NULL, NULL);
}
