/* Unit tests of the client library without fsdpd: argument checks, an unreachable daemon,
 * last-error behaviour, and status mapping against a small in-process gRPC server that
 * plays scripted parts (health, echo, silence, garbage). The real daemon is covered by the
 * integration tests. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include <fsdp/fsdp_client.h>

#include "client/client_rpc.h"
#include "common/clock.h"
#include "grpc/health/v1/health.pb-c.h"
#include "proto/wire.h"

#define HEALTH_CHECK "/grpc.health.v1.Health/Check"

/* The fake server: one thread, one call at a time, which is all a single client makes. */
typedef struct fake_server {
  grpc_server *server;
  grpc_completion_queue *cq;
  pthread_t thread;
  char path[108];
  char target[128];
} fake_server_t;

enum { TAG_NEW = 1, TAG_RECV, TAG_SEND, TAG_CLOSE, TAG_SHUTDOWN };

static void *tag_of(intptr_t t) {
  return (void *)t;
}

/* Waits for one tag; other tags cannot be outstanding in this server except TAG_SHUTDOWN,
 * which only comes after the client has stopped calling. */
static grpc_event wait_tag(fake_server_t *fs, intptr_t tag) {
  for (;;) {
    grpc_event ev = grpc_completion_queue_next(fs->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type != GRPC_OP_COMPLETE || ev.tag == tag_of(tag))
      return ev;
  }
}

static void finish(fake_server_t *fs, grpc_call *call, grpc_byte_buffer *reply,
                   grpc_status_code status, const char *message) {
  grpc_slice details = grpc_slice_from_copied_string(message);
  int cancelled = 0;
  grpc_op ops[4];
  memset(ops, 0, sizeof ops);
  size_t n = 0;
  ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (reply) {
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = reply;
  }
  ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
  ops[n].data.send_status_from_server.status = status;
  ops[n++].data.send_status_from_server.status_details = &details;
  ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  ops[n++].data.recv_close_on_server.cancelled = &cancelled;
  assert_int_equal(grpc_call_start_batch(call, ops, n, tag_of(TAG_SEND), NULL), GRPC_CALL_OK);
  wait_tag(fs, TAG_SEND);
  grpc_slice_unref(details);
  if (reply)
    grpc_byte_buffer_destroy(reply);
}

static grpc_byte_buffer *bytes_buffer(const void *data, size_t len) {
  grpc_slice s = grpc_slice_from_copied_buffer(data, len);
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  return bb;
}

static void serve_health(fake_server_t *fs, grpc_call *call, grpc_byte_buffer *request) {
  ProtobufCMessage *msg = NULL;
  fsdp_status_t st = FSDP_STATUS_INIT;
  if (fsdp_wire_decode(&grpc__health__v1__health_check_request__descriptor, request, &msg, &st) <
      0) {
    finish(fs, call, NULL, GRPC_STATUS_INVALID_ARGUMENT, st.message);
    return;
  }
  const char *service = ((Grpc__Health__V1__HealthCheckRequest *)msg)->service;
  Grpc__Health__V1__HealthCheckResponse reply = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  grpc_byte_buffer *bb = NULL;
  if (strcmp(service, "") == 0 || strcmp(service, "down") == 0) {
    reply.status = *service ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING
                            : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    assert_int_equal(fsdp_wire_encode(&reply.base, &bb), 0);
    finish(fs, call, bb, GRPC_STATUS_OK, "");
  } else if (strcmp(service, "garbage") == 0) {
    /* Field 1 as a varint whose continuation never ends. */
    static const uint8_t junk[] = {0x08, 0xff, 0xff};
    finish(fs, call, bytes_buffer(junk, sizeof junk), GRPC_STATUS_OK, "");
  } else if (strcmp(service, "silent") == 0) {
    finish(fs, call, NULL, GRPC_STATUS_NOT_FOUND, "");
  } else {
    char message[256];
    snprintf(message, sizeof message, "unknown service '%s'", service);
    finish(fs, call, NULL, GRPC_STATUS_NOT_FOUND, message);
  }
  protobuf_c_message_free_unpacked(msg, NULL);
}

