/* What the checkpoint library's files share (checkpoint.h is the contract): the names in a
 * checkpoint's directory, a unit's blocks, the I/O errors as statuses, and the complete
 * checkpoints a directory holds. Internal to checkpoint/. */
#ifndef FSDP_CHECKPOINT_FILES_H
#define FSDP_CHECKPOINT_FILES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "checkpoint/checkpoint.h"

struct json_object;

#define MANIFEST "manifest.json"
#define IO_CHUNK ((size_t)4 << 20)
/* The alignment of direct I/O's buffers, file offsets and lengths (a page, the most any
 * block device asks), and so of staging's buffers, which saves write from. */
#define DIRECT_ALIGN ((size_t)4096)

/* Host h's files: "host-<h>.bin", "host-<h>.json". */
void host_file(char *buf, size_t size, unsigned host, const char *ext);

/* err (an errno) as st's status: ABORTED for ECANCELED (the daemon's stop),
 * PERMISSION_DENIED where the thread's rights do not reach, FAILED_PRECONDITION for a link
 * or a file of the wrong type on the way (common/dirs.h), RESOURCE_EXHAUSTED for a full
 * disk, UNAVAILABLE otherwise; the message names what and path. Returns the code. */
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

/* The bytes a checkpoint's JSON file may hold: a manifest, or a host's metadata (each unit's
 * layout and its parameters' names and shapes, a few hundred bytes a parameter). */
#define MANIFEST_MAX ((size_t)1 << 20)
#define HOST_META_MAX ((size_t)256 << 20)
/* How deep a checkpoint's JSON nests at most (host files: 5). */
#define JSON_DEPTH_MAX 8

/* The JSON file name under dirfd (dir_path names dirfd in messages), at most max bytes and
 * JSON_DEPTH_MAX deep, read without following a link or opening anything but a regular file:
 * NULL with DATA_LOSS naming the file when it cannot be read or parsed (NOT_FOUND where it
 * is missing, if missing_ok: *ret_code says which). */
struct json_object *read_json_at(int dirfd, const char *dir_path, const char *name, size_t max,
                                 fsdp_status_t *st, int *ret_code);

/* A JSON object's member key when it is of the type asked, else NULL / false. */
struct json_object *json_array_at(struct json_object *o, const char *key);
const char *json_string_at(struct json_object *o, const char *key);
/* A non-negative integer (up to 2^64 - 2: json-c reads larger ones as 2^64 - 1). */
bool json_u64_at(struct json_object *o, const char *key, uint64_t *ret);

/* What manifest.json says, every field checked for its type. */
typedef struct manifest {
  uint64_t format;
  char job[FSDP_CHECKPOINT_JOB_MAX + 1];
  uint64_t step, hosts;
  bool has_uid; /* an fsdpd before 0.2 wrote none */
  uint64_t uid; /* the uid of the job's trainers that saved it (host 0's) */
} manifest_t;

/* The manifest of the step directory open at step_fd (step_path names it in messages):
 * DATA_LOSS naming the file and the key that is missing or of the wrong type; NOT_FOUND
 * when there is none (not a complete checkpoint). Returns 0 or the code. */
int read_manifest(int step_fd, const char *step_path, manifest_t *ret, fsdp_status_t *st);

/* "step-<S>" with S in decimal digits only, as the step directories are named; the step. */
bool parse_step_name(const char *name, const char *suffix, uint64_t *ret_step);

/* The steps of the complete checkpoints of job and uid in the directory open at dirfd
 * (step-<S>/, a directory and no link, with a manifest of step S naming both), in *ret (any
 * order; free it; NULL with none); how many. 0 too for want of memory. */
size_t complete_steps_of(int dirfd, const char *job, uint64_t uid, uint64_t **ret);

/* The highest step of the complete checkpoints of job's (NULL: any job's) in the directory
 * open at dirfd in *ret; false when there is none. */
bool newest_step(int dirfd, const char *job, uint64_t *ret);

/* For qsort: steps from the highest down. */
int steps_descending(const void *a, const void *b);

#endif
