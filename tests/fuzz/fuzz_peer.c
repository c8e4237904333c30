/* Fuzz harness for what a peer daemon sends: the first byte picks the message (a Join, a
 * Heartbeat, a Leave, a Recover as the Peer service receives them; the replies to this
 * daemon's Join and Heartbeat; or raw data-plane address bytes), the rest is decoded as the RPC layer does
 * and checked by the very functions the daemon runs on it (daemon/cluster/peer_check.h,
 * fsdp_ucx_address_check), against the rules of host 0 of a 3-host cluster. A refusal must
 * say why; a check must give the same answer twice; a Join or Join reply that passes must
 * carry an address whose framing passes on its own. What follows the framing is UCX's, and
 * reaches UCX only in a process of its own (daemon/cluster/address_check.h). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/v1/peer.pb-c.h"
#include "daemon/cluster/peer_check.h"
#include "proto/wire.h"
#include "proto/host/formats.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static Fsdp__V1__Setting settings[] = {
    {PROTOBUF_C_MESSAGE_INIT(&fsdp__v1__setting__descriptor), "cluster.hosts",
     "127.0.0.1:7100,127.0.0.1:7101,127.0.0.1:7102"},
    {PROTOBUF_C_MESSAGE_INIT(&fsdp__v1__setting__descriptor), "cluster.local_world_size", "2"},
    {PROTOBUF_C_MESSAGE_INIT(&fsdp__v1__setting__descriptor), "cluster.shard_group_hosts", "1"},
    {PROTOBUF_C_MESSAGE_INIT(&fsdp__v1__setting__descriptor), "daemon.backend", "host"},
};

static const fsdp_peer_rules_t rules = {
    .n_hosts = 3, .self = 0, .settings = settings, .n_settings = 4};

enum { JOIN, HEARTBEAT, LEAVE, JOIN_REPLY, HEARTBEAT_REPLY, ADDRESS, RECOVER, KINDS };

static const ProtobufCMessageDescriptor *const descriptors[] = {
    [JOIN] = &fsdp__v1__join_request__descriptor,
    [HEARTBEAT] = &fsdp__v1__heartbeat_request__descriptor,
    [LEAVE] = &fsdp__v1__leave_request__descriptor,
    [JOIN_REPLY] = &fsdp__v1__join_reply__descriptor,
    [HEARTBEAT_REPLY] = &fsdp__v1__heartbeat_reply__descriptor,
    [RECOVER] = &fsdp__v1__recover_request__descriptor,
};

static int check(unsigned kind, const ProtobufCMessage *msg, fsdp_status_t *st) {
  switch (kind) {
  case JOIN:
    return fsdp_peer_check_join(&rules, (const void *)msg, st);
  case HEARTBEAT:
    return fsdp_peer_check_heartbeat(&rules, (const void *)msg, st);
  case LEAVE:
    return fsdp_peer_check_leave(&rules, (const void *)msg, st);
  case JOIN_REPLY:
    return fsdp_peer_check_join_reply(&rules, 1, "127.0.0.1:7101", (const void *)msg, st);
  case RECOVER:
    return fsdp_peer_check_recover(&rules, (const void *)msg, st);
  default:
    return fsdp_peer_check_heartbeat_reply(&rules, 1, (const void *)msg, st);
  }
}

static void address_passes(const ProtobufCBinaryData *addr) {
  fsdp_status_t st;
  if (addr->len && fsdp_ucx_address_check(addr->data, addr->len, "host 1", &st) < 0)
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0)
    return 0;
  unsigned kind = data[0] % KINDS;
  fsdp_status_t st = FSDP_STATUS_INIT, again = FSDP_STATUS_INIT;
  if (kind == ADDRESS) {
    int r = fsdp_ucx_address_check(data + 1, size - 1, "host 1", &st);
    if ((r < 0 && st.message[0] == '\0') ||
        fsdp_ucx_address_check(data + 1, size - 1, "host 1", &again) != r)
      abort();
    return 0;
  }
  ProtobufCMessage *msg;
  if (fsdp_wire_decode_bytes(descriptors[kind], data + 1, size - 1, &msg, &st) < 0) {
    if (st.message[0] == '\0')
      abort();
    return 0;
  }
  int r = check(kind, msg, &st);
  if ((r < 0 && st.message[0] == '\0') || check(kind, msg, &again) != r ||
      (r < 0 && strcmp(st.message, again.message) != 0))
    abort(); /* every refusal says why, and the same each time */
  if (r == 0 && kind == JOIN)
    address_passes(&((const Fsdp__V1__JoinRequest *)msg)->ucx_worker_address);
  if (r == 0 && kind == JOIN_REPLY)
    address_passes(&((const Fsdp__V1__JoinReply *)msg)->ucx_worker_address);
  protobuf_c_message_free_unpacked(msg, NULL);
  return 0;
}
