/* Checkpoints of a job's state on this host, written and read by the daemon alone: each
 * unit's fp32 master shards and its optimizer state, with nothing asked of a trainer.
 *
 * On disk, under the directory a caller names: step-<S>/ per checkpoint (S: the job's last
 * completed step), holding host-<H>.bin (the units' blocks, one after the other), host-<H>.json
 * (the job, the units' layouts, each block's offset, length and XXH64) and manifest.json,
 * written last: a step directory without it is not a checkpoint. Every file is written under
 * a temporary name, fsynced and renamed, and the directory fsynced after, so a crash at any
 * point leaves the checkpoints before it as they were.
 *
 * The caller describes the job (fsdp_checkpoint_job_t: pointers into its memory, taken on
 * the loop); these functions only read and write those buffers and files. Blocking: from a
 * pool thread, while nothing else writes the buffers. One host's files so far (hosts 1). */
#ifndef FSDP_CHECKPOINT_H
#define FSDP_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* The format this fsdpd writes and reads (manifest.json's "format"). */
#define FSDP_CHECKPOINT_FORMAT 1
#define FSDP_CHECKPOINT_ARRAYS_MAX 3

typedef struct fsdp_checkpoint_unit {
  const char *name;
  uint64_t numel, padded_numel, shard_numel;
  uint32_t shards, host_first_shard, host_shards;
  float *masters; /* host_shards x shard_numel */
  /* The optimizer's state, host_shards x shard_numel each, and its step count; none
   * (arrays 0, steps NULL) without an optimizer or for a frozen unit. */
  unsigned arrays;
  float *state[FSDP_CHECKPOINT_ARRAYS_MAX];
  uint64_t *steps;
} fsdp_checkpoint_unit_t;

typedef struct fsdp_checkpoint_job {
  const char *job;
  uint64_t step;         /* the job's last completed step, which names the checkpoint */
  const char *optimizer; /* its kind ("ADAMW"), "" without one */
  const fsdp_checkpoint_unit_t *units;
  size_t n_units;
} fsdp_checkpoint_job_t;

/* Writes the job's state into dir/step-<step>/ (dir is made if missing; an older checkpoint
 * of the same step is replaced only once the new one is complete); *ret_path (size bytes):
 * the step directory. Fails with st naming the file and the call: RESOURCE_EXHAUSTED for a
 * full disk, UNAVAILABLE for other I/O errors. */
int fsdp_checkpoint_save(const char *dir, const fsdp_checkpoint_job_t *job, char *ret_path,
                         size_t size, fsdp_status_t *st);

/* Reads the checkpoint at dir (a step directory, or the newest complete one under it) into
 * the job's buffers, having checked all of it first, so that a refusal changes nothing:
 * FAILED_PRECONDITION for another format, another job, a unit missing or laid out otherwise,
 * or optimizer state the job has no room for; DATA_LOSS naming the file and the byte range
 * that does not match its checksum; NOT_FOUND without a checkpoint there. *ret_path (size
 * bytes): the step directory read; *ret_step: its step. */
int fsdp_checkpoint_load(const char *dir, const fsdp_checkpoint_job_t *job, char *ret_path,
                         size_t size, uint64_t *ret_step, fsdp_status_t *st);

#endif
