/* The rendezvous of a job's local ranks, and their host sum. */
#include "collectives/local.h"

fsdp_collection_outcome_t fsdp_collection_join(fsdp_collection_t *c, uint32_t world,
                                               const fsdp_collection_request_t *rq,
                                               const fsdp_rank_set_t *gone) {
  for (uint32_t r = 0; r < world; r++)
    if (fsdp_rank_set_has(gone, r))
      return FSDP_COLLECTION_RANKS_GONE;
  if (c->count == 0) {
    c->step = rq->step;
    c->regather = rq->regather;
    c->generation = rq->generation;
    c->deadline_ms = rq->deadline_ms;
    c->first_ms = rq->now_ms;
  } else if (rq->generation != c->generation) {
    return FSDP_COLLECTION_OTHER_GENERATION;
  } else if (rq->step != c->step || rq->regather != c->regather) {
    return FSDP_COLLECTION_OTHER_STEP;
  }
  fsdp_rank_set_put(&c->submitted, rq->rank, true);
  c->count++;
  if (c->count < world)
    return FSDP_COLLECTION_JOINED;
  c->running = true;
  return FSDP_COLLECTION_COMPLETE;
}

void fsdp_collection_withdraw(fsdp_collection_t *c, uint32_t rank) {
  if (!c->running && fsdp_rank_set_put(&c->submitted, rank, false))
    c->count--;
}

bool fsdp_collection_is_collecting(const fsdp_collection_t *c) {
  return c->count > 0 && !c->running;
}

bool fsdp_collection_expired(const fsdp_collection_t *c, uint32_t world, uint64_t now_ms,
                             fsdp_rank_set_t *ret_missing) {
  if (!fsdp_collection_is_collecting(c) || now_ms < c->deadline_ms)
    return false;
  fsdp_rank_set_t missing = {0};
  for (uint32_t r = 0; r < world; r++)
    if (!fsdp_rank_set_has(&c->submitted, r))
      fsdp_rank_set_put(&missing, r, true);
  *ret_missing = missing;
  return true;
}

void fsdp_collection_reset(fsdp_collection_t *c) {
  *c = (fsdp_collection_t){0};
}

int fsdp_host_sum_range(void *sum, float *sum_fp32, const void *const *srcs, unsigned n_srcs,
                        fsdp_dtype_t src_type, fsdp_dtype_t reduce_type, float pre_scale,
                        size_t begin, size_t end) {
  int r = fsdp_reduce_range(sum_fp32, false, srcs, n_srcs, src_type, reduce_type, pre_scale,
                            1.0f, begin, end);
  if (r == 0 && reduce_type != FSDP_DTYPE_FP32)
    r = fsdp_cast((char *)sum + begin * fsdp_dtype_size(reduce_type), reduce_type,
                  sum_fp32 + begin, FSDP_DTYPE_FP32, end - begin);
  return r;
}
