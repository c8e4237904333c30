/* What a unit's layout changes in the data plane's work: the moves between the shards'
 * space (masters, gradient shards, host sums, a staged copy) and the unsharded buffers (the
 * copy the ranks read, the full gradients they write), run by run (fsdp_unit_runs_next,
 * daemon/store/unit_layout.h). For FLAT the two spaces are one and each move is the one
 * call it always was; PER_PARAM's runs are each parameter's piece of each shard, and its
 * padding, which nothing reads, stays zero in the gradient shards and the host sums. On a
 * pool thread. */
#include "daemon/dataplane/internal.h"

#include <string.h>

#include "collectives/local.h"

/* The local ranks' full gradients from element `at` of the unsharded buffer on. */
static void grads_at(const fsdp_unit_t *u, const void *const srcs[], unsigned world,
                     uint64_t at, const void *ret[FSDP_LOCAL_WORLD_MAX]) {
  size_t size = fsdp_dtype_size(param_dtype(u));
  for (unsigned r = 0; r < world; r++)
    ret[r] = (const char *)srcs[r] + at * size;
}

int dp_cast_masters(const fsdp_backend_t *b, const fsdp_job_t *job, const fsdp_unit_t *u,
                    void *unsharded, fsdp_status_t *st) {
  const float *masters =
      (const float *)(const void *)((const char *)fsdp_arena_base(job->arena) + u->master_offset);
  fsdp_dtype_t type = param_dtype(u);
  size_t size = fsdp_dtype_size(type);
  uint64_t first = host_first(u);
  fsdp_unit_runs_t it = fsdp_unit_runs(&u->layout, first, first + host_numel(u));
  for (fsdp_unit_run_t run; fsdp_unit_runs_next(&it, &run);) {
    if (run.padding)
      continue;
    int r = fsdp_backend_cast(b, (char *)unsharded + run.unsharded_at * size, type,
                              masters + (run.shard_at - first), FSDP_DTYPE_FP32, run.numel, st);
    if (r < 0)
      return r;
  }
  return 0;
}

int dp_copy_staged(const fsdp_backend_t *b, const fsdp_unit_t *u, char *stage, char *unsharded,
                   uint64_t begin, uint64_t end, bool to_stage, fsdp_status_t *st) {
  size_t size = fsdp_dtype_size(param_dtype(u));
  fsdp_unit_runs_t it = fsdp_unit_runs(&u->layout, begin, end);
  for (fsdp_unit_run_t run; fsdp_unit_runs_next(&it, &run);) {
    if (run.padding)
      continue;
    char *staged = stage + run.shard_at * size, *copy = unsharded + run.unsharded_at * size;
    int r = fsdp_backend_copy(b, to_stage ? staged : copy, to_stage ? copy : staged,
                              run.numel * size, st);
    if (r < 0)
      return r;
  }
  return 0;
}

int dp_reduce_runs(const fsdp_backend_t *b, const fsdp_job_t *job, const fsdp_unit_t *u,
                   float *dst, bool accumulate, float post_scale, uint64_t begin, uint64_t end,
                   fsdp_status_t *st) {
  const void *srcs[FSDP_LOCAL_WORLD_MAX], *from[FSDP_LOCAL_WORLD_MAX];
  unsigned world = job->local_world_size;
  dp_full_grads(job, u, srcs);
  fsdp_unit_runs_t it = fsdp_unit_runs(&u->layout, begin, end);
  for (fsdp_unit_run_t run; fsdp_unit_runs_next(&it, &run);) {
    float *out = dst + (run.shard_at - begin);
    int r;
    if (run.padding) {
      r = accumulate ? 0 : fsdp_backend_zero(b, out, run.numel * sizeof *out, st);
    } else {
      grads_at(u, srcs, world, run.unsharded_at, from);
      r = fsdp_backend_reduce(b, out, accumulate, from, world, param_dtype(u), reduce_dtype(u),
                              u->pre_scale, post_scale, run.numel, st);
    }
    if (r < 0)
      return r;
  }
  return 0;
}

int dp_host_sum_runs(const fsdp_job_t *job, const fsdp_unit_t *u, uint64_t begin,
                     uint64_t end) {
  const void *srcs[FSDP_LOCAL_WORLD_MAX], *from[FSDP_LOCAL_WORLD_MAX];
  unsigned world = job->local_world_size;
  dp_full_grads(job, u, srcs);
  fsdp_dtype_t type = reduce_dtype(u);
  size_t size = fsdp_dtype_size(type);
  char *sum = dp_host_sum(job, u);
  float *sum_fp32 = dp_host_sum_fp32(job, u);
  fsdp_unit_runs_t it = fsdp_unit_runs(&u->layout, begin, end);
  for (fsdp_unit_run_t run; fsdp_unit_runs_next(&it, &run);) {
    if (run.padding) {
      memset(sum_fp32 + run.shard_at, 0, run.numel * sizeof *sum_fp32);
      if (type != FSDP_DTYPE_FP32)
        memset(sum + run.shard_at * size, 0, run.numel * size);
      continue;
    }
    grads_at(u, srcs, world, run.unsharded_at, from);
    int r = fsdp_host_sum_range(sum + run.shard_at * size, sum_fp32 + run.shard_at, from, world,
                                param_dtype(u), type, u->pre_scale, 0, run.numel);
    if (r < 0)
      return r;
  }
  return 0;
}
