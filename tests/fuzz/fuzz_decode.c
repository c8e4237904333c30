/* Fuzz harness for request decoding: the first byte picks the request type of one of the
 * daemon's methods, the rest is decoded and validated exactly as the RPC adapter does. A
 * message that decodes must survive a re-encode and decode unchanged in size, and its
 * validation must be deterministic. A first byte of 0xff takes the memory channel's path
 * instead: the rest is a frame (cut or zero-padded to its fixed size) holding a hello. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/v1/channel.pb-c.h"
#include "fsdp/v1/operator.pb-c.h"
#include "fsdp/v1/peer.pb-c.h"
#include "fsdp/v1/trainer.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

#include "proto/wire.h"

static const ProtobufCServiceDescriptor *const services[] = {
    &fsdp__v1__trainer__descriptor,
    &fsdp__v1__operator__descriptor,
    &fsdp__v1__peer__descriptor,
    &grpc__health__v1__health__descriptor,
};

static const ProtobufCMessageDescriptor *pick(uint8_t selector) {
  unsigned n = 0;
  for (size_t s = 0; s < sizeof services / sizeof services[0]; s++)
    n += services[s]->n_methods;
  unsigned k = selector % n;
  for (size_t s = 0;; s++) {
    if (k < services[s]->n_methods)
      return services[s]->methods[k].input;
    k -= services[s]->n_methods;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void decode_frame(const uint8_t *data, size_t size) {
  static uint8_t frame[FSDP_CHANNEL_FRAME_BYTES];
  memset(frame, 0, sizeof frame);
  memcpy(frame, data, size < sizeof frame ? size : sizeof frame);
  ProtobufCMessage *msg;
  fsdp_status_t st;
  if (fsdp_wire_frame_decode(&fsdp__v1__channel_hello__descriptor, frame, sizeof frame, &msg,
                             &st) < 0) {
    if (st.message[0] == '\0')
      abort();
    return;
  }
  uint8_t again[FSDP_CHANNEL_FRAME_BYTES];
  if (fsdp_wire_frame_encode(msg, again) < 0)
    abort(); /* a hello that fitted in a frame fits again */
  protobuf_c_message_free_unpacked(msg, NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0)
    return 0;
  if (data[0] == 0xff) {
    decode_frame(data + 1, size - 1);
    return 0;
  }
  const ProtobufCMessageDescriptor *desc = pick(data[0]);
  ProtobufCMessage *msg;
  fsdp_status_t st;
  if (fsdp_wire_decode_request_bytes(desc, data + 1, size - 1, &msg, &st) < 0) {
    if (st.message[0] == '\0')
      abort(); /* every refusal must say why */
    return 0;
  }
  size_t len = protobuf_c_message_get_packed_size(msg);
  uint8_t *packed = malloc(len ? len : 1);
  if (!packed)
    abort();
  protobuf_c_message_pack(msg, packed);
  ProtobufCMessage *again;
  if (fsdp_wire_decode_bytes(desc, packed, len, &again, &st) < 0)
    abort(); /* what we accepted and re-encoded must decode again */
  if (protobuf_c_message_get_packed_size(again) != len)
    abort();
  protobuf_c_message_free_unpacked(again, NULL);
  protobuf_c_message_free_unpacked(msg, NULL);
  free(packed);
  return 0;
}
