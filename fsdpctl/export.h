/* fsdpctl export: a checkpoint's parameters (checkpoint/checkpoint.h) as one safetensors
 * file, from the checkpoint's files alone: no daemon, no trainer.
 *
 * Every original parameter under the name its unit registered it with, its shape, in dtype
 * (the masters' fp32, or rounded to bf16 or fp16 to nearest even, as the daemon's casts
 * round), in the checkpoint's order of units and parameters, each tensor's shape the one its
 * data has. Written a chunk at a time, whatever the checkpoint's size, each block checked
 * against its checksum as it is read. The file appears complete or not at all: written to a
 * new file of an unpredictable name beside it (O_EXCL|O_NOFOLLOW: never through a link
 * planted there), fsynced and renamed over out (a link at out is replaced, not followed). */
#ifndef FSDP_FSDPCTL_EXPORT_H
#define FSDP_FSDPCTL_EXPORT_H

#include "common/status.h"
#include "kernels/dtype.h"

/* dir: a step directory or a directory of them (the newest complete one is taken); a
 * checkpoint that does not hold together is refused as fsdp_checkpoint_open refuses it. */
int fsdp_export_safetensors(const char *dir, const char *out, fsdp_dtype_t dtype,
                            fsdp_status_t *st);

#endif
