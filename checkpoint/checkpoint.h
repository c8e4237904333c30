/* Checkpoints of a job's state, written and read by the daemons alone: each unit's fp32
 * master shards and its optimizer state, with nothing asked of a trainer.
 *
 * On disk, under the directory a caller names: step-<S>/ per checkpoint (S: the job's last
 * completed step), holding for each host h of the job host-<h>.bin (the units' blocks of its
 * shards, one after the other, each where its metadata says: on a 4 KiB boundary when
 * written with direct I/O) and host-<h>.json (the job, the units' layouts and original
 * parameters, each block's offset, length and XXH64), and manifest.json, written last by
 * host 0 once every host's files are there: a step directory without it is not a
 * checkpoint. Every file is written under a temporary name, fsynced and renamed, the step
 * directory made as step-<S>.<job>.partial and renamed whole, and its parent fsynced, so a
 * crash at any point leaves the checkpoints before it as they were. With several hosts the
 * directory is one that every host sees (a shared filesystem).
 *
 * A reader serves any range of a unit's elements from whichever hosts' files hold it, so a
 * checkpoint loads at any layout of the same units: another number of hosts or local ranks,
 * another strategy.
 *
 * The caller describes the job (fsdp_checkpoint_job_t: pointers into its memory, taken on
 * the loop); these functions only read and write those buffers and files. Blocking: from a
 * pool thread, while nothing else writes the buffers. */
#ifndef FSDP_CHECKPOINT_H
#define FSDP_CHECKPOINT_H

#include <limits.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

/* How a save under way goes on as the daemon stops (fsdp_checkpoint_job_t.stopping). */
enum fsdp_checkpoint_stopping {
  FSDP_CHECKPOINT_GO_ON,
  FSDP_CHECKPOINT_HURRY,
  FSDP_CHECKPOINT_ABANDON
};

/* The format this fsdpd writes and reads (manifest.json's "format"). */
#define FSDP_CHECKPOINT_FORMAT 1
#define FSDP_CHECKPOINT_ARRAYS_MAX 3
#define FSDP_CHECKPOINT_HOSTS_MAX 4096
/* The bytes of a job's name a checkpoint records (the daemon's are shorter). */
#define FSDP_CHECKPOINT_JOB_MAX 255

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
  const char *job; /* its name, of [A-Za-z0-9._-] */
  uint64_t uid;    /* of the job's trainers, recorded in the manifest */
  /* A load's: only a checkpoint whose manifest names uid (PERMISSION_DENIED for another
   * uid's or one that names none), where the job's trainers could not read the files
   * themselves. */
  bool same_uid_only;
  /* A load's: only a checkpoint of this job (FAILED_PRECONDITION for another job's), where
   * the daemon reads with its own rights (checkpoint.dir/<job>/). Without it the caller's
   * rights guard the files, and a checkpoint of any job loads (a new launch of a trainer
   * has a new run id, and so a new job name). */
  bool own_job_only;
  unsigned host, hosts;   /* this host's rank among the job's hosts */
  uint64_t hosts_wait_ms; /* host 0's wait for the other hosts' files (hosts > 1) */
  uint64_t step;          /* the job's last completed step, which names the checkpoint */
  const char *optimizer; /* its kind ("ADAMW"), "" without one */
  uint64_t write_rate;   /* a save's blocks: bytes per second at most; 0: no cap */
  /* A save's blocks: the share of the time, in percent, their writes take at most (the
   * writer waits after a chunk to keep to it); 0 or 100: back to back. */
  unsigned disk_share;
  /* An enum fsdp_checkpoint_stopping, set by another thread as the daemon stops (NULL:
   * never): a save under way stops pacing at FSDP_CHECKPOINT_HURRY, and a save or a load
   * stops at its next chunk with ABORTED at FSDP_CHECKPOINT_ABANDON, the checkpoints before
   * it as they were. */
  const atomic_int *stopping;
  const fsdp_checkpoint_unit_t *units;
  size_t n_units;
} fsdp_checkpoint_job_t;

/* The bytes of staging memory a snapshot of the units takes (fsdp_checkpoint_stage). */
size_t fsdp_checkpoint_staging_bytes(const fsdp_checkpoint_unit_t *units, size_t n_units);

/* How a buffer of the job's memory (which may be a GPU's) goes to or from staging, which is
 * the host's: 0, or an error that st explains. */
