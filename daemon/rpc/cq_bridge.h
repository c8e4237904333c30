/* The bridge from a gRPC completion queue to the libuv loop, for the RPC server and the
 * Peer client alike.
 *
 * gRPC's C core completes its operations on a completion queue, which must be drained by a
 * thread of its own; the daemon's state belongs to the loop thread. The bridge owns the
 * queue and the thread that drains it: every completed tag, with its success flag, is handed
 * to the loop (a mutex-protected FIFO and uv_async_send, whose wake-ups coalesce, so the loop
 * drains all that is queued), where on_event runs for it, and after each batch on_drained.
 * A user that must act on the queue's thread (the server re-arms its requests there) gives
 * on_cq_event, which then receives every event on that thread instead and hands to the loop
 * what the loop must see with fsdp_cq_bridge_post.
 *
 * Threads: fsdp_cq_bridge_post and fsdp_cq_bridge_wake from any thread; the rest on the loop
 * thread. Lifetime: fsdp_cq_bridge_new (the caller has called grpc_init, and keeps gRPC
 * initialized until the bridge is gone), fsdp_cq_bridge_start, and fsdp_cq_bridge_close
 * once no operation is left on the queue: the queue shuts down, the events still queued are
 * delivered, the thread is joined, and `done` runs on the loop afterwards, never inside the
 * call; the bridge is then gone. A bridge never started is freed with fsdp_cq_bridge_free. */
#ifndef FSDP_CQ_BRIDGE_H
#define FSDP_CQ_BRIDGE_H

#include <stdbool.h>

#include <grpc/grpc.h>
#include <uv.h>

typedef struct fsdp_cq_bridge fsdp_cq_bridge_t;

typedef struct fsdp_cq_bridge_ops {
  void (*on_event)(void *data, void *tag, bool success); /* loop thread */
  void (*on_drained)(void *data);                        /* loop thread; may be NULL */
  void (*on_cq_event)(void *data, void *tag, bool success); /* queue's thread; may be NULL */
} fsdp_cq_bridge_ops_t;

/* ops is copied; data is passed to each. */
int fsdp_cq_bridge_new(uv_loop_t *loop, const fsdp_cq_bridge_ops_t *ops, void *data,
                       fsdp_cq_bridge_t **ret_bridge);
grpc_completion_queue *fsdp_cq_bridge_queue(const fsdp_cq_bridge_t *bridge);
/* The thread and the loop's handle. Nothing may complete on the queue before. */
int fsdp_cq_bridge_start(fsdp_cq_bridge_t *bridge);
/* Hands (tag, success) to the loop's on_event. Any thread. */
void fsdp_cq_bridge_post(fsdp_cq_bridge_t *bridge, void *tag, bool success);
/* Runs on_drained on the loop soon, with or without events. Any thread. */
void fsdp_cq_bridge_wake(fsdp_cq_bridge_t *bridge);
void fsdp_cq_bridge_close(fsdp_cq_bridge_t *bridge, void (*done)(void *data), void *data);
/* Frees a bridge that was never started. NULL-safe. */
void fsdp_cq_bridge_free(fsdp_cq_bridge_t *bridge);

#endif