/* "/test/Slow" never answers; the server waits until the client gives up. */
static void serve_slow(fake_server_t *fs, grpc_call *call) {
  int cancelled = 0;
  grpc_op op;
  memset(&op, 0, sizeof op);
  op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
  op.data.recv_close_on_server.cancelled = &cancelled;
  assert_int_equal(grpc_call_start_batch(call, &op, 1, tag_of(TAG_CLOSE), NULL), GRPC_CALL_OK);
  wait_tag(fs, TAG_CLOSE);
}

static void *server_main(void *arg) {
  fake_server_t *fs = arg;
  for (;;) {
    grpc_call *call = NULL;
    grpc_call_details details;
    grpc_metadata_array md;
    grpc_call_details_init(&details);
    grpc_metadata_array_init(&md);
    grpc_server_request_call(fs->server, &call, &details, &md, fs->cq, fs->cq, tag_of(TAG_NEW));
    grpc_event ev = wait_tag(fs, TAG_NEW);
    if (ev.type != GRPC_OP_COMPLETE || !ev.success) {
      grpc_call_details_destroy(&details);
      grpc_metadata_array_destroy(&md);
      return NULL; /* shutting down */
    }
    grpc_byte_buffer *request = NULL;
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &request;
    assert_int_equal(grpc_call_start_batch(call, &op, 1, tag_of(TAG_RECV), NULL), GRPC_CALL_OK);
    wait_tag(fs, TAG_RECV);

    if (grpc_slice_str_cmp(details.method, HEALTH_CHECK) == 0) {
      serve_health(fs, call, request);
    } else if (grpc_slice_str_cmp(details.method, "/test/Echo") == 0) {
      if (request) {
        grpc_byte_buffer_reader r;
        assert_true(grpc_byte_buffer_reader_init(&r, request));
        grpc_slice all = grpc_byte_buffer_reader_readall(&r);
        grpc_byte_buffer_reader_destroy(&r);
        finish(fs, call, bytes_buffer(GRPC_SLICE_START_PTR(all), GRPC_SLICE_LENGTH(all)),
               GRPC_STATUS_OK, "");
        grpc_slice_unref(all);
      } else {
        finish(fs, call, NULL, GRPC_STATUS_INVALID_ARGUMENT, "no request message");
      }
    } else if (grpc_slice_str_cmp(details.method, "/test/Slow") == 0) {
      serve_slow(fs, call);
    } else {
      finish(fs, call, NULL, GRPC_STATUS_UNIMPLEMENTED, "no such method here");
    }
    if (request)
      grpc_byte_buffer_destroy(request);
    grpc_call_unref(call);
    grpc_call_details_destroy(&details);
    grpc_metadata_array_destroy(&md);
  }
}

static int server_setup(void **state) {
  fake_server_t *fs = calloc(1, sizeof *fs);
  assert_non_null(fs);
  grpc_init();
  snprintf(fs->path, sizeof fs->path, "/tmp/test_client_%d.sock", (int)getpid());
  snprintf(fs->target, sizeof fs->target, "unix:%s", fs->path);
  unlink(fs->path);
  fs->cq = grpc_completion_queue_create_for_next(NULL);
  fs->server = grpc_server_create(NULL, NULL);
  grpc_server_register_completion_queue(fs->server, fs->cq, NULL);
  grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
  assert_int_equal(grpc_server_add_http2_port(fs->server, fs->target, creds), 1);
  grpc_server_credentials_release(creds);
  grpc_server_start(fs->server);
  assert_int_equal(pthread_create(&fs->thread, NULL, server_main, fs), 0);
  *state = fs;
  return 0;
}