typedef int (*fsdp_checkpoint_copy_fn)(void *ctx, void *dst, const void *src, size_t bytes,
                                       fsdp_status_t *st);

/* Points the units' buffers (masters, optimizer state, step counts) at their places in
 * staging (of fsdp_checkpoint_staging_bytes, 4096-byte aligned: a save writes from it with
 * direct I/O), each copied there first with
 * copy(ctx, ...) unless copy is NULL: a save from the copies then writes what the job held
 * at this moment while the job goes on; a load into places not copied to reads a checkpoint
 * into staging. Returns 0 or copy's error. */
int fsdp_checkpoint_stage(fsdp_checkpoint_unit_t *units, size_t n_units, void *staging,
                          fsdp_checkpoint_copy_fn copy, void *ctx, fsdp_status_t *st);

/* Copies every buffer of staged (units pointed at staging by fsdp_checkpoint_stage) into the
 * same buffer of units (the job's): a load read into staging goes into the job's memory.
 * Returns 0 or copy's error. */
int fsdp_checkpoint_unstage(const fsdp_checkpoint_unit_t *staged,
                            const fsdp_checkpoint_unit_t *units, size_t n_units,
                            fsdp_checkpoint_copy_fn copy, void *ctx, fsdp_status_t *st);

/* Writes this host's part of the job's state into dir/step-<step>/ (dir and its parents are
 * made if missing). Every file operation goes through directory descriptors that follow no
 * symbolic link (common/dirs.h), with the calling thread's rights: a link or anything but a
 * directory or regular file in a checkpoint's place is refused, never followed. The files
 * are written into dir/step-<step>.<job>.partial/, the job's own, and the step directory is
 * made by renaming it; a step directory already there is replaced only once the new one is
 * complete, and only if it is a complete checkpoint of the same job (FAILED_PRECONDITION
 * otherwise: a save never replaces another job's checkpoint, nor what is not one). Host 0
 * then waits (at most hosts_wait_ms) for every other host's files, completes the
 * checkpoint, removes what the job's saves of older steps into dir that died left (they can
 * no longer complete) and all but the newest `keep` complete checkpoints of the job in dir
 * (0: keeps them all; other jobs' are never counted nor removed); another host returns once
 * its own files are written. *ret_path (size bytes): the step directory. Fails with st
 * naming the file and the call: PERMISSION_DENIED where the thread's rights do not reach,
 * RESOURCE_EXHAUSTED for a full disk, UNAVAILABLE for other I/O errors, DEADLINE_EXCEEDED
 * naming the hosts whose files did not come. */
int fsdp_checkpoint_save(const char *dir, const fsdp_checkpoint_job_t *job, unsigned keep,
                         char *ret_path, size_t size, fsdp_status_t *st);

/* Removes what the job's saves into dir that did not finish left there
 * (step-<S>.<job>.partial/, every host's files), so that host 0 does not count a host's
 * files left by a save of the same step that died as that host's part of a new one. By host
 * 0 as a job starts on it: no new save can be under way (the others' saves of a run that
 * went on while host 0's daemon restarted cannot complete without it, and fail). Other
 * jobs' are left; links are removed as links, never followed. */
void fsdp_checkpoint_remove_unfinished(const char *dir, const char *job);

/* The newest complete checkpoint of job under dir (a directory of step directories), of
 * uid's only unless uid is NULL: its step directory into *ret_path (size bytes) and its
 * step, from the manifests alone, which are small (so that the loop may decide on it; the
 * checkpoint is checked whole when it is loaded). NOT_FOUND without one; DATA_LOSS naming a
 * step directory above the newest whose manifest cannot be read, that directory then in
 * *ret_path (a damaged newest checkpoint is never passed over for an older one). */
int fsdp_checkpoint_find(const char *dir, const char *job, const uint64_t *uid, char *ret_path,
                         size_t size, uint64_t *ret_step, fsdp_status_t *st);

/* A checkpoint open for reading: its metadata, and its blocks checked as they are read. */
typedef struct fsdp_checkpoint_reader fsdp_checkpoint_reader_t;

/* Opens the checkpoint at dir (absolute: a step directory, or the newest complete one under
 * it of job's, NULL: of any job's), every file through the step directory's descriptor,
 * following no link and opening nothing but regular files: NOT_FOUND without one;
 * FAILED_PRECONDITION for another format; DATA_LOSS naming the file and the key for
 * metadata that cannot be read, is not of its type (every value is checked) or describes
 * more than its layout and the .bin files hold (every size is checked, overflow included),
 * or a unit whose elements no file holds. */
