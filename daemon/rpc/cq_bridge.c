/* A completion queue drained onto the loop (see cq_bridge.h).
 *
 * The hand-off holds separately allocated nodes, because one call may have several tags
 * queued at once (the server's arrival and cancellation). Close follows gRPC's rule: the
 * queue shuts down only once nothing more can be started on it; its thread then sees
 * GRPC_QUEUE_SHUTDOWN, says so through the same hand-off and exits, and the loop joins it
 * before the queue is destroyed and the handle closed. */
#include "daemon/rpc/cq_bridge.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#include <grpc/support/time.h>

#include "common/log.h"

typedef struct event {
  void *tag;
  bool success;
  struct event *next;
} event_t;

struct fsdp_cq_bridge {
  uv_loop_t *loop;
  fsdp_cq_bridge_ops_t ops;
  void *data;
  grpc_completion_queue *cq;
  pthread_t thread;
  bool thread_running; /* loop thread: started and not yet joined */
  bool closing;
  void (*done)(void *data);
  void *done_data;

  pthread_mutex_t lock;
  event_t *head, *tail;
  bool thread_exited;
  uv_async_t async;
};

static void *thread_main(void *arg) {
  fsdp_cq_bridge_t *bridge = arg;
  for (;;) {
    grpc_event ev =
        grpc_completion_queue_next(bridge->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (ev.type == GRPC_QUEUE_SHUTDOWN)
      break;
    if (ev.type != GRPC_OP_COMPLETE)
      continue;
    if (bridge->ops.on_cq_event)
      bridge->ops.on_cq_event(bridge->data, ev.tag, ev.success);
    else
      fsdp_cq_bridge_post(bridge, ev.tag, ev.success);
  }
  pthread_mutex_lock(&bridge->lock);
  bridge->thread_exited = true;
  pthread_mutex_unlock(&bridge->lock);
  uv_async_send(&bridge->async);
  return NULL;
}

void fsdp_cq_bridge_post(fsdp_cq_bridge_t *bridge, void *tag, bool success) {
  event_t *ev = malloc(sizeof *ev);
  if (!ev) {
    /* Losing an event would leak a call or hang a stop; there is no way to go on. */
    log_error("out of memory handing a gRPC completion to the loop");
    abort();
  }
  *ev = (event_t){.tag = tag, .success = success};
  pthread_mutex_lock(&bridge->lock);
  if (bridge->tail)
    bridge->tail->next = ev;
  else
    bridge->head = ev;
  bridge->tail = ev;
  pthread_mutex_unlock(&bridge->lock);
  uv_async_send(&bridge->async);
}

void fsdp_cq_bridge_wake(fsdp_cq_bridge_t *bridge) {
  uv_async_send(&bridge->async);
}

static void on_closed(uv_handle_t *handle) {
  fsdp_cq_bridge_t *bridge = handle->data;
  void (*done)(void *data) = bridge->done;
  void *done_data = bridge->done_data;
  pthread_mutex_destroy(&bridge->lock);
  free(bridge);
  if (done)
    done(done_data);
}

static void on_async(uv_async_t *handle) {
  fsdp_cq_bridge_t *bridge = handle->data;
  pthread_mutex_lock(&bridge->lock);
  event_t *ev = bridge->head;
  bridge->head = bridge->tail = NULL;
  bool exited = bridge->thread_exited;
  pthread_mutex_unlock(&bridge->lock);
  while (ev) {
    event_t *next = ev->next;
    bridge->ops.on_event(bridge->data, ev->tag, ev->success);
    free(ev);
    ev = next;
  }
  if (exited && bridge->thread_running) {
    pthread_join(bridge->thread, NULL);
    bridge->thread_running = false;
  }
  if (!bridge->closing) {
    if (bridge->ops.on_drained)
      bridge->ops.on_drained(bridge->data);
    return;
  }
  if (!bridge->thread_running && bridge->cq) {
    grpc_completion_queue_destroy(bridge->cq);
    bridge->cq = NULL;
    uv_close((uv_handle_t *)&bridge->async, on_closed);
  }
}

int fsdp_cq_bridge_new(uv_loop_t *loop, const fsdp_cq_bridge_ops_t *ops, void *data,
                       fsdp_cq_bridge_t **ret_bridge) {
  fsdp_cq_bridge_t *bridge = calloc(1, sizeof *bridge);
  if (!bridge)
    return -ENOMEM;
  bridge->loop = loop;
  bridge->ops = *ops;
  bridge->data = data;
  bridge->cq = grpc_completion_queue_create_for_next(NULL);
  pthread_mutex_init(&bridge->lock, NULL);
  *ret_bridge = bridge;
  return 0;
}

grpc_completion_queue *fsdp_cq_bridge_queue(const fsdp_cq_bridge_t *bridge) {
  return bridge->cq;
}

int fsdp_cq_bridge_start(fsdp_cq_bridge_t *bridge) {
  /* The thread first: if it cannot start, the bridge can still simply be freed. It touches
   * the handle only once something completes, which nothing can before this returns. */
  int r = pthread_create(&bridge->thread, NULL, thread_main, bridge);
  if (r != 0)
    return -r;
  bridge->thread_running = true;
  uv_async_init(bridge->loop, &bridge->async, on_async);
  bridge->async.data = bridge;
  return 0;
}

void fsdp_cq_bridge_close(fsdp_cq_bridge_t *bridge, void (*done)(void *data), void *data) {
  bridge->closing = true;
  bridge->done = done;
  bridge->done_data = data;
  grpc_completion_queue_shutdown(bridge->cq);
}

void fsdp_cq_bridge_free(fsdp_cq_bridge_t *bridge) {
  if (!bridge)
    return;
  grpc_completion_queue_shutdown(bridge->cq);
  grpc_completion_queue_destroy(bridge->cq);
  pthread_mutex_destroy(&bridge->lock);
  free(bridge);
}
