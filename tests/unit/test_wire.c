/* The wire codec and the status table: round trips, malformed and invalid messages, and
 * the mapping between fsdp error codes and gRPC status codes. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "fsdp/v1/operator.pb-c.h"
#include "fsdp/v1/peer.pb-c.h"
#include "fsdp/v1/trainer.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

#include "proto/wire.h"

static const int domain_codes[] = {
#define FSDP_ERROR_VALUE(name, value, text) name,
    FSDP_ERROR_LIST(FSDP_ERROR_VALUE)
#undef FSDP_ERROR_VALUE
};
#define N_DOMAIN_CODES (sizeof domain_codes / sizeof domain_codes[0])

static void test_every_domain_code_has_a_status_and_text(void **state) {
  (void)state;
  for (size_t i = 0; i < N_DOMAIN_CODES; i++) {
    int err = domain_codes[i];
    assert_int_not_equal(fsdp_wire_status_from_error(err), GRPC_STATUS_OK);
    assert_non_null(fsdp_error_name(err));
    assert_string_not_equal(fsdp_strerror(err), "unknown error code");
    /* A code that crosses the wire comes back as a code with the same status. */
    int back = fsdp_wire_error_from_status(fsdp_wire_status_from_error(err));
    assert_int_equal(fsdp_wire_status_from_error(back), fsdp_wire_status_from_error(err));
  }
}

/* A caller that adds context to a message it holds formats the status into itself. */
static void test_a_status_message_can_prefix_itself(void **state) {
  (void)state;
  fsdp_status_t st;
  fsdp_status_set(&st, FSDP_E_RESOURCE_EXHAUSTED, "arena '%s' is full", "job-a");
  fsdp_status_set(&st, st.code, "unit '%s': %s", "layer.0", st.message);
  assert_int_equal(st.code, FSDP_E_RESOURCE_EXHAUSTED);
  assert_string_equal(st.message, "unit 'layer.0': arena 'job-a' is full");
}

static void test_every_grpc_status_round_trips(void **state) {
  (void)state;
  for (int code = GRPC_STATUS_CANCELLED; code <= GRPC_STATUS_UNAUTHENTICATED; code++) {
    int err = fsdp_wire_error_from_status((grpc_status_code)code);
    assert_true(err < 0);
    assert_int_equal(fsdp_wire_status_from_error(err), code);
  }
  assert_int_equal(fsdp_wire_error_from_status(GRPC_STATUS_OK), 0);
  assert_int_equal(fsdp_wire_status_from_error(0), GRPC_STATUS_OK);
}

static void test_specific_mappings(void **state) {
  (void)state;
  assert_int_equal(fsdp_wire_status_from_error(FSDP_E_PROTOCOL_VERSION),
                   GRPC_STATUS_FAILED_PRECONDITION);
  assert_int_equal(fsdp_wire_status_from_error(FSDP_E_CONFIG), GRPC_STATUS_INVALID_ARGUMENT);
  assert_int_equal(fsdp_wire_status_from_error(-ENOMEM), GRPC_STATUS_RESOURCE_EXHAUSTED);
  assert_int_equal(fsdp_wire_status_from_error(-ETIMEDOUT), GRPC_STATUS_DEADLINE_EXCEEDED);
  assert_int_equal(fsdp_wire_status_from_error(-EACCES), GRPC_STATUS_PERMISSION_DENIED);
  /* An errno nobody mapped is an internal error, never OK. */
  assert_int_equal(fsdp_wire_status_from_error(-EXDEV), GRPC_STATUS_INTERNAL);
  assert_int_equal(fsdp_wire_error_from_status(GRPC_STATUS_FAILED_PRECONDITION),
                   FSDP_E_FAILED_PRECONDITION);
  assert_int_equal(fsdp_wire_error_from_status((grpc_status_code)99), FSDP_E_UNKNOWN);
  assert_string_equal(fsdp_strerror(-ENOENT), "No such file or directory");
  assert_null(fsdp_error_name(-ENOENT));
}

/* The names libfsdp gives bindings (Python's fsdpd.Error.status): a domain code named after
 * a gRPC status travels as that status, the other two as the table says, an errno by the
 * table or as INTERNAL. */
