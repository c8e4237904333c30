/* Staged rings.
 *
 * Where the backend's memory is not the host's (a GPU's), the rings among hosts move host
 * buffers of the job's staging (daemon/store/staging.h) and the work around them copies to
 * and from the backend's memory, whole regions at once on the work queue, while the rings'
 * hooks that add on the host keep working there. A gather casts its region on the device
 * and copies it out (WORK_GATHER); the all-gather fills the other regions of the staged
 * copy, which WORK_UNSTAGE_GATHER copies in. A PER_PARAM unit's gather is staged on any
 * backend: the all-gather moves the shards as they lie, which its unsharded copy does not
 * (runs.c moves them between the two). A reduce makes the host sum on the device and
 * copies out what the first ring sends (WORK_STAGE_SUM); the rings reduce it on the host
 * (the host's kernels give the device's bits), the deferred sum of HYBRID_SHARD's
 * accumulation staying in host memory throughout; WORK_UNSTAGE_SUM copies this host's
 * region of the result in and writes the gradient shards from it on the device. The
 * additions are the one-host path's, in the same order, so the bits are too. */
#include "daemon/dataplane/internal.h"

void dp_forget_staging(void *arg, const void *base, size_t bytes) {
  fsdp_dataplane_t *dp = arg;
  if (dp->fabric)
    fsdp_fabric_forget_memory(dp->fabric, base, bytes);
}

int dp_take_stage(fsdp_dataplane_t *dp, fsdp_job_t *job, size_t bytes,
                  fsdp_staging_buffer_t **ret, fsdp_status_t *st) {
  return fsdp_staging_take(&job->staging, bytes, dp_forget_staging, dp, ret, st);
}

int dp_stage_host_sum(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                      fsdp_status_t *st) {
  bool whole = u->plan.shard_ring.members > 1;
  uint64_t begin = whole ? 0 : host_first(u);
  uint64_t n = whole ? u->layout.padded_numel : host_numel(u);
  fsdp_dtype_t type = reduce_dtype(u);
  size_t size = fsdp_dtype_size(type);
  float *sum_fp32 = dp_host_sum_fp32(job, u) + begin;
  char *sum = dp_arena_host_sum(job, u) + begin * size;
  /* The reduce's staging buffers get their memory here, off the loop: the sum's, and the
   * deferred sum's, which this reduce's rings or keep_deferred below use first. */
  int r = fsdp_staging_make(&job->staging, u->flight->sum_stage, st);
  if (r == 0 && u->flight->deferred_stage)
    r = fsdp_staging_make(&job->staging, u->flight->deferred_stage, st);
  if (r < 0)
    return r;
  r = dp_reduce_runs(&dp->backend, job, u, sum_fp32, false, 1.0f, begin, begin + n, st);
  if (r == 0 && type != FSDP_DTYPE_FP32)
    r = fsdp_backend_cast(&dp->backend, sum, type, sum_fp32, FSDP_DTYPE_FP32, n, st);
  if (r == 0)
    r = fsdp_backend_copy(&dp->backend, (char *)dp_host_sum(job, u) + begin * size, sum, n * size,
                          st);
  if (r < 0 || whole)
    return r;
  if (u->flight->reduce_defer)
    return dp_keep_deferred(job, u, begin, begin + n);
  return u->flight->has_deferred ? dp_add_deferred(job, u, begin, begin + n) : 0;
}

int dp_unstage_gather(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                      fsdp_status_t *st) {
  char *unsharded = (char *)fsdp_arena_base(job->shared_arena) + u->flight->copy_offset;
  char *staged = u->flight->gather_stage->base;
  uint64_t mine = host_first(u), mine_end = mine + host_numel(u);
  int r = dp_copy_staged(&dp->backend, u, staged, unsharded, 0, mine, false, st);
  return r < 0 ? r
               : dp_copy_staged(&dp->backend, u, staged, unsharded, mine_end,
                                u->layout.padded_numel, false, st);
}

int dp_unstage_sum(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                   fsdp_status_t *st) {
  fsdp_dtype_t type = reduce_dtype(u);
  size_t size = fsdp_dtype_size(type);
  uint64_t first = host_first(u), n = host_numel(u);
  char *sum = dp_arena_host_sum(job, u) + first * size;
  int r = fsdp_backend_copy(&dp->backend, sum, (const char *)dp_host_sum(job, u) + first * size,
                            n * size, st);
  float *grads = (float *)(void *)((char *)fsdp_arena_base(job->arena) + u->grad_offset);
  const void *src = sum;
  return r < 0 ? r
               : fsdp_backend_reduce(&dp->backend, grads, u->flight->reduce_accumulate, &src, 1, type,
                                     type, 1.0f, u->post_scale, n, st);
}