static int server_teardown(void **state) {
  fake_server_t *fs = *state;
  grpc_server_shutdown_and_notify(fs->server, fs->cq, tag_of(TAG_SHUTDOWN));
  grpc_server_cancel_all_calls(fs->server);
  pthread_join(fs->thread, NULL);
  /* The server thread has left; collect the shutdown notice ourselves if it did not. */
  grpc_event ev;
  do {
    ev = grpc_completion_queue_next(fs->cq, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                                         gpr_time_from_millis(5000, GPR_TIMESPAN)),
                                    NULL);
  } while (ev.type == GRPC_OP_COMPLETE && ev.tag != tag_of(TAG_SHUTDOWN));
  grpc_server_destroy(fs->server);
  grpc_completion_queue_shutdown(fs->cq);
  while (grpc_completion_queue_next(fs->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
         GRPC_QUEUE_SHUTDOWN) {
  }
  grpc_completion_queue_destroy(fs->cq);
  grpc_shutdown();
  unlink(fs->path);
  free(fs);
  return 0;
}

/* Tests without a server. */

static void test_bad_arguments(void **state) {
  (void)state;
  fsdp_client_t *client = (fsdp_client_t *)0x1;
  assert_int_equal(fsdp_client_connect(NULL, NULL, &client), -EINVAL);
  assert_int_equal(fsdp_client_connect("", NULL, &client), -EINVAL);
  assert_int_equal(fsdp_client_connect("unix:/x", NULL, NULL), -EINVAL);
  fsdp_client_options_t opts = FSDP_CLIENT_OPTIONS_INIT;
  opts.timeout_ms = -1;
  assert_int_equal(fsdp_client_connect("unix:/x", &opts, &client), -EINVAL);
  opts.timeout_ms = 0;
  opts.max_message_bytes = -5;
  assert_int_equal(fsdp_client_connect("unix:/x", &opts, &client), -EINVAL);
  assert_ptr_equal(client, (fsdp_client_t *)0x1); /* outputs written only on success */

  fsdp_health_status_t hs = FSDP_HEALTH_UNKNOWN;
  assert_int_equal(fsdp_client_health_check(NULL, "", 100, &hs), -EINVAL);
  assert_string_equal(fsdp_client_last_error(NULL), "");
  fsdp_client_close(NULL);

  assert_int_equal(fsdp_client_connect("unix:/nonexistent/fsdpd.sock", NULL, &client), 0);
  assert_string_equal(fsdp_client_last_error(client), "");
  assert_int_equal(fsdp_client_default_timeout_ms(client), FSDP_CLIENT_DEFAULT_TIMEOUT_MS);
  assert_int_equal(fsdp_client_health_check(client, "", 100, NULL), -EINVAL);
  assert_string_not_equal(fsdp_client_last_error(client), "");
  uint8_t *reply = NULL;
  size_t len = 0;
  assert_int_equal(fsdp_client_call_raw(client, NULL, "", 0, 100, &reply, &len), -EINVAL);
  assert_int_equal(fsdp_client_call_raw(client, "no-slash", "", 0, 100, &reply, &len), -EINVAL);
  assert_int_equal(fsdp_client_call_raw(client, "/a/b", NULL, 3, 100, &reply, &len), -EINVAL);
  ProtobufCMessage *msg = NULL;
  assert_int_equal(fsdp_client_call(client, HEALTH_CHECK, NULL,
                                    &grpc__health__v1__health_check_response__descriptor, 100,
                                    &msg),
                   -EINVAL);
  fsdp_client_close(client);
}

static void test_health_status_names(void **state) {
  (void)state;
  assert_string_equal(fsdp_health_status_name(FSDP_HEALTH_SERVING), "SERVING");
  assert_string_equal(fsdp_health_status_name(FSDP_HEALTH_NOT_SERVING), "NOT_SERVING");
  assert_string_equal(fsdp_health_status_name(FSDP_HEALTH_SERVICE_UNKNOWN), "SERVICE_UNKNOWN");
  assert_string_equal(fsdp_health_status_name(FSDP_HEALTH_UNKNOWN), "UNKNOWN");
  assert_string_equal(fsdp_health_status_name((fsdp_health_status_t)42), "UNKNOWN");
}