static void test_error_status_names(void **state) {
  (void)state;
  static const char prefix[] = "FSDP_E_";
  for (size_t i = 0; i < N_DOMAIN_CODES; i++) {
    int err = domain_codes[i];
    if (err == FSDP_E_PROTOCOL_VERSION || err == FSDP_E_CONFIG)
      continue;
    assert_string_equal(fsdp_error_status_name(err), fsdp_error_name(err) + sizeof prefix - 1);
  }
  assert_string_equal(fsdp_error_status_name(FSDP_E_PROTOCOL_VERSION), "FAILED_PRECONDITION");
  assert_string_equal(fsdp_error_status_name(FSDP_E_CONFIG), "INVALID_ARGUMENT");
  assert_string_equal(fsdp_error_status_name(-ENOENT), "NOT_FOUND");
  assert_string_equal(fsdp_error_status_name(-EAGAIN), "UNAVAILABLE");
  assert_string_equal(fsdp_error_status_name(-EXDEV), "INTERNAL");
  assert_string_equal(fsdp_error_status_name(0), "OK");
  assert_string_equal(fsdp_wire_status_name(GRPC_STATUS_UNAUTHENTICATED), "UNAUTHENTICATED");
  assert_string_equal(fsdp_wire_status_name((grpc_status_code)99), "UNKNOWN");
}

static void test_method_paths_and_streaming(void **state) {
  (void)state;
  char path[FSDP_WIRE_PATH_MAX];
  const ProtobufCServiceDescriptor *health = &grpc__health__v1__health__descriptor;
  const ProtobufCMethodDescriptor *watch =
      protobuf_c_service_descriptor_get_method_by_name(health, "Watch");
  const ProtobufCMethodDescriptor *check =
      protobuf_c_service_descriptor_get_method_by_name(health, "Check");
  unsigned watch_index = (unsigned)(watch - health->methods);
  unsigned check_index = (unsigned)(check - health->methods);
  assert_int_equal(fsdp_wire_method_path(health, watch_index, path, sizeof path), 0);
  assert_string_equal(path, "/grpc.health.v1.Health/Watch");
  assert_true(fsdp_wire_method_is_server_streaming(health, watch_index));
  assert_false(fsdp_wire_method_is_server_streaming(health, check_index));
  assert_int_equal(fsdp_wire_method_path(health, 99, path, sizeof path), -EINVAL);
  assert_int_equal(fsdp_wire_method_path(health, 0, path, 8), -ENAMETOOLONG);
}

static void test_round_trip_with_nested_messages(void **state) {
  (void)state;
  Fsdp__V1__StatusReply reply = FSDP__V1__STATUS_REPLY__INIT;
  Fsdp__V1__ConfigEntry entries[2] = {FSDP__V1__CONFIG_ENTRY__INIT, FSDP__V1__CONFIG_ENTRY__INIT};
  Fsdp__V1__ConfigEntry *ptrs[2] = {&entries[0], &entries[1]};
  entries[0].key = "daemon.run_dir";
  entries[0].value = "./run";
  entries[0].source = FSDP__V1__CONFIG_SOURCE__CONFIG_SOURCE_FLAG;
  entries[1].key = "health.listen";
  entries[1].value = "127.0.0.1:7071";
  reply.version = "0.1.0";
  reply.uptime_ms = 1234567;
  reply.n_config = 2;
  reply.config = ptrs;

  grpc_byte_buffer *buffer;
  assert_int_equal(fsdp_wire_encode(&reply.base, &buffer), 0);
  ProtobufCMessage *msg;
  fsdp_status_t st;
  assert_int_equal(fsdp_wire_decode(&fsdp__v1__status_reply__descriptor, buffer, &msg, &st), 0);
  grpc_byte_buffer_destroy(buffer);
  Fsdp__V1__StatusReply *got = (Fsdp__V1__StatusReply *)msg;
  assert_string_equal(got->version, "0.1.0");
  assert_int_equal(got->uptime_ms, 1234567);
  assert_int_equal(got->n_config, 2);
  assert_string_equal(got->config[1]->value, "127.0.0.1:7071");
  assert_int_equal(got->config[0]->source, FSDP__V1__CONFIG_SOURCE__CONFIG_SOURCE_FLAG);
  protobuf_c_message_free_unpacked(msg, NULL);
}

static void test_missing_payload_is_an_empty_message(void **state) {
  (void)state;
  ProtobufCMessage *msg;
  fsdp_status_t st;
  assert_int_equal(fsdp_wire_decode(&fsdp__v1__status_request__descriptor, NULL, &msg, &st), 0);
  protobuf_c_message_free_unpacked(msg, NULL);
}