int fsdp_checkpoint_open(const char *dir, const char *job, fsdp_checkpoint_reader_t **ret,
                         fsdp_status_t *st);
void fsdp_checkpoint_close(fsdp_checkpoint_reader_t *reader); /* NULL-safe */

const char *fsdp_checkpoint_path(const fsdp_checkpoint_reader_t *reader); /* the step dir */
const char *fsdp_checkpoint_job(const fsdp_checkpoint_reader_t *reader);
uint64_t fsdp_checkpoint_step(const fsdp_checkpoint_reader_t *reader);
/* The uid that saved it, as its manifest says; false where it says none (fsdpd < 0.2). */
bool fsdp_checkpoint_uid(const fsdp_checkpoint_reader_t *reader, uint64_t *ret_uid);
unsigned fsdp_checkpoint_hosts(const fsdp_checkpoint_reader_t *reader); /* that saved it */
/* Its units as host 0 saved them: names, parameters, numel and how many optimizer arrays
 * (the shards fields are host 0's); no buffers. Valid while the reader is open. */
const fsdp_checkpoint_unit_t *fsdp_checkpoint_units(const fsdp_checkpoint_reader_t *reader,
                                                    size_t *ret_n);
uint64_t fsdp_checkpoint_optimizer_steps(const fsdp_checkpoint_reader_t *reader, size_t unit);

/* Elements [first, first + n) of unit's flat buffer in block b (0: the masters, then the
 * optimizer's arrays) into dst, from whichever hosts' files hold them (the padding too,
 * where the saved layout has it), elements past the saved padding as zeros; or, with dst
 * NULL, only checked. Each block a read touches is checked whole against its checksum the
 * first time: DATA_LOSS names the file and the byte range that does not match, or where the
 * file ends too soon. */
int fsdp_checkpoint_read_elements(fsdp_checkpoint_reader_t *reader, size_t unit, unsigned b,
                                  uint64_t first, uint64_t n, float *dst, fsdp_status_t *st);

/* What a load read (fsdp_checkpoint_load). */
typedef struct fsdp_checkpoint_loaded {
  char path[PATH_MAX]; /* the step directory */
  uint64_t step;
  char job[FSDP_CHECKPOINT_JOB_MAX + 1]; /* the job that saved it, which may be another */
  bool optimizer_state;                  /* it holds some unit's optimizer state */
  /* Units whose saved optimizer state was left out (the job keeps none for them: a
   * trainer's optimizer, or none), and units whose optimizer state the checkpoint lacks and
   * which start at zero, step 0 (it was saved without the daemon's optimizer). */
  size_t state_left_out, state_zeroed;
} fsdp_checkpoint_loaded_t;

/* Reads the checkpoint at dir into the job's buffers: dir is a step directory (of any job's
 * unless job->own_job_only), or a directory whose newest complete checkpoint of the job's
 * is read, or, without one and unless job->own_job_only, its newest of any job's
 * (ret->job says whose). Each unit's elements this host holds (host_first_shard,
 * host_shards, shard_numel), whatever layout saved them, padding the saved layout lacks
 * zeroed; everything checked first, so that a refusal changes nothing. The optimizer's
 * state loads where both the checkpoint and the job have it; a unit saved with it into a
 * job without (a trainer's optimizer) takes the masters alone, and a unit saved without it
 * into a job with it starts its state at zero and its step count at 0 (ret counts both).
 * Refused: FAILED_PRECONDITION for another format, another job with own_job_only, a unit
 * missing or of another numel, optimizer state of another number of arrays than the job's
 * (another optimizer); DATA_LOSS as fsdp_checkpoint_open's, or naming the file and the byte
 * range that does not match its checksum; PERMISSION_DENIED for another uid's
 * (same_uid_only); ABORTED when the job's stopping reaches FSDP_CHECKPOINT_ABANDON (checked
 * between chunks); NOT_FOUND without a checkpoint there. *ret: what was read. */
int fsdp_checkpoint_load(const char *dir, const fsdp_checkpoint_job_t *job,
                         fsdp_checkpoint_loaded_t *ret, fsdp_status_t *st);

#endif