static void test_unreachable_fails_fast(void **state) {
  (void)state;
  char target[128];
  snprintf(target, sizeof target, "unix:/tmp/test_client_missing_%d/fsdpd.sock", (int)getpid());
  fsdp_client_t *client = NULL;
  assert_int_equal(fsdp_client_connect(target, NULL, &client), 0);
  fsdp_health_status_t hs = (fsdp_health_status_t)99;
  int64_t t0 = fsdp_clock_now_ms();
  int r = fsdp_client_health_check(client, "", 2000, &hs);
  int64_t elapsed = fsdp_clock_now_ms() - t0;
  assert_int_equal(r, FSDP_E_UNAVAILABLE);
  assert_true(elapsed < 2000);
  assert_int_equal(hs, 99); /* untouched on failure */
  const char *message = fsdp_client_last_error(client);
  assert_non_null(strstr(message, target));
  /* A second call on the same channel fails the same way, and as fast. */
  t0 = fsdp_clock_now_ms();
  assert_int_equal(fsdp_client_health_check(client, "", 2000, &hs), FSDP_E_UNAVAILABLE);
  assert_true(fsdp_clock_now_ms() - t0 < 2000);
  assert_string_not_equal(fsdp_client_last_error(client), "");
  fsdp_client_close(client);
}

static void test_unreachable_wait_for_ready_hits_deadline(void **state) {
  (void)state;
  fsdp_client_options_t opts = FSDP_CLIENT_OPTIONS_INIT;
  opts.wait_for_ready = true;
  opts.timeout_ms = 300;
  fsdp_client_t *client = NULL;
  assert_int_equal(fsdp_client_connect("unix:/tmp/test_client_missing/x.sock", &opts, &client), 0);
  fsdp_health_status_t hs;
  int64_t t0 = fsdp_clock_now_ms();
  assert_int_equal(fsdp_client_health_check(client, NULL, 0, &hs), FSDP_E_DEADLINE_EXCEEDED);
  int64_t elapsed = fsdp_clock_now_ms() - t0;
  assert_true(elapsed >= 250 && elapsed < 2300);
  assert_non_null(strstr(fsdp_client_last_error(client), "300 ms"));
  fsdp_client_close(client);
}

/* A daemon that accepted the connection but is slow to answer (stopped, swapped out, busy
 * on a loaded host) must look slow, not unreachable: the call waits out its own deadline. */
static void test_slow_handshake_is_not_unavailable(void **state) {
  (void)state;
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "/tmp/test_client_mute_%d.sock", (int)getpid());
  unlink(addr.sun_path);
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  assert_int_equal(bind(fd, (struct sockaddr *)&addr, sizeof addr), 0);
  assert_int_equal(listen(fd, 8), 0); /* the kernel completes connects; nobody speaks */

  char target[128];
  snprintf(target, sizeof target, "unix:%s", addr.sun_path);
  fsdp_client_t *client = NULL;
  assert_int_equal(fsdp_client_connect(target, NULL, &client), 0);
  fsdp_health_status_t hs;
  int64_t t0 = fsdp_clock_now_ms();
  int r = fsdp_client_health_check(client, "", 700, &hs);
  int64_t elapsed = fsdp_clock_now_ms() - t0;
  assert_int_equal(r, FSDP_E_DEADLINE_EXCEEDED);
  assert_true(elapsed >= 650 && elapsed < 3000);
  assert_non_null(strstr(fsdp_client_last_error(client), "700 ms"));
  fsdp_client_close(client);
  close(fd);
  unlink(addr.sun_path);
}