static void test_truncated_message_is_rejected(void **state) {
  (void)state;
  /* Field 2 (job), length 10, but only 3 bytes follow. */
  const uint8_t bytes[] = {0x12, 0x0a, 'a', 'b', 'c'};
  ProtobufCMessage *msg = NULL;
  fsdp_status_t st;
  assert_int_equal(fsdp_wire_decode_bytes(&fsdp__v1__attach_request__descriptor, bytes,
                                          sizeof bytes, &msg, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_null(msg);
  assert_non_null(strstr(st.message, "malformed fsdp.v1.AttachRequest"));
  assert_non_null(strstr(st.message, "5 bytes"));
}

static void test_enum_outside_its_type_is_rejected(void **state) {
  (void)state;
  Fsdp__V1__RegisterUnitRequest rq = FSDP__V1__REGISTER_UNIT_REQUEST__INIT;
  Fsdp__V1__ParamSpec params[2] = {FSDP__V1__PARAM_SPEC__INIT, FSDP__V1__PARAM_SPEC__INIT};
  Fsdp__V1__ParamSpec *ptrs[2] = {&params[0], &params[1]};
  params[0].name = "w";
  params[0].dtype = FSDP__V1__DTYPE__DTYPE_FP32;
  params[1].name = "b";
  params[1].dtype = (Fsdp__V1__DType)42;
  rq.unit = "layer0";
  rq.n_params = 2;
  rq.params = ptrs;
  rq.strategy = FSDP__V1__SHARDING_STRATEGY__FULL_SHARD;

  uint8_t bytes[256];
  size_t len = protobuf_c_message_pack(&rq.base, bytes);
  ProtobufCMessage *msg = NULL;
  fsdp_status_t st;
  assert_int_equal(fsdp_wire_decode_bytes(&fsdp__v1__register_unit_request__descriptor, bytes,
                                          len, &msg, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(st.message, "field 'params[1].dtype' = 42 is not a value of fsdp.v1.DType");

  params[1].dtype = FSDP__V1__DTYPE__DTYPE_BF16;
  rq.strategy = (Fsdp__V1__ShardingStrategy)-3;
  len = protobuf_c_message_pack(&rq.base, bytes);
  assert_int_equal(fsdp_wire_decode_bytes(&fsdp__v1__register_unit_request__descriptor, bytes,
                                          len, &msg, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(st.message,
                      "field 'strategy' = -3 is not a value of fsdp.v1.ShardingStrategy");
}

static void test_invalid_utf8_is_rejected(void **state) {
  (void)state;
  static const char *const bad[] = {
      "\xff",             /* never valid */
      "a\xc3",            /* truncated sequence */
      "\xc0\xaf",         /* overlong '/' */
      "\xed\xa0\x80",     /* surrogate U+D800 */
      "\xf4\x90\x80\x80", /* above U+10FFFF */
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    Fsdp__V1__AttachRequest rq = FSDP__V1__ATTACH_REQUEST__INIT;
    rq.job = (char *)bad[i];
    uint8_t bytes[64];
    size_t len = protobuf_c_message_pack(&rq.base, bytes);
    ProtobufCMessage *msg = NULL;
    fsdp_status_t st;
    assert_int_equal(fsdp_wire_decode_bytes(&fsdp__v1__attach_request__descriptor, bytes, len,
                                            &msg, &st),
                     FSDP_E_INVALID_ARGUMENT);
    assert_string_equal(st.message, "field 'job' is not valid UTF-8");
  }
  Fsdp__V1__AttachRequest good = FSDP__V1__ATTACH_REQUEST__INIT;
  good.job = "j\xc3\xa9" "b-\xe2\x82\xac" "-\xf0\x9f\x9a\x80"; /* é, €, a rocket */
  uint8_t bytes[64];
  size_t len = protobuf_c_message_pack(&good.base, bytes);
  ProtobufCMessage *msg;
  fsdp_status_t st;
  assert_int_equal(
      fsdp_wire_decode_bytes(&fsdp__v1__attach_request__descriptor, bytes, len, &msg, &st), 0);
  protobuf_c_message_free_unpacked(msg, NULL);
}

static void test_nul_inside_a_string_is_rejected(void **state) {
  (void)state;
  ProtobufCMessage *msg = NULL;
  fsdp_status_t st;
  /* HealthCheckRequest{service: "\0fsdp.v1.Nope"}: read as a C string it would be "". */
  const uint8_t check[] = {0x0a, 0x0d, 0x00, 'f', 's', 'd', 'p', '.', 'v', '1', '.', 'N', 'o', 'p', 'e'};
  assert_int_equal(fsdp_wire_decode_bytes(&grpc__health__v1__health_check_request__descriptor,
                                          check, sizeof check, &msg, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(st.message, "field 'service' holds a NUL byte at offset 0");

  /* Nested and repeated: RegisterUnitRequest{unit: "u", params: [{name: "w"}, {name: "b\0x"}]} */
  const uint8_t nested[] = {0x12, 0x01, 'u', 0x1a, 0x03, 0x0a, 0x01, 'w',
                            0x1a, 0x05, 0x0a, 0x03, 'b', 0x00, 'x'};
  assert_int_equal(fsdp_wire_decode_bytes(&fsdp__v1__register_unit_request__descriptor, nested,
                                          sizeof nested, &msg, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(st.message, "field 'params[1].name' holds a NUL byte at offset 1");

  /* A NUL in a bytes field is just data. */
  const uint8_t join[] = {0x08, 0x01, 0x22, 0x03, 'a', 0x00, 'b'};
  assert_int_equal(fsdp_wire_decode_bytes(&fsdp__v1__join_request__descriptor, join, sizeof join,
                                          &msg, &st),
                   0);
  protobuf_c_message_free_unpacked(msg, NULL);
}

static void test_field_number_zero_is_rejected(void **state) {
  (void)state;
  /* session_id = 8, then field 0 (tag spelled in two bytes, 80 00) with value 0. */
  const uint8_t bytes[] = {0x08, 0x08, 0x80, 0x00, 0x00};
  ProtobufCMessage *msg = NULL;
  fsdp_status_t st;
  assert_int_equal(fsdp_wire_decode_bytes(&fsdp__v1__detach_request__descriptor, bytes,
                                          sizeof bytes, &msg, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(st.message, "fsdp.v1.DetachRequest: field number 0 is not valid");
}

/* RegisterUnitRequest with n empty entries of params (field 3). */
static uint8_t *empty_params(size_t n, size_t *ret_len) {
  uint8_t *data = malloc(2 * n);
  assert_non_null(data);
  for (size_t i = 0; i < n; i++) {
    data[2 * i] = 3 << 3 | 2;
    data[2 * i + 1] = 0;
  }
  *ret_len = 2 * n;
  return data;
}

static void test_fields_are_counted_before_unpacking(void **state) {
  (void)state;
  size_t len;
  ProtobufCMessage *msg;
  fsdp_status_t st;
  const ProtobufCMessageDescriptor *reg = &fsdp__v1__register_unit_request__descriptor;
  assert_int_equal(fsdp_wire_request_max_fields(reg), 65536 + 5 * 65536);
  uint8_t *data = empty_params(FSDP_WIRE_REGISTER_UNIT_MAX_FIELDS, &len);
  assert_int_equal(fsdp_wire_decode_request_bytes(reg, data, len, &msg, &st), 0);
  assert_int_equal(((Fsdp__V1__RegisterUnitRequest *)msg)->n_params,
                   FSDP_WIRE_REGISTER_UNIT_MAX_FIELDS);
  protobuf_c_message_free_unpacked(msg, NULL);
  free(data);

  /* Millions of entries in 16 MiB: refused at the first field over, whatever follows. */
  data = empty_params(8u << 20, &len);
  assert_int_equal(fsdp_wire_decode_request_bytes(reg, data, len, &msg, &st),
                   FSDP_E_RESOURCE_EXHAUSTED);
  assert_string_equal(st.message, "field 'params[393216]': fsdp.v1.RegisterUnitRequest holds "
                                  "more than 393216 fields (each element of a list counts, at "
                                  "every level), the most one may");
  /* Replies are not counted: the daemon's own may be long lists. */
  assert_int_equal(fsdp_wire_decode_bytes(reg, data, 2 * (FSDP_WIRE_REGISTER_UNIT_MAX_FIELDS + 1),
                                          &msg, &st),
                   0);
  protobuf_c_message_free_unpacked(msg, NULL);

  /* Fields the message does not know (15, a varint) count too: protobuf-c keeps each. */
  for (size_t i = 0; i < len / 2; i++) {
    data[2 * i] = 15 << 3;
    data[2 * i + 1] = 0;
  }
  assert_int_equal(fsdp_wire_decode_request_bytes(reg, data, len, &msg, &st),
                   FSDP_E_RESOURCE_EXHAUSTED);
  assert_string_equal(st.message, "field '#15': fsdp.v1.RegisterUnitRequest holds more than "
                                  "393216 fields (each element of a list counts, at every "
                                  "level), the most one may");

  /* Another request keeps the smaller budget: SetSchedule's forward_order (field 2). */
  for (size_t i = 0; i < len / 2; i++) {
    data[2 * i] = 2 << 3 | 2;
    data[2 * i + 1] = 0;
  }
  assert_int_equal(fsdp_wire_decode_request_bytes(&fsdp__v1__set_schedule_request__descriptor,
                                                  data, len, &msg, &st),
                   FSDP_E_RESOURCE_EXHAUSTED);
  assert_string_equal(st.message, "field 'forward_order[65536]': fsdp.v1.SetScheduleRequest "
                                  "holds more than 65536 fields (each element of a list counts, "
                                  "at every level), the most one may");
  free(data);

  /* And so do the fields of every element. The API's most parameters, each of every field
   * (the entry, its name, its packed shape, its dtype and requires_grad), fit; the budget
   * held only about 13,100 of them before. */
  const uint8_t param[] = {3 << 3 | 2, 10, 1 << 3 | 2, 1, 'w', 2 << 3 | 2, 1, 4,
                           3 << 3, 1, 4 << 3, 1};
  size_t n = FSDP_UNIT_MAX_PARAMS + 1;
  data = malloc(n * sizeof param);
  assert_non_null(data);
  for (size_t i = 0; i < n; i++)
    memcpy(data + i * sizeof param, param, sizeof param);
  for (size_t k = 0; k < 2; k++) { /* the limit, and one past it (which RegisterUnit names) */
    assert_int_equal(fsdp_wire_decode_request_bytes(reg, data, (n - 1 + k) * sizeof param,
                                                    &msg, &st),
                     0);
    assert_int_equal(((Fsdp__V1__RegisterUnitRequest *)msg)->n_params, n - 1 + k);
    protobuf_c_message_free_unpacked(msg, NULL);
  }
  free(data);
}

static void test_request_size_limits_by_method(void **state) {
  (void)state;
  const ProtobufCServiceDescriptor *health = &grpc__health__v1__health__descriptor;
  const ProtobufCServiceDescriptor *trainer = &fsdp__v1__trainer__descriptor;
  unsigned check = (unsigned)(protobuf_c_service_descriptor_get_method_by_name(health, "Check") -
                              health->methods);
  unsigned reg = (unsigned)(protobuf_c_service_descriptor_get_method_by_name(trainer,
                                                                             "RegisterUnit") -
                            trainer->methods);
  unsigned unshard = (unsigned)(protobuf_c_service_descriptor_get_method_by_name(trainer,
                                                                                 "Unshard") -
                                trainer->methods);
  assert_int_equal(fsdp_wire_method_max_request(health, check, 16 << 20),
                   FSDP_WIRE_HEALTH_REQUEST_MAX);
  assert_int_equal(fsdp_wire_method_max_request(trainer, reg, 16 << 20), 16 << 20);
  assert_int_equal(fsdp_wire_method_max_request(trainer, unshard, 16 << 20),
                   FSDP_WIRE_SMALL_REQUEST_MAX);
  /* Never more than the configured maximum. */
  assert_int_equal(fsdp_wire_method_max_request(trainer, unshard, 4096), 4096);
}

static void test_peer_state_names(void **state) {
  (void)state;
  assert_string_equal(fsdp_wire_peer_state_name(FSDP__V1__PEER_STATE__PEER_STATE_JOINED),
                      "JOINED");
  assert_string_equal(fsdp_wire_peer_state_name(FSDP__V1__PEER_STATE__PEER_STATE_SELF), "SELF");
  assert_string_equal(fsdp_wire_peer_state_name(999), "UNSPECIFIED");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_domain_code_has_a_status_and_text),
      cmocka_unit_test(test_a_status_message_can_prefix_itself),
      cmocka_unit_test(test_every_grpc_status_round_trips),
      cmocka_unit_test(test_specific_mappings),
      cmocka_unit_test(test_error_status_names),
      cmocka_unit_test(test_method_paths_and_streaming),
      cmocka_unit_test(test_round_trip_with_nested_messages),
      cmocka_unit_test(test_missing_payload_is_an_empty_message),
      cmocka_unit_test(test_truncated_message_is_rejected),
      cmocka_unit_test(test_enum_outside_its_type_is_rejected),
      cmocka_unit_test(test_invalid_utf8_is_rejected),
      cmocka_unit_test(test_field_number_zero_is_rejected),
      cmocka_unit_test(test_nul_inside_a_string_is_rejected),
      cmocka_unit_test(test_fields_are_counted_before_unpacking),
      cmocka_unit_test(test_request_size_limits_by_method),
      cmocka_unit_test(test_peer_state_names),
  };
  return cmocka_run_group_tests_name("wire", tests, NULL, NULL);
}
