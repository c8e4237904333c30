/* Staging a job's checkpoint buffers (checkpoint/checkpoint.h): each block on a
 * DIRECT_ALIGN boundary, so that a save writes straight from it with direct I/O. */
#include "checkpoint/checkpoint.h"

#include "checkpoint/files.h"

static size_t staged_bytes(size_t n) {
  return round_up(n, DIRECT_ALIGN);
}

size_t fsdp_checkpoint_staging_bytes(const fsdp_checkpoint_unit_t *units, size_t n_units) {
  size_t bytes = 0;
  for (size_t i = 0; i < n_units; i++)
    bytes += n_blocks(&units[i]) * staged_bytes(host_numel(&units[i]) * sizeof(float)) +
             (units[i].steps ? staged_bytes(sizeof(uint64_t)) : 0);
  return bytes;
}

int fsdp_checkpoint_stage(fsdp_checkpoint_unit_t *units, size_t n_units, void *staging,
                          fsdp_checkpoint_copy_fn copy, void *ctx, fsdp_status_t *st) {
  char *at = staging;
  for (size_t i = 0; i < n_units; i++) {
    fsdp_checkpoint_unit_t *u = &units[i];
    size_t bytes = host_numel(u) * sizeof(float);
    for (unsigned b = 0; b < n_blocks(u); b++, at += staged_bytes(bytes)) {
      int r = copy ? copy(ctx, at, block(u, b), bytes, st) : 0;
      if (r < 0)
        return r;
      if (b == 0)
        u->masters = (float *)(void *)at;
      else
        u->state[b - 1] = (float *)(void *)at;
    }
    if (u->steps) {
      int r = copy ? copy(ctx, at, u->steps, sizeof *u->steps, st) : 0;
      if (r < 0)
        return r;
      u->steps = (uint64_t *)(void *)at;
      at += staged_bytes(sizeof(uint64_t));
    }
  }
  return 0;
}

int fsdp_checkpoint_unstage(const fsdp_checkpoint_unit_t *staged,
                            const fsdp_checkpoint_unit_t *units, size_t n_units,
                            fsdp_checkpoint_copy_fn copy, void *ctx, fsdp_status_t *st) {
  int r = 0;
  for (size_t i = 0; r == 0 && i < n_units; i++) {
    const fsdp_checkpoint_unit_t *u = &units[i];
    for (unsigned b = 0; r == 0 && b < n_blocks(u); b++)
      r = copy(ctx, block(u, b), block(&staged[i], b), host_numel(u) * sizeof(float), st);
    if (r == 0 && u->steps)
      r = copy(ctx, u->steps, staged[i].steps, sizeof *u->steps, st);
  }
  return r;
}
