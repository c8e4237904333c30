/* A unit's buffers and what the data plane lends from them: the persistent masters and
 * gradient shards, the unsharded copy and the full-gradient buffers the ranks hold, and
 * the host sums (with HYBRID_SHARD's deferred sum) that reduces across hosts borrow. */
#include "daemon/dataplane/internal.h"

#include <stddef.h>

#include "collectives/local.h"

static void on_grad_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st);

void fsdp_dataplane_buffers(const fsdp_unit_t *u, uint32_t rank,
                            fsdp_dataplane_buffers_t *ret_buffers) {
  *ret_buffers = (fsdp_dataplane_buffers_t){
      .master_offset = u->master_offset,
      .grad_offset = u->grad_offset,
      .shard = u->plan.first_shard + (u->plan.local_shards == 1 ? 0 : rank),
      .replica = fsdp_unit_plan_replica(&u->plan, rank),
      .host_first_shard = u->plan.first_shard,
      .host_shards = u->plan.local_shards,
      .gathered_step = u->flight->gathered_step,
      .reduced_step = u->flight->reduced_step,
  };
}

void dp_drop_deferred(fsdp_job_t *job, fsdp_unit_t *u) {
  if (!u->flight->has_deferred)
    return;
  u->flight->has_deferred = false;
  u->flight->n_deferred = 0;
  if (u->flight->deferred_stage) {
    fsdp_staging_give(u->flight->deferred_stage);
    u->flight->deferred_stage = NULL;
  } else {
    fsdp_arena_release(job->arena, u->flight->deferred_offset);
  }
}

void dp_give_back_sum(fsdp_job_t *job, fsdp_unit_t *u) {
  fsdp_staging_give(u->flight->sum_stage);
  u->flight->sum_stage = NULL;
  if (!u->flight->has_sum)
    return;
  u->flight->has_sum = false;
  fsdp_pool_give(&job->sums, u->flight->sum_offset);
}

void dp_give_back_gather_stage(fsdp_unit_t *u) {
  fsdp_staging_give(u->flight->gather_stage);
  u->flight->gather_stage = NULL;
}

static size_t host_sum_fp32_bytes(const fsdp_unit_t *u) {
  return round64((size_t)u->layout.padded_numel * 4);
}

size_t dp_host_sum_bytes(const fsdp_unit_t *u) {
  size_t reduce_size = fsdp_dtype_size(reduce_dtype(u));
  return host_sum_fp32_bytes(u) +
         (reduce_size == 4 ? 0 : round64((size_t)u->layout.padded_numel * reduce_size));
}

float *dp_host_sum_fp32(const fsdp_job_t *job, const fsdp_unit_t *u) {
  return (float *)(void *)((char *)fsdp_arena_base(job->arena) + u->flight->sum_offset);
}

char *dp_arena_host_sum(const fsdp_job_t *job, const fsdp_unit_t *u) {
  bool fp32 = reduce_dtype(u) == FSDP_DTYPE_FP32;
  return (char *)dp_host_sum_fp32(job, u) + (fp32 ? 0 : host_sum_fp32_bytes(u));
}

void *dp_host_sum(const fsdp_job_t *job, const fsdp_unit_t *u) {
  return u->flight->sum_stage ? u->flight->sum_stage->base : dp_arena_host_sum(job, u);
}

void dp_full_grads(const fsdp_job_t *job, const fsdp_unit_t *u,
                   const void *srcs[FSDP_LOCAL_WORLD_MAX]) {
  const char *base = fsdp_arena_base(job->arena);
  for (unsigned r = 0; r < job->local_world_size; r++)
    srcs[r] = base + u->flight->full_grad_offsets[r];
}

/* HYBRID_SHARD's deferred sum (fsdp_unit_t says when): this host's region in reduce_dtype. */
static char *deferred_sum(const fsdp_job_t *job, const fsdp_unit_t *u) {
  return u->flight->deferred_stage ? u->flight->deferred_stage->base
                           : (char *)fsdp_arena_base(job->arena) + u->flight->deferred_offset;
}

int dp_keep_deferred(const fsdp_job_t *job, const fsdp_unit_t *u, uint64_t begin,
                     uint64_t end) {
  fsdp_dtype_t type = reduce_dtype(u);
  size_t size = fsdp_dtype_size(type);
  char *kept = deferred_sum(job, u) + (begin - host_first(u)) * size;
  const char *sum = (const char *)dp_host_sum(job, u) + begin * size;
  return u->flight->n_deferred == 0 ? fsdp_cast(kept, type, sum, type, end - begin)
                            : fsdp_add(kept, sum, type, end - begin);
}

int dp_add_deferred(const fsdp_job_t *job, const fsdp_unit_t *u, uint64_t begin,
                    uint64_t end) {
  fsdp_dtype_t type = reduce_dtype(u);
  size_t size = fsdp_dtype_size(type);
  return fsdp_add((char *)dp_host_sum(job, u) + begin * size,
                  deferred_sum(job, u) + (begin - host_first(u)) * size, type, end - begin);
}

