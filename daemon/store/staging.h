/* fsdp_staging_t: a job's host buffers for the rings among hosts when its memory is a GPU's.
 *
 * Why: the transport between hosts moves host memory (daemon/cluster/fabric.h), so a GPU
 * job's collectives across hosts stage what the rings move: the unsharded copy a gather
 * fills, the host sum a reduce sends, and the deferred sum of HYBRID_SHARD's gradient
 * accumulation, which the rings' hooks add to on the host. A buffer is lent to one of those
 * at a time and kept for the next once given back, so a job holds at most as many as it has
 * copies and sums lent by its pools (max_inflight each) plus units with a deferred sum: a take
 * that finds no free buffer large enough remakes a smaller free one at its size. The backend makes them (pinned on a GPU, so that
 * copies to and from the device run at the link's speed). They are host memory outside
 * memory.limit, which counts the job's arenas.
 *
 * Loop thread only. */
#ifndef FSDP_STAGING_H
#define FSDP_STAGING_H

#include <stdbool.h>
#include <stddef.h>

#include "common/status.h"
#include "daemon/backend/backend.h"

typedef struct fsdp_staging_buffer {
  void *base;
  size_t bytes; /* its size; 0 while a failed remake left it without memory */
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

/* Lends the smallest free buffer of at least `bytes`, or makes one; RESOURCE_EXHAUSTED
 * naming the size when the host has no memory for it. A free buffer remade at a larger size
 * is first passed to forget(arg, base, bytes) (what registered it lets go). */
int fsdp_staging_take(fsdp_staging_t *staging, size_t bytes,
                      void (*forget)(void *arg, const void *base, size_t bytes), void *arg,
                      fsdp_staging_buffer_t **ret, fsdp_status_t *st);
/* NULL-safe. */
void fsdp_staging_give(fsdp_staging_buffer_t *buffer);

/* The buffers made and their bytes, lent or not. */
void fsdp_staging_count(const fsdp_staging_t *staging, unsigned *ret_buffers, size_t *ret_bytes);

#endif
