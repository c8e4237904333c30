/* The trainer's side of the fast path (proto/fastpath.h): requests into the session's
 * shared rings, and the wait for their replies, which come in any order.
 *
 * One thread at a time, like the trainer that owns it. */
#ifndef FSDP_CLIENT_FASTPATH_H
#define FSDP_CLIENT_FASTPATH_H

#include <stddef.h>
#include <stdint.h>

#include <stdbool.h>

#include "proto/fastpath.h"

typedef struct fsdp_fast_client fsdp_fast_client_t;

/* Maps the region (bytes of region_fd) and keeps the doorbells; takes the three descriptors,
 * closing them on failure too. lifeline: the session's memory channel (borrowed), whose end
 * says that the daemon will answer nothing more. spin: whether a wait polls the reply ring
 * for a while before it sleeps on the doorbell, which saves a wake-up but takes a CPU. -errno,
 * or FSDP_E_PROTOCOL_VERSION when the region is not of this format. */
int fsdp_fast_client_open(int region_fd, size_t bytes, int daemon_bell, int trainer_bell,
                          int lifeline, bool spin, fsdp_fast_client_t **ret_client);
void fsdp_fast_client_close(fsdp_fast_client_t *fc);

/* Sends rq (its seq is set here); returns the seq, or 0 when FSDP_FASTPATH_MAX_INFLIGHT
 * operations await their reply (the caller then goes over gRPC). */
uint64_t fsdp_fast_client_send(fsdp_fast_client_t *fc, fsdp_fast_request_t *rq);

/* Waits for seq's reply until deadline_ms (fsdp_clock_deadline_ms); 0 with it in *ret_reply,
 * -ETIMEDOUT (seq stays in flight: wait again, or cancel it), or -EPIPE when the daemon
 * closed the memory channel (it ended the session, or exited): only gRPC can say more. */
int fsdp_fast_client_wait(fsdp_fast_client_t *fc, uint64_t seq, int64_t deadline_ms,
                          fsdp_fast_reply_t *ret_reply);

/* Gives up on seq: the daemon withdraws the operation (its rank no longer counts in the
 * collective), and its reply is dropped when it comes. NULL-safe. */
void fsdp_fast_client_cancel(fsdp_fast_client_t *fc, uint64_t seq);

#endif