static void test_many_clients(void **state) {
  (void)state;
  /* grpc_init/grpc_shutdown are reference counted per client: overlapping lifetimes in any
   * order must work. */
  fsdp_client_t *a = NULL, *b = NULL;
  assert_int_equal(fsdp_client_connect("unix:/tmp/none-a.sock", NULL, &a), 0);
  assert_int_equal(fsdp_client_connect("127.0.0.1:1", NULL, &b), 0);
  fsdp_client_close(a);
  fsdp_health_status_t hs;
  assert_int_equal(fsdp_client_health_check(b, "", 1000, &hs), FSDP_E_UNAVAILABLE);
  fsdp_client_close(b);
  for (int i = 0; i < 3; i++) {
    assert_int_equal(fsdp_client_connect("unix:/tmp/none-c.sock", NULL, &a), 0);
    fsdp_client_close(a);
  }
}

/* Tests against the fake server. */

static void test_health_and_last_error(void **state) {
  fake_server_t *fs = *state;
  fsdp_client_t *client = NULL;
  assert_int_equal(fsdp_client_connect(fs->target, NULL, &client), 0);
  fsdp_health_status_t hs = FSDP_HEALTH_UNKNOWN;

  assert_int_equal(fsdp_client_health_check(client, "", 0, &hs), 0);
  assert_int_equal(hs, FSDP_HEALTH_SERVING);
  assert_string_equal(fsdp_client_last_error(client), "");

  assert_int_equal(fsdp_client_health_check(client, "down", 0, &hs), 0);
  assert_int_equal(hs, FSDP_HEALTH_NOT_SERVING);

  /* The daemon's NOT_FOUND comes back as FSDP_E_NOT_FOUND with its message, verbatim. */
  hs = FSDP_HEALTH_SERVING;
  assert_int_equal(fsdp_client_health_check(client, "fsdp.v1.Nope", 0, &hs), FSDP_E_NOT_FOUND);
  assert_string_equal(fsdp_client_last_error(client), "unknown service 'fsdp.v1.Nope'");
  assert_int_equal(hs, FSDP_HEALTH_SERVING);

  /* Without a message the client names the service itself. */
  assert_int_equal(fsdp_client_health_check(client, "silent", 0, &hs), FSDP_E_NOT_FOUND);
  assert_non_null(strstr(fsdp_client_last_error(client), "'silent'"));

  /* Success clears the last error. */
  assert_int_equal(fsdp_client_health_check(client, "", 0, &hs), 0);
  assert_string_equal(fsdp_client_last_error(client), "");

  /* A reply that does not decode is an internal error naming the type. */
  assert_int_equal(fsdp_client_health_check(client, "garbage", 0, &hs), FSDP_E_INTERNAL);
  assert_non_null(strstr(fsdp_client_last_error(client), "grpc.health.v1.HealthCheckResponse"));
  fsdp_client_close(client);
}

