/* The byte formats between the daemons' data planes, which gRPC does not carry: the header
 * before UCX's worker address, the ring collectives' tags and control frame, and the op id
 * every host must compute alike for the same collective.
 *
 * One version covers them all, FSDP_HOST_WIRE_VERSION. It travels in the UCX address
 * header, which a peer sends in Peer.Join: a daemon refuses the address of another version
 * there (fsdp_ucx_address_check), before any collective runs with that peer, so the tags and
 * the op id, which carry no version byte of their own, need none. The control frame carries
 * it as well and is refused on another (fsdp_ring_frame_unpack). Bump it on any change to
 * what this header describes, the op id's hash included.
 *
 * Pure functions of their arguments with explicit byte order: any thread. No gRPC and no
 * protobuf here, so that the transport, the collectives and the data plane can use it. */
#ifndef FSDP_HOST_FORMATS_H
#define FSDP_HOST_FORMATS_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define FSDP_HOST_WIRE_VERSION 1

/* ---- The UCX address ----
 * What a daemon sends as its data-plane address: the magic "FSDPUCX", the version (one
 * byte), the length of the UCX address (big-endian uint32) and UCX's packed worker address,
 * which only UCX can unpack. */
#define FSDP_UCX_ADDRESS_HEADER_BYTES 12
/* Largest address a peer may send: UCX's are a few hundred bytes per transport. */
#define FSDP_UCX_ADDRESS_MAX 65536

/* Writes the header for a UCX address of ucx_len bytes (nonzero, below 2^32) into header
 * (FSDP_UCX_ADDRESS_HEADER_BYTES). */
void fsdp_ucx_address_pack_header(size_t ucx_len, uint8_t *header);

/* Checks the framing of address bytes: the magic, the version and the length the header
 * gives against len (UCX's address then starts at FSDP_UCX_ADDRESS_HEADER_BYTES). 0, or
 * FSDP_E_INVALID_ARGUMENT with st naming label ("peer" when NULL) and what is wrong; another
 * version is named with ours. */
int fsdp_ucx_address_check(const void *address, size_t len, const char *label,
                           fsdp_status_t *st);

/* ---- The ring's tags ----
 * 64-bit UCX tags: the op id in the high 32 bits, then a step byte. Data: op_id << 32 |
 * step << 24 | chunk. Control: op_id << 32 | 0xff << 24 | sender << 8 | kind. */
#define FSDP_RING_TAG_STEPS 0xffu            /* data steps are below; 0xff is control */
#define FSDP_RING_TAG_CHUNKS ((size_t)1 << 24) /* chunk indices are below */
/* The bits a receive of every control frame of one op matches on, whoever sent it. */
#define FSDP_RING_TAG_CONTROL_MASK (~(uint64_t)0 << 24)

uint64_t fsdp_ring_tag_data(uint32_t op_id, unsigned step, uint32_t chunk);
/* kind: a fsdp_ring_frame_kind_t; sender below 256. */
uint64_t fsdp_ring_tag_control(uint32_t op_id, unsigned sender, unsigned kind);

/* ---- The ring's control frame ----
 * FSDP_RING_FRAME_BYTES bytes: version, kind, sender, culprit (one byte each), the negated
 * code (big-endian uint32), and the text, NUL-terminated and padded with zeros. */
#define FSDP_RING_FRAME_BYTES 256
#define FSDP_RING_FRAME_TEXT (FSDP_RING_FRAME_BYTES - 8)
/* culprit when the frame names none. */
#define FSDP_RING_FRAME_NOBODY 0xff

typedef enum fsdp_ring_frame_kind {
  FSDP_RING_FRAME_ABORT = 1,   /* the sender failed: code and text say why */
  FSDP_RING_FRAME_TIMEOUT = 2, /* the sender's deadline passed waiting for culprit */
} fsdp_ring_frame_kind_t;

typedef struct fsdp_ring_frame {
  uint8_t kind; /* a fsdp_ring_frame_kind_t, or another value from a newer sender */
  uint8_t sender, culprit;
  int32_t code;                     /* a negative code, as the sender failed */
  char text[FSDP_RING_FRAME_TEXT]; /* NUL-terminated; a longer one is cut when packed */
} fsdp_ring_frame_t;

/* Writes frame into bytes (FSDP_RING_FRAME_BYTES). */
void fsdp_ring_frame_pack(const fsdp_ring_frame_t *frame, uint8_t *bytes);

/* Reads a frame of len bytes into *ret_frame. 0, or FSDP_E_PROTOCOL_VERSION naming both
 * versions when the frame is of another, or FSDP_E_INVALID_ARGUMENT when len is not
 * FSDP_RING_FRAME_BYTES, with st saying so. */
int fsdp_ring_frame_unpack(const uint8_t *bytes, size_t len, fsdp_ring_frame_t *ret_frame,
                           fsdp_status_t *st);

/* ---- The op id ----
 * The 32-bit op id of a ring collective: the same on every host, different for every
 * collective that may run at once. FNV-1a over the bytes of job, "/", unit, then step and
 * generation (8 bytes each, little-endian), then the ring kind (fsdp_ring_kind_t, whose
 * values are part of this format; FSDP_OP_KIND_REGATHER for a step's second all-gather, the
 * one for the backward of a unit resharded after its forward; FSDP_OP_KIND_NORM for the
 * all-reduce of a unit's part of the gradient's norm, which clipping sums among hosts;
 * FSDP_OP_KIND_RECOVER for a job's state sent to a host that recovers it from a replica, with
 * unit "" and the asking daemon's incarnation for the generation) xored into the hash and
 * multiplied once more. */
#define FSDP_OP_KIND_REGATHER 3u
#define FSDP_OP_KIND_NORM 4u
#define FSDP_OP_KIND_RECOVER 5u

uint32_t fsdp_op_id(const char *job, const char *unit, uint64_t step, uint64_t generation,
                    uint32_t ring_kind);

#endif
