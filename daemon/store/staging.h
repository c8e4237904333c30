/* fsdp_staging_t: a job's host buffers for the rings among hosts when its memory is a GPU's.
 *
 * Why: the transport between hosts moves host memory (daemon/cluster/fabric.h), so a GPU
 * job's collectives across hosts stage what the rings move: the unsharded copy a gather
 * fills, the host sum a reduce sends, and the deferred sum of HYBRID_SHARD's gradient
 * accumulation, which the rings' hooks add to on the host. A buffer is lent to one of those
 * at a time and kept for the next once given back, so a job holds at most as many as it has
 * copies and sums lent by its pools (max_inflight each) plus units with a deferred sum: a
 * take that finds no free buffer large enough remakes a smaller free one at its size. The
 * backend makes them (pinned on a GPU, so that copies to and from the device run at the
 * link's speed). They are host memory outside memory.limit, which counts the job's arenas.
 *
 * Threads: the list and the lending are the loop's. Making a lent buffer's memory
 * (fsdp_staging_make: pinning pages takes long, and a GPU's free synchronizes it) is for the
 * thread pool, by the work the buffer is lent to, before anything reads its base. */
#ifndef FSDP_STAGING_H
#define FSDP_STAGING_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"
#include "daemon/backend/backend.h"

typedef struct fsdp_staging_buffer {
  void *base;    /* NULL until made */
  size_t bytes;  /* of base */
  size_t wanted; /* the size it is lent at: made by fsdp_staging_make when bytes is less */
  bool lent;
  struct fsdp_staging_buffer *next;
} fsdp_staging_buffer_t;

typedef struct fsdp_staging {
  const fsdp_backend_t *backend; /* borrowed */
  fsdp_staging_buffer_t *buffers;
} fsdp_staging_t;

void fsdp_staging_init(fsdp_staging_t *staging, const fsdp_backend_t *backend);
/* Frees every buffer, lent or not (the job goes: nothing uses them any more, and their
 * registrations went first); NULL-safe. */
void fsdp_staging_cleanup(fsdp_staging_t *staging);

/* Lends the smallest free buffer of at least `bytes`, or a smaller free one to be remade at
 * that size, whose memory is first passed to forget(arg, base, bytes) (what registered it
 * lets go), or a new one. RESOURCE_EXHAUSTED when there is no memory for its description. */
int fsdp_staging_take(fsdp_staging_t *staging, size_t bytes,
                      void (*forget)(void *arg, const void *base, size_t bytes), void *arg,
                      fsdp_staging_buffer_t **ret, fsdp_status_t *st);
/* NULL-safe. */
void fsdp_staging_give(fsdp_staging_buffer_t *buffer);

/* The lent buffer's memory, made (or remade) at the size it is lent at if it has none that
 * large; RESOURCE_EXHAUSTED naming the size when the host has none. Any one thread. */
int fsdp_staging_make(const fsdp_staging_t *staging, fsdp_staging_buffer_t *buffer,
                      fsdp_status_t *st);

/* The buffers and their bytes, made or lent to be made. */
void fsdp_staging_count(const fsdp_staging_t *staging, unsigned *ret_buffers, size_t *ret_bytes);

#endif
