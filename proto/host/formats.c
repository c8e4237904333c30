/* The byte formats between the daemons' data planes; see formats.h. */
#include "proto/host/formats.h"

#include <stdio.h>
#include <string.h>

#define ADDRESS_MAGIC "FSDPUCX"
#define ADDRESS_MAGIC_LEN 7
#define RING_STEP_CONTROL 0xffu

static void put_be32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)(v >> 24);
  p[1] = (uint8_t)(v >> 16);
  p[2] = (uint8_t)(v >> 8);
  p[3] = (uint8_t)v;
}

static uint32_t get_be32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

void fsdp_ucx_address_pack_header(size_t ucx_len, uint8_t *header) {
  memcpy(header, ADDRESS_MAGIC, ADDRESS_MAGIC_LEN);
  header[ADDRESS_MAGIC_LEN] = FSDP_HOST_WIRE_VERSION;
  put_be32(header + ADDRESS_MAGIC_LEN + 1, (uint32_t)ucx_len);
}

int fsdp_ucx_address_check(const void *address, size_t len, const char *label,
                           fsdp_status_t *st) {
  const uint8_t *a = address;
  if (!label)
    label = "peer";
  if (len > FSDP_UCX_ADDRESS_MAX)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "UCX address of %s: %zu bytes, at most %d", label, len,
                           FSDP_UCX_ADDRESS_MAX);
  if (!a || len < FSDP_UCX_ADDRESS_HEADER_BYTES ||
      memcmp(a, ADDRESS_MAGIC, ADDRESS_MAGIC_LEN) != 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "UCX address of %s: %zu bytes that are not an fsdpd transport address",
                           label, len);
  if (a[ADDRESS_MAGIC_LEN] != FSDP_HOST_WIRE_VERSION)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "UCX address of %s: format version %u, expected %u", label,
                           a[ADDRESS_MAGIC_LEN], FSDP_HOST_WIRE_VERSION);
  size_t ucx_len = get_be32(a + ADDRESS_MAGIC_LEN + 1);
  if (ucx_len == 0 || ucx_len != len - FSDP_UCX_ADDRESS_HEADER_BYTES)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "UCX address of %s: says %zu bytes of UCX address, has %zu", label,
                           ucx_len, len - FSDP_UCX_ADDRESS_HEADER_BYTES);
  return 0;
}

uint64_t fsdp_ring_tag_data(uint32_t op_id, unsigned step, uint32_t chunk) {
  return (uint64_t)op_id << 32 | (uint64_t)step << 24 | chunk;
}

uint64_t fsdp_ring_tag_control(uint32_t op_id, unsigned sender, unsigned kind) {
  return (uint64_t)op_id << 32 | (uint64_t)RING_STEP_CONTROL << 24 | (uint64_t)sender << 8 |
         kind;
}

void fsdp_ring_frame_pack(const fsdp_ring_frame_t *frame, uint8_t *bytes) {
  memset(bytes, 0, FSDP_RING_FRAME_BYTES);
  bytes[0] = FSDP_HOST_WIRE_VERSION;
  bytes[1] = frame->kind;
  bytes[2] = frame->sender;
  bytes[3] = frame->culprit;
  put_be32(bytes + 4, 0u - (uint32_t)frame->code);
  size_t n = strnlen(frame->text, FSDP_RING_FRAME_TEXT - 1);
  memcpy(bytes + 8, frame->text, n);
}

int fsdp_ring_frame_unpack(const uint8_t *bytes, size_t len, fsdp_ring_frame_t *ret_frame,
                           fsdp_status_t *st) {
  if (len != FSDP_RING_FRAME_BYTES)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "ring control message of %zu bytes, expected %d", len,
                           FSDP_RING_FRAME_BYTES);
  if (bytes[0] != FSDP_HOST_WIRE_VERSION)
    return fsdp_status_set(st, FSDP_E_PROTOCOL_VERSION,
                           "ring control message version %u, expected version %u", bytes[0],
                           FSDP_HOST_WIRE_VERSION);
  ret_frame->kind = bytes[1];
  ret_frame->sender = bytes[2];
  ret_frame->culprit = bytes[3];
  ret_frame->code = (int32_t)(0u - get_be32(bytes + 4));
  memcpy(ret_frame->text, bytes + 8, FSDP_RING_FRAME_TEXT);
  ret_frame->text[FSDP_RING_FRAME_TEXT - 1] = '\0';
  return 0;
}

/* FNV-1a, 32 bits. */
#define FNV_OFFSET 2166136261u
#define FNV_PRIME 16777619u

static uint32_t fnv_bytes(uint32_t h, const char *s) {
  for (; *s; s++)
    h = (h ^ (uint8_t)*s) * FNV_PRIME;
  return h;
}

static uint32_t fnv_le64(uint32_t h, uint64_t v) {
  for (unsigned i = 0; i < 8; i++)
    h = (h ^ (uint8_t)(v >> (8 * i))) * FNV_PRIME;
  return h;
}

uint32_t fsdp_op_id(const char *job, const char *unit, uint64_t step, uint64_t generation,
                    uint32_t ring_kind) {
  uint32_t h = fnv_bytes(fnv_bytes(fnv_bytes(FNV_OFFSET, job), "/"), unit);
  h = fnv_le64(fnv_le64(h, step), generation);
  return (h ^ ring_kind) * FNV_PRIME;
}
