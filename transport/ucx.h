/* fsdp_ucx_t: the UCX (ucp) endpoint of one process for bulk data between daemons.
 *
 * One ucp context and one worker per process, driven by a libuv loop: the worker's event fd
 * is watched with uv_poll, and each wake-up progresses the worker until it is idle and then
 * re-arms it. Peers are connected from address bytes exchanged out of band (the daemon
 * carries them in Peer.Join); messages are tagged sends and receives of caller memory.
 *
 * Threads. Everything here, creation and close included, runs on the loop thread: the
 * worker is single-threaded (UCS_THREAD_MODE_SINGLE) and no other thread may touch it.
 *
 * Requests. A send or receive uses caller-owned storage (fsdp_ucx_req_t) and caller memory,
 * both borrowed until the request's callback has run. Callbacks always run later, from the
 * loop, never inside the call that started the request, so a callback may start new
 * requests and a caller never sees its own state change under it. Every request's callback
 * runs exactly once: with 0, or with an error when the peer failed or was disconnected
 * (FSDP_E_UNAVAILABLE, fsdp_ucx_peer_error() says why), when the request was cancelled
 * (FSDP_E_CANCELLED), or when a message of another length arrived (FSDP_E_DATA_LOSS).
 *
 * Peers and failures. Peers are connected with UCX's peer error handling where UCX offers
 * it (tcp, RDMA): a peer that dies or whose connection breaks fails every pending request
 * with it, and the on_peer_failed callback tells the owner. UCX's shared-memory transports
 * refuse it, so where only those reach a peer (UCX_TLS without tcp, same host) it is
 * connected without: its death shows only as operations that do not finish, which the
 * caller bounds with deadlines and ends with fsdp_ucx_peer_fail(). Both ends of a
 * connection must use the same mode; with the same UCX_TLS on both, AUTO gives that.
 *
 * Lifetime. fsdp_ucx_new() makes the object; fsdp_ucx_close() fails every pending request
 * (their callbacks run with FSDP_E_CANCELLED), closes every endpoint, and frees everything
 * (peers included) before its callback runs. Peers live until then; a failed peer stays a
 * valid handle that refuses new requests. Tags are the caller's: a receive matches on the
 * tag alone, whichever peer sent it, so a tag must say who sent it; the peer given to a
 * receive only decides which failure ends it. */
#ifndef FSDP_UCX_H
#define FSDP_UCX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/status.h"

typedef struct fsdp_ucx fsdp_ucx_t;
typedef struct fsdp_ucx_peer fsdp_ucx_peer_t;
typedef struct fsdp_ucx_req fsdp_ucx_req_t;
typedef struct fsdp_ucx_mem fsdp_ucx_mem_t;
typedef struct fsdp_ucx_bounce fsdp_ucx_bounce_t;

/* Longest peer label kept (longer ones are cut). */
#define FSDP_UCX_LABEL_MAX 96

typedef enum fsdp_ucx_err_mode {
  FSDP_UCX_ERR_AUTO = 0, /* peer error handling, or none where UCX cannot offer it */
  FSDP_UCX_ERR_PEER,     /* always: tcp or RDMA only, shared memory is refused */
  FSDP_UCX_ERR_NONE,     /* never: failures show only as deadlines; shared memory only (over
                          * tcp, failing a stopped peer's endpoint is undefined in UCX) */
} fsdp_ucx_err_mode_t;

typedef struct fsdp_ucx_options {
  fsdp_ucx_err_mode_t err_mode;
  /* Called once per peer, on the loop, when UCX reports the peer failed (peer error handling
   * only) or fsdp_ucx_peer_fail() was called; after the peer's pending requests have been
   * failed (their callbacks may still be queued). May be NULL. */
  void (*on_peer_failed)(fsdp_ucx_peer_t *peer, void *arg);
  void *arg;
} fsdp_ucx_options_t;

typedef void (*fsdp_ucx_req_cb)(fsdp_ucx_req_t *req, int status);

/* A request's storage. Only `data` is the caller's; the rest is private. */
struct fsdp_ucx_req {
  void *data;
  /* private */
  fsdp_ucx_t *ucx;
  fsdp_ucx_peer_t *peer;
  void *ucp_req;
  fsdp_ucx_bounce_t *bounce; /* the copy a send to a peer without error handling is from */
  fsdp_ucx_req_cb cb;
  fsdp_ucx_req_t *prev, *next; /* in the peer's pending list, then in the completed queue */
  size_t expected, received;
  int status;
  bool is_recv, done;
};

/* Creates the context and worker (tag matching and wakeup) on loop, which must outlive the
 * object. Returns 0 and sets *ret_ucx, or a negative code with st saying what failed;
 * nothing is left behind. options may be NULL (AUTO, no callback). */
int fsdp_ucx_new(uv_loop_t *loop, const fsdp_ucx_options_t *options, fsdp_ucx_t **ret_ucx,
                 fsdp_status_t *st);