static void test_raw_calls(void **state) {
  fake_server_t *fs = *state;
  fsdp_client_t *client = NULL;
  assert_int_equal(fsdp_client_connect(fs->target, NULL, &client), 0);
  uint8_t *reply = NULL;
  size_t len = 0;

  static const uint8_t junk[] = {0xde, 0xad, 0xbe, 0xef, 0x00, 0x01};
  assert_int_equal(fsdp_client_call_raw(client, "/test/Echo", junk, sizeof junk, 0, &reply, &len),
                   0);
  assert_int_equal(len, sizeof junk);
  assert_memory_equal(reply, junk, sizeof junk);
  free(reply);

  /* An empty message is a message; no message at all is something else. */
  assert_int_equal(fsdp_client_call_raw(client, "/test/Echo", "", 0, 0, &reply, &len), 0);
  assert_int_equal(len, 0);
  free(reply);
  assert_int_equal(fsdp_client_call_raw(client, "/test/Echo", NULL, 0, 0, &reply, &len),
                   FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(fsdp_client_last_error(client), "no request message");

  /* Garbage to a typed method: the server's decoder refuses it. */
  assert_int_equal(
      fsdp_client_call_raw(client, HEALTH_CHECK, junk, sizeof junk, 0, &reply, &len),
      FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(fsdp_client_last_error(client), "HealthCheckRequest"));

  assert_int_equal(fsdp_client_call_raw(client, "/test/Nope", "", 0, 0, &reply, &len),
                   FSDP_E_UNIMPLEMENTED);
  fsdp_client_close(client);
}

static void test_deadline(void **state) {
  fake_server_t *fs = *state;
  fsdp_client_t *client = NULL;
  assert_int_equal(fsdp_client_connect(fs->target, NULL, &client), 0);
  uint8_t *reply = NULL;
  size_t len = 0;
  int64_t t0 = fsdp_clock_now_ms();
  assert_int_equal(fsdp_client_call_raw(client, "/test/Slow", "", 0, 200, &reply, &len),
                   FSDP_E_DEADLINE_EXCEEDED);
  int64_t elapsed = fsdp_clock_now_ms() - t0;
  assert_true(elapsed >= 190 && elapsed < 2000);
  assert_non_null(strstr(fsdp_client_last_error(client), "200 ms"));
  /* The client is still usable afterwards. */
  fsdp_health_status_t hs;
  assert_int_equal(fsdp_client_health_check(client, "", 0, &hs), 0);
  assert_int_equal(hs, FSDP_HEALTH_SERVING);
  fsdp_client_close(client);
}

static void test_typed_call(void **state) {
  fake_server_t *fs = *state;
  fsdp_client_options_t opts = FSDP_CLIENT_OPTIONS_INIT;
  opts.max_message_bytes = 1 << 20;
  fsdp_client_t *client = NULL;
  assert_int_equal(fsdp_client_connect(fs->target, &opts, &client), 0);
  Grpc__Health__V1__HealthCheckRequest request = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  request.service = "";
  ProtobufCMessage *reply = NULL;
  assert_int_equal(fsdp_client_call(client, HEALTH_CHECK, &request.base,
                                    &grpc__health__v1__health_check_response__descriptor, 0,
                                    &reply),
                   0);
  assert_int_equal(((Grpc__Health__V1__HealthCheckResponse *)reply)->status,
                   GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING);
  protobuf_c_message_free_unpacked(reply, NULL);

  /* A request over the client's send limit fails locally with RESOURCE_EXHAUSTED. */
  size_t big_len = 2u << 20;
  char *big = malloc(big_len);
  assert_non_null(big);
  memset(big, 'a', big_len - 1);
  big[big_len - 1] = '\0';
  request.service = big;
  reply = NULL;
  assert_int_equal(fsdp_client_call(client, HEALTH_CHECK, &request.base,
                                    &grpc__health__v1__health_check_response__descriptor, 0,
                                    &reply),
                   FSDP_E_RESOURCE_EXHAUSTED);
  assert_null(reply);
  assert_string_not_equal(fsdp_client_last_error(client), "");
  free(big);
  fsdp_client_close(client);
}

int main(void) {
  const struct CMUnitTest standalone[] = {
      cmocka_unit_test(test_bad_arguments),
      cmocka_unit_test(test_health_status_names),
      cmocka_unit_test(test_unreachable_fails_fast),
      cmocka_unit_test(test_unreachable_wait_for_ready_hits_deadline),
      cmocka_unit_test(test_slow_handshake_is_not_unavailable),
      cmocka_unit_test(test_many_clients),
  };
  const struct CMUnitTest with_server[] = {
      cmocka_unit_test(test_health_and_last_error),
      cmocka_unit_test(test_raw_calls),
      cmocka_unit_test(test_deadline),
      cmocka_unit_test(test_typed_call),
  };
  int failed = cmocka_run_group_tests_name("client", standalone, NULL, NULL);
  failed += cmocka_run_group_tests_name("client_with_server", with_server, server_setup,
                                        server_teardown);
  return failed;
}
