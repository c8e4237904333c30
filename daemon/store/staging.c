/* A job's host staging buffers (daemon/store/staging.h). */
#include "daemon/store/staging.h"

#include <stdlib.h>

void fsdp_staging_init(fsdp_staging_t *staging, const fsdp_backend_t *backend) {
  *staging = (fsdp_staging_t){.backend = backend};
}

void fsdp_staging_cleanup(fsdp_staging_t *staging) {
  if (!staging)
    return;
  while (staging->buffers) {
    fsdp_staging_buffer_t *b = staging->buffers;
    staging->buffers = b->next;
    fsdp_backend_host_free(staging->backend, b->base);
    free(b);
  }
}

int fsdp_staging_take(fsdp_staging_t *staging, size_t bytes,
                      void (*forget)(void *arg, const void *base, size_t bytes), void *arg,
                      fsdp_staging_buffer_t **ret, fsdp_status_t *st) {
  fsdp_staging_buffer_t *best = NULL, *smaller = NULL;
  for (fsdp_staging_buffer_t *b = staging->buffers; b; b = b->next) {
    if (b->lent)
      continue;
    if (b->wanted < bytes)
      smaller = b;
    else if (!best || b->wanted < best->wanted)
      best = b;
  }
  if (!best && smaller) { /* remade at the new size: the count stays what was lent at once */
    if (smaller->base)
      forget(arg, smaller->base, smaller->bytes);
    smaller->wanted = bytes;
    best = smaller;
  } else if (!best) {
    if (!(best = calloc(1, sizeof *best)))
      return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED,
                             "out of host memory for a staging buffer of %zu bytes", bytes);
    best->wanted = bytes;
    best->next = staging->buffers;
    staging->buffers = best;
  }
  best->lent = true;
  *ret = best;
  return 0;
}

void fsdp_staging_give(fsdp_staging_buffer_t *buffer) {
  if (buffer)
    buffer->lent = false;
}

int fsdp_staging_make(const fsdp_staging_t *staging, fsdp_staging_buffer_t *buffer,
                      fsdp_status_t *st) {
  if (buffer->bytes >= buffer->wanted)
    return 0;
  fsdp_backend_host_free(staging->backend, buffer->base);
  buffer->base = NULL;
  buffer->bytes = 0;
  void *base;
  int r = fsdp_backend_host_new(staging->backend, buffer->wanted, &base, st);
  if (r < 0)
    return r;
  buffer->base = base;
  buffer->bytes = buffer->wanted;
  return 0;
}

void fsdp_staging_count(const fsdp_staging_t *staging, unsigned *ret_buffers, size_t *ret_bytes) {
  unsigned n = 0;
  size_t bytes = 0;
  for (const fsdp_staging_buffer_t *b = staging->buffers; b; b = b->next) {
    n++;
    bytes += b->wanted;
  }
  *ret_buffers = n;
  *ret_bytes = bytes;
}
