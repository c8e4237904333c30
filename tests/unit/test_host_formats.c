/* The byte formats between hosts (proto/host/formats.h): the exact bytes each one writes,
 * round trips, another version refused naming both, and the op id's hash against answers
 * computed apart from it, so that a change to any of them, which every host must make at
 * once, fails here first. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "proto/host/formats.h"

static void test_ucx_address_header_bytes(void **state) {
  (void)state;
  uint8_t a[FSDP_UCX_ADDRESS_HEADER_BYTES + 300];
  memset(a, 0xab, sizeof a);
  fsdp_ucx_address_pack_header(300, a);
  assert_memory_equal(a, "FSDPUCX\x01\x00\x00\x01\x2c", FSDP_UCX_ADDRESS_HEADER_BYTES);
  assert_int_equal(FSDP_HOST_WIRE_VERSION, 1);
  assert_int_equal(a[FSDP_UCX_ADDRESS_HEADER_BYTES], 0xab); /* UCX's part is the caller's */

  fsdp_status_t st;
  assert_int_equal(fsdp_ucx_address_check(a, sizeof a, "host 1", &st), 0);
}

static void test_ucx_address_of_another_version_is_refused(void **state) {
  (void)state;
  uint8_t a[FSDP_UCX_ADDRESS_HEADER_BYTES + 8] = {0};
  fsdp_ucx_address_pack_header(8, a);
  a[7] = FSDP_HOST_WIRE_VERSION + 1;
  fsdp_status_t st;
  assert_int_equal(fsdp_ucx_address_check(a, sizeof a, "host 2 (10.0.0.3:7100)", &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(st.message,
                      "UCX address of host 2 (10.0.0.3:7100): format version 2, expected 1");
}

static void test_ucx_address_framing_is_checked(void **state) {
  (void)state;
  uint8_t a[FSDP_UCX_ADDRESS_HEADER_BYTES + 8] = {0};
  fsdp_ucx_address_pack_header(8, a);
  fsdp_status_t st;
  /* The length the header gives must be what follows it, and not zero. */
  assert_int_equal(fsdp_ucx_address_check(a, sizeof a - 1, NULL, &st), FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(st.message, "UCX address of peer: says 8 bytes of UCX address, has 7");
  fsdp_ucx_address_pack_header(0, a);
  assert_int_equal(fsdp_ucx_address_check(a, FSDP_UCX_ADDRESS_HEADER_BYTES, "h", &st),
                   FSDP_E_INVALID_ARGUMENT);
  /* Bytes that are not ours, too short, or too long. */
  assert_int_equal(fsdp_ucx_address_check("garbage-bytes", 13, "h", &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(st.message,
                      "UCX address of h: 13 bytes that are not an fsdpd transport address");
  assert_int_equal(fsdp_ucx_address_check(a, 5, "h", &st), FSDP_E_INVALID_ARGUMENT);
  assert_int_equal(fsdp_ucx_address_check(NULL, 0, "h", &st), FSDP_E_INVALID_ARGUMENT);
  assert_int_equal(fsdp_ucx_address_check(a, FSDP_UCX_ADDRESS_MAX + 1, "h", &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "at most 65536"));
}

static void test_ring_tags(void **state) {
  (void)state;
  assert_true(fsdp_ring_tag_data(0x12345678u, 3, 0x00abcdefu) == 0x1234567803abcdefull);
  assert_true(fsdp_ring_tag_control(0x12345678u, 5, FSDP_RING_FRAME_TIMEOUT) ==
              0x12345678ff000502ull);
  /* A control receive of one op matches every sender and kind of that op, and neither its
   * data nor another op's control frames. */
  uint64_t want = fsdp_ring_tag_control(7, 0, 0) & FSDP_RING_TAG_CONTROL_MASK;
  assert_true((fsdp_ring_tag_control(7, 15, FSDP_RING_FRAME_ABORT) &
               FSDP_RING_TAG_CONTROL_MASK) == want);
  assert_true((fsdp_ring_tag_data(7, FSDP_RING_TAG_STEPS - 1,
                                  (uint32_t)FSDP_RING_TAG_CHUNKS - 1) &
               FSDP_RING_TAG_CONTROL_MASK) != want);
  assert_true((fsdp_ring_tag_control(8, 0, FSDP_RING_FRAME_ABORT) &
               FSDP_RING_TAG_CONTROL_MASK) != want);
}

static void test_ring_frame_bytes_and_round_trip(void **state) {
  (void)state;
  fsdp_ring_frame_t f = {.kind = FSDP_RING_FRAME_ABORT, .sender = 3, .culprit = 1,
                         .code = FSDP_E_DEADLINE_EXCEEDED};
  strcpy(f.text, "member 2 stopped");
  uint8_t b[FSDP_RING_FRAME_BYTES];
  memset(b, 0xee, sizeof b);
  fsdp_ring_frame_pack(&f, b);
  uint32_t neg = (uint32_t)-FSDP_E_DEADLINE_EXCEEDED;
  const uint8_t head[8] = {1, FSDP_RING_FRAME_ABORT, 3, 1, (uint8_t)(neg >> 24),
                           (uint8_t)(neg >> 16), (uint8_t)(neg >> 8), (uint8_t)neg};
  assert_memory_equal(b, head, sizeof head);
  assert_string_equal((const char *)b + 8, "member 2 stopped");
  for (size_t i = 8 + strlen(f.text); i < sizeof b; i++)
    assert_int_equal(b[i], 0);

  fsdp_ring_frame_t g;
  fsdp_status_t st;
  assert_int_equal(fsdp_ring_frame_unpack(b, sizeof b, &g, &st), 0);
  assert_int_equal(g.kind, f.kind);
  assert_int_equal(g.sender, f.sender);
  assert_int_equal(g.culprit, f.culprit);
  assert_int_equal(g.code, FSDP_E_DEADLINE_EXCEEDED);
  assert_string_equal(g.text, f.text);
}

static void test_ring_frame_text_is_cut_and_terminated(void **state) {
  (void)state;
  fsdp_ring_frame_t f = {.kind = FSDP_RING_FRAME_TIMEOUT, .culprit = FSDP_RING_FRAME_NOBODY,
                         .code = -5};
  memset(f.text, 'x', sizeof f.text); /* no terminator at all */
  uint8_t b[FSDP_RING_FRAME_BYTES];
  fsdp_ring_frame_pack(&f, b);
  assert_int_equal(b[FSDP_RING_FRAME_BYTES - 1], 0);
  assert_int_equal(b[FSDP_RING_FRAME_BYTES - 2], 'x');
  /* A sender that filled the text to the end still gives a terminated one. */
  memset(b + 8, 'y', FSDP_RING_FRAME_TEXT);
  fsdp_ring_frame_t g;
  fsdp_status_t st;
  assert_int_equal(fsdp_ring_frame_unpack(b, sizeof b, &g, &st), 0);
  assert_int_equal(strlen(g.text), FSDP_RING_FRAME_TEXT - 1);
  assert_int_equal(g.culprit, FSDP_RING_FRAME_NOBODY);
  assert_int_equal(g.code, -5);
  /* Any code a peer sends reads without overflow; the ring names what it does not know. */
  b[4] = 0x80;
  b[5] = b[6] = b[7] = 0;
  assert_int_equal(fsdp_ring_frame_unpack(b, sizeof b, &g, &st), 0);
  assert_true(g.code == INT32_MIN);
}

static void test_ring_frame_of_another_version_is_refused(void **state) {
  (void)state;
  fsdp_ring_frame_t f = {.kind = FSDP_RING_FRAME_ABORT, .code = -1};
  uint8_t b[FSDP_RING_FRAME_BYTES];
  fsdp_ring_frame_pack(&f, b);
  b[0] = 9;
  fsdp_ring_frame_t g = {.kind = 77};
  fsdp_status_t st;
  assert_int_equal(fsdp_ring_frame_unpack(b, sizeof b, &g, &st), FSDP_E_PROTOCOL_VERSION);
  assert_string_equal(st.message, "ring control message version 9, expected version 1");
  assert_int_equal(g.kind, 77); /* untouched on failure */
  b[0] = FSDP_HOST_WIRE_VERSION;
  assert_int_equal(fsdp_ring_frame_unpack(b, sizeof b - 1, &g, &st), FSDP_E_INVALID_ARGUMENT);
  assert_int_equal(g.kind, 77);
}

/* The answers come from a separate FNV-1a written in Python over the bytes the header
 * describes (whose FNV-1a of "a" is the published 0xe40c292c). A different answer means
 * every host must change at once: bump FSDP_HOST_WIRE_VERSION with it. */
static void test_op_id_known_answers(void **state) {
  (void)state;
  assert_int_equal(fsdp_op_id("job", "layer3", 7, 2, 1), 0xe192eb15u);
  assert_int_equal(fsdp_op_id("", "", 0, 0, 0), 0x06517b7au);
  assert_int_equal(fsdp_op_id("train-llama", "blocks.0", 123456789012ull, 3, 2), 0xc044ee82u);
  /* Each input counts. */
  uint32_t base = fsdp_op_id("job", "layer3", 7, 2, 1);
  assert_int_not_equal(fsdp_op_id("job", "layer3", 8, 2, 1), base);
  assert_int_not_equal(fsdp_op_id("job", "layer3", 7, 3, 1), base);
  assert_int_not_equal(fsdp_op_id("job", "layer3", 7, 2, 2), base);
  assert_int_not_equal(fsdp_op_id("jo", "blayer3", 7, 2, 1), base);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ucx_address_header_bytes),
      cmocka_unit_test(test_ucx_address_of_another_version_is_refused),
      cmocka_unit_test(test_ucx_address_framing_is_checked),
      cmocka_unit_test(test_ring_tags),
      cmocka_unit_test(test_ring_frame_bytes_and_round_trip),
      cmocka_unit_test(test_ring_frame_text_is_cut_and_terminated),
      cmocka_unit_test(test_ring_frame_of_another_version_is_refused),
      cmocka_unit_test(test_op_id_known_answers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