/* The loop the object runs on. */
uv_loop_t *fsdp_ucx_loop(const fsdp_ucx_t *ucx);

/* This process's address bytes for a peer's fsdp_ucx_connect, in the format of
 * proto/host/formats.h: a short header (format version) and the worker's UCX address. Owned
 * by the object. */
void fsdp_ucx_address(const fsdp_ucx_t *ucx, const void **ret_bytes, size_t *ret_len);

/* Connects to a peer from its address bytes. label names the peer in every message
 * ("host 1 (10.0.0.2:7100)"); it is copied. Their framing is checked first
 * (fsdp_ucx_address_check); what follows the header is UCX's own packed worker address,
 * which only UCX can unpack, and which it asserts on (aborting the process) when it cannot:
 * the daemon has it unpacked by a process of its own first (daemon/cluster/address_check.h).
 * Returns 0 and sets *ret_peer, or FSDP_E_INVALID_ARGUMENT for bytes that are not an
 * address of this format, or FSDP_E_UNAVAILABLE when UCX cannot reach the peer, with st
 * naming the label and why. */
int fsdp_ucx_connect(fsdp_ucx_t *ucx, const void *address, size_t len, const char *label,
                     fsdp_ucx_peer_t **ret_peer, fsdp_status_t *st);

const char *fsdp_ucx_peer_label(const fsdp_ucx_peer_t *peer);
/* Whether peer error handling is on for this peer (see the header comment). */
bool fsdp_ucx_peer_has_err_handling(const fsdp_ucx_peer_t *peer);
/* NULL while the peer is usable; once it failed, why ("connection reset by remote peer"). */
const char *fsdp_ucx_peer_error(const fsdp_ucx_peer_t *peer);
/* The number of this peer's requests whose callbacks have not run yet. */
unsigned fsdp_ucx_peer_pending(const fsdp_ucx_peer_t *peer);

/* Declares the peer failed (reason is copied): its endpoint is closed at once without
 * waiting for the other end, and every pending request with it fails with
 * FSDP_E_UNAVAILABLE, which frees the memory they borrowed. For a peer that stopped
 * answering: UCX would otherwise hold the requests, and the buffers, forever. A peer
 * already failed is left as it is. Reconnecting takes a new fsdp_ucx_connect. */
void fsdp_ucx_peer_fail(fsdp_ucx_peer_t *peer, const char *reason);

/* Registers [addr, addr + len) with UCX once (ucp_mem_map), for transfers that name it: UCX
 * then skips its registration cache for them, which on RDMA transports would otherwise pin
 * and look up the pages of every chunk. The memory must stay mapped until the registration
 * is released. Returns 0 and sets *ret_mem, or FSDP_E_INVALID_ARGUMENT / -ENOMEM /
 * FSDP_E_UNAVAILABLE (UCX refused) with st saying why. */
int fsdp_ucx_mem_register(fsdp_ucx_t *ucx, void *addr, size_t len, fsdp_ucx_mem_t **ret_mem,
                          fsdp_status_t *st);

/* Releases a registration; no pending transfer may be using it. NULL is a no-op.
 * fsdp_ucx_close releases those still held, and their handles die with the object. */
void fsdp_ucx_mem_deregister(fsdp_ucx_mem_t *mem);

/* Starts a tagged send of len bytes of buf to peer. mem: a registration that holds buf, or
 * NULL (one that does not hold all of it is not used). Returns 0 (cb will run), or
 * FSDP_E_UNAVAILABLE at once for a failed peer (cb will not run). */
int fsdp_ucx_send(fsdp_ucx_req_t *req, fsdp_ucx_peer_t *peer, const void *buf, size_t len,
                  const fsdp_ucx_mem_t *mem, uint64_t tag, fsdp_ucx_req_cb cb);

/* Posts a receive of exactly len bytes into buf for a message whose tag equals tag on the
 * bits set in tag_mask, expected from peer; mem as for a send. Same returns as
 * fsdp_ucx_send. */
int fsdp_ucx_recv(fsdp_ucx_req_t *req, fsdp_ucx_peer_t *peer, void *buf, size_t len,
                  const fsdp_ucx_mem_t *mem, uint64_t tag, uint64_t tag_mask,
                  fsdp_ucx_req_cb cb);

/* Asks to end a pending request early. A receive that no message has matched yet ends with
 * FSDP_E_CANCELLED; a send, or a receive already being filled, runs to completion or
 * failure (end those with fsdp_ucx_peer_fail). A request whose callback ran is ignored. */
void fsdp_ucx_cancel(fsdp_ucx_req_t *req);

/* Fails every pending request (FSDP_E_CANCELLED), closes every endpoint, stops watching the
 * event fd and frees everything; cb(arg) runs on the loop when all is gone (cb may be NULL).
 * Request callbacks still run, before cb. NULL is a no-op. */
void fsdp_ucx_close(fsdp_ucx_t *ucx, void (*cb)(void *arg), void *arg);

#endif
