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

/* An original parameter of a unit: its elements [offset, offset + the shape's product) of the
 * unit's flat buffer, and its own dtype (the .proto's name, "DTYPE_FP32"). */
typedef struct fsdp_checkpoint_param {
  const char *name;
  const uint64_t *shape;
  size_t ndim;
  uint64_t offset;
  const char *dtype;
} fsdp_checkpoint_param_t;

typedef struct fsdp_checkpoint_unit {
  const char *name;
  const char *strategy; /* "FULL_SHARD" */
  const fsdp_checkpoint_param_t *params;
  size_t n_params;
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

/* The bytes of staging memory a snapshot of the units takes (fsdp_checkpoint_stage). */
size_t fsdp_checkpoint_staging_bytes(const fsdp_checkpoint_unit_t *units, size_t n_units);

/* Copies the units' buffers (masters, optimizer state, step counts) into staging, of
 * fsdp_checkpoint_staging_bytes and 64-byte aligned, with copy(ctx, dst, src, bytes), and
 * points the units at the copies: a save from them then writes what the job held at this
 * moment while the job goes on. */
void fsdp_checkpoint_stage(fsdp_checkpoint_unit_t *units, size_t n_units, void *staging,
                           void (*copy)(void *ctx, void *dst, const void *src, size_t bytes),
                           void *ctx);

/* Writes the job's state into dir/step-<step>/ (dir is made if missing; an older checkpoint
 * of the same step is replaced only once the new one is complete), then removes all but the
 * newest `keep` complete checkpoints in dir (0: keeps them all); *ret_path (size bytes): the
 * step directory. Fails with st naming the file and the call: RESOURCE_EXHAUSTED for a full
 * disk, UNAVAILABLE for other I/O errors. */
int fsdp_checkpoint_save(const char *dir, const fsdp_checkpoint_job_t *job, unsigned keep,
                         char *ret_path, size_t size, fsdp_status_t *st);

/* A checkpoint open for reading: its metadata, and its blocks checked as they are read. */
typedef struct fsdp_checkpoint_reader fsdp_checkpoint_reader_t;

/* Opens the checkpoint at dir (a step directory, or the newest complete one under it):
 * NOT_FOUND without one; FAILED_PRECONDITION for another format or several hosts' files;
 * DATA_LOSS for metadata that cannot be read. */
int fsdp_checkpoint_open(const char *dir, fsdp_checkpoint_reader_t **ret, fsdp_status_t *st);
void fsdp_checkpoint_close(fsdp_checkpoint_reader_t *reader); /* NULL-safe */

const char *fsdp_checkpoint_path(const fsdp_checkpoint_reader_t *reader); /* the step dir */
const char *fsdp_checkpoint_job(const fsdp_checkpoint_reader_t *reader);
uint64_t fsdp_checkpoint_step(const fsdp_checkpoint_reader_t *reader);
/* Its units as saved: layouts, parameters and how many optimizer arrays; no buffers. Valid
 * while the reader is open. */
const fsdp_checkpoint_unit_t *fsdp_checkpoint_units(const fsdp_checkpoint_reader_t *reader,
                                                    size_t *ret_n);
uint64_t fsdp_checkpoint_optimizer_steps(const fsdp_checkpoint_reader_t *reader, size_t unit);

/* Block b of unit (0: the masters, then the optimizer's arrays; host_shards x shard_numel
 * floats) into dst, or only checked when dst is NULL: DATA_LOSS names the file and the byte
 * range that does not match its checksum, or where the file ends too soon. */
int fsdp_checkpoint_read(fsdp_checkpoint_reader_t *reader, size_t unit, unsigned b, float *dst,
                         fsdp_status_t *st);

/* Reads the checkpoint at dir (a step directory, or the newest complete one under it) into
 * the job's buffers, having checked all of it first, so that a refusal changes nothing. A
 * unit saved at another local world size (another padding) loads when both the checkpoint
 * and the job hold every shard of it on this host: its elements are the same. Refused:
 * FAILED_PRECONDITION for another format, another job, a unit missing, of another numel or
 * of which either side holds a part at another layout, optimizer state the job has no room
 * for; DATA_LOSS naming the file and the byte range
 * that does not match its checksum; NOT_FOUND without a checkpoint there. *ret_path (size
 * bytes): the step directory read; *ret_step: its step. */
int fsdp_checkpoint_load(const char *dir, const fsdp_checkpoint_job_t *job, char *ret_path,
                         size_t size, uint64_t *ret_step, fsdp_status_t *st);

#endif
