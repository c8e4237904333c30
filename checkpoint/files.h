/* What the checkpoint library's files share (checkpoint.h is the contract): the names in a
 * checkpoint's directory, a unit's blocks, the I/O errors as statuses, and the complete
 * checkpoints a directory holds. Internal to checkpoint/. */
#ifndef FSDP_CHECKPOINT_FILES_H
#define FSDP_CHECKPOINT_FILES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "checkpoint/checkpoint.h"

#define MANIFEST "manifest.json"
#define IO_CHUNK ((size_t)4 << 20)
/* The alignment of direct I/O's buffers, file offsets and lengths (a page, the most any
 * block device asks), and so of staging's buffers, which saves write from. */
#define DIRECT_ALIGN ((size_t)4096)

/* Host h's files: "host-<h>.bin", "host-<h>.json". */
void host_file(char *buf, size_t size, unsigned host, const char *ext);

/* err (an errno) as st's status: ABORTED for ECANCELED (the daemon's stop),
 * RESOURCE_EXHAUSTED for a full disk, UNAVAILABLE otherwise; the message names what and
 * path. Returns the code. */
int io_failed(fsdp_status_t *st, const char *what, const char *path, int err);

/* a + sep + b into buf; false when it does not fit. */
bool join(char *buf, size_t size, const char *a, const char *sep, const char *b);

static inline size_t host_numel(const fsdp_checkpoint_unit_t *u) {
  return (size_t)u->host_shards * u->shard_numel;
}

/* The unit's blocks in file order: its masters, then each optimizer array. */
static inline unsigned n_blocks(const fsdp_checkpoint_unit_t *u) {
  return 1 + u->arrays;
}

static inline float *block(const fsdp_checkpoint_unit_t *u, unsigned b) {
  return b == 0 ? u->masters : u->state[b - 1];
}

const char *block_name(unsigned b);

static inline size_t round_up(size_t n, size_t to) {
  return (n + to - 1) / to * to;
}

/* The steps of dir's complete checkpoints (step-N/ with a manifest), at most max of them in
 * *ret (any order); how many there are. */
size_t complete_steps(const char *dir, uint64_t *ret, size_t max);

/* For qsort: steps from the highest down. */
int steps_descending(const void *a, const void *b);

#endif