int dp_allocate(fsdp_job_t *job, fsdp_unit_t *u, fsdp_status_t *st) {
  size_t padded = (size_t)u->layout.padded_numel;
  size_t host_fp32 = round64((size_t)host_numel(u) * 4);
  fsdp_arena_stats_t stats;
  fsdp_arena_get_stats(job->arena, &stats);
  uint64_t base;
  int r = fsdp_arena_alloc(job->arena, 2 * host_fp32, stats.page_size, &base, st);
  if (r < 0)
    return r;
  u->buffers_offset = u->master_offset = base;
  u->grad_offset = u->master_offset + host_fp32;
  u->copy_in_masters = param_dtype(u) == FSDP_DTYPE_FP32 && host_numel(u) == padded &&
                       fsdp_unit_layout_is_flat(&u->layout);
  return 0;
}

void dp_give_back_copy(fsdp_job_t *job, fsdp_unit_t *u) {
  if (!u->flight->has_copy)
    return;
  u->flight->has_copy = false;
  u->flight->gathered = false;
  if (u->flight->copy_pooled)
    fsdp_pool_give(&job->copies, u->flight->copy_offset);
  else
    fsdp_arena_release(job->shared_arena, u->flight->copy_offset);
}

void dp_let_go(fsdp_job_t *job, fsdp_unit_t *u, uint32_t rank) {
  if (fsdp_rank_set_put(&u->flight->holders, rank, false) && fsdp_rank_set_empty(&u->flight->holders))
    dp_give_back_copy(job, u);
}

int dp_alloc_pages(fsdp_arena_t *arena, size_t bytes, uint64_t *ret_offset,
                   fsdp_status_t *st) {
  fsdp_arena_stats_t stats;
  fsdp_arena_get_stats(arena, &stats);
  return fsdp_arena_alloc(arena, bytes, stats.page_size, ret_offset, st);
}

void dp_give_back_grads(fsdp_job_t *job, fsdp_unit_t *u, const fsdp_rank_set_t *ranks) {
  for (uint32_t r = 0; r < job->local_world_size; r++) {
    if (!fsdp_rank_set_has(ranks, r) || !fsdp_rank_set_put(&u->flight->grads_lent, r, false))
      continue;
    if (u->flight->grads_pooled)
      fsdp_pool_give(&job->grad_pools[r], u->flight->full_grad_offsets[r]);
    else
      fsdp_arena_release(job->arena, u->flight->full_grad_offsets[r]);
  }
}

/* Answers an Unshard whose rank now holds the copy, with what it lends. */
static void answer_unshard(fsdp_unit_t *u, fsdp_dataplane_op_t *op) {
  uint32_t rank = op->who.local_rank;
  op->lent.unsharded_in_masters = u->copy_in_masters;
  op->lent.unsharded_offset = u->copy_in_masters ? u->master_offset : u->flight->copy_offset;
  if (fsdp_rank_set_has(&u->flight->grads_lent, rank)) {
    op->lent.full_grad_offset = u->flight->full_grad_offsets[rank];
    op->lent.full_grad_bytes = copy_bytes(u);
  }
  dp_op_ok(op);
}

void dp_lend(fsdp_job_t *job, fsdp_unit_t *u, fsdp_dataplane_op_t *op) {
  uint32_t rank = op->who.local_rank;
  fsdp_rank_set_put(&u->flight->holders, rank, true);
  if (!op->backward || fsdp_rank_set_has(&u->flight->grads_lent, rank)) {
    answer_unshard(u, op);
    return;
  }
  if (fsdp_rank_set_empty(&u->flight->grads_lent))
    u->flight->grads_pooled = u->flight->reshard_after_forward;
  uint64_t offset = 0;
  fsdp_status_t st = FSDP_STATUS_INIT;
  int r;
  if (u->flight->grads_pooled) {
    r = fsdp_pool_take(&job->grad_pools[rank], copy_bytes(u), &op->grad_waiter, on_grad_ready,
                       &offset, &st);
    if (r == 1)
      return; /* on_grad_ready answers it */
  } else {
    r = dp_alloc_pages(job->arena, copy_bytes(u), &offset, &st);
  }
  on_grad_ready(&op->grad_waiter, r == 0 ? offset : 0, &st);
}

static void on_grad_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st) {
  fsdp_dataplane_op_t *op = (fsdp_dataplane_op_t *)((char *)waiter -
                                                    offsetof(fsdp_dataplane_op_t, grad_waiter));
  fsdp_unit_t *u = op->unit;
  if (st->code < 0) {
    dp_op_fail(op, st->code, "unit '%s' step %llu: no full-gradient buffer for local rank %u: %s",
               u->spec->unit, (unsigned long long)u->flight->gathered_step, op->who.local_rank,
               st->message);
    return;
  }
  u->flight->full_grad_offsets[op->who.local_rank] = offset;
  fsdp_rank_set_put(&u->flight->grads_lent, op->who.local_rank, true);
  answer_unshard(u, op);
}
