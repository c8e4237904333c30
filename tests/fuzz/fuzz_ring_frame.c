/* Fuzz harness for the ring's control frame (proto/host/formats.h), which a member reads from
 * whichever host sent it: any bytes either read as a frame with a terminated text, which
 * packs back to bytes that read the same, or are refused saying why. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/host/formats.h"

static int same(const fsdp_ring_frame_t *a, const fsdp_ring_frame_t *b) {
  return a->kind == b->kind && a->sender == b->sender && a->culprit == b->culprit &&
         a->code == b->code && strcmp(a->text, b->text) == 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fsdp_ring_frame_t f, g;
  fsdp_status_t st = FSDP_STATUS_INIT;
  if (fsdp_ring_frame_unpack(data, size, &f, &st) < 0) {
    if (st.message[0] == '\0')
      abort();
    return 0;
  }
  if (memchr(f.text, '\0', sizeof f.text) == NULL)
    abort();
  uint8_t bytes[FSDP_RING_FRAME_BYTES];
  fsdp_ring_frame_pack(&f, bytes);
  if (fsdp_ring_frame_unpack(bytes, sizeof bytes, &g, &st) < 0 || !same(&f, &g))
    abort();
  return 0;
}
