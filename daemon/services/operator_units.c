/* Operator.ListUnits and DescribeUnit: what the store holds of each unit (its layout,
 * strategy, steps and schedule) and what the data plane is doing with it (its copies, lent
 * gradients and collectives under way), as UnitInfo messages; DescribeUnit adds the unit's
 * shards and parameters. Apart from the other Operator handlers because these two share the
 * building of a UnitInfo and only read the units. */
#include "daemon/services/operator_internal.h"

#include <stdlib.h>
#include <string.h>

#include "fsdp/v1/operator.pb-c.h"

#include "daemon/dataplane/optimizer.h"
#include "daemon/services/calls.h"
#include "daemon/services/context.h"

/* What a UnitInfo points into, per unit: its collectives under way (the gather, the
 * reduce-scatter) with their ranks, and the ranks holding its buffers. */
typedef struct unit_info_storage {
  Fsdp__V1__CollectiveInfo info[2];
  Fsdp__V1__CollectiveInfo *ptrs[2];
  uint32_t ranks[2][FSDP_LOCAL_WORLD_MAX];
  uint32_t copy_holders[FSDP_LOCAL_WORLD_MAX];
  uint32_t gradient_holders[FSDP_LOCAL_WORLD_MAX];
} unit_info_storage_t;

/* The ranks in set, into ranks; returns how many. */
static size_t list_ranks(const fsdp_rank_set_t *set, uint32_t world, uint32_t *ranks) {
  size_t n = 0;
  for (uint32_t r = 0; r < world; r++)
    if (fsdp_rank_set_has(set, r))
      ranks[n++] = r;
  return n;
}

static void fill_collectives(Fsdp__V1__UnitInfo *info, const fsdp_job_t *job,
                             const fsdp_unit_t *u, uint64_t now_ms, unit_info_storage_t *store) {
  const fsdp_collection_t *cs[2] = {&u->flight->gather, &u->flight->reduce};
  static const Fsdp__V1__CollectiveInfo__Kind kinds[2] = {
      FSDP__V1__COLLECTIVE_INFO__KIND__UNSHARD, FSDP__V1__COLLECTIVE_INFO__KIND__REDUCE_SCATTER};
  info->n_collectives = 0;
  info->collectives = store->ptrs;
  for (size_t k = 0; k < 2; k++) {
    const fsdp_collection_t *c = cs[k];
    if (c->count == 0 && !c->running)
      continue;
    Fsdp__V1__CollectiveInfo *ci = &store->info[info->n_collectives];
    fsdp__v1__collective_info__init(ci);
    ci->kind = kinds[k];
    ci->step = c->step;
    ci->running = c->running;
    ci->ranks = store->ranks[info->n_collectives];
    ci->n_ranks = list_ranks(&c->submitted, job->local_world_size, ci->ranks);
    if (!c->running)
      ci->deadline_in_ms = (int64_t)c->deadline_ms - (int64_t)now_ms;
    store->ptrs[info->n_collectives++] = ci;
  }
}

static Fsdp__V1__UnitInfo__Copy copy_kind(const fsdp_unit_t *u) {
  if (!u->flight->gathered)
    return FSDP__V1__UNIT_INFO__COPY__COPY_NONE;
  if (u->copy_in_masters)
    return FSDP__V1__UNIT_INFO__COPY__COPY_MASTERS;
  return u->flight->copy_pooled ? FSDP__V1__UNIT_INFO__COPY__COPY_POOL
                        : FSDP__V1__UNIT_INFO__COPY__COPY_OWN;
}

static void fill_unit_info(Fsdp__V1__UnitInfo *info, const fsdp_job_t *job, const fsdp_unit_t *u,
                           uint64_t now_ms, unit_info_storage_t *store) {
  fsdp__v1__unit_info__init(info);
  info->job = (char *)job->name;
  info->unit = u->spec->unit;
  info->strategy = (Fsdp__V1__ShardingStrategy)u->spec->strategy;
  info->dtype = (Fsdp__V1__DType)u->spec->params[0].dtype;
  info->param_dtype = (Fsdp__V1__DType)fsdp_unit_spec_param_dtype(u->spec);
  info->reduce_dtype = (Fsdp__V1__DType)fsdp_unit_spec_reduce_dtype(u->spec);
  info->numel = u->layout.numel;
  info->padded_numel = u->layout.padded_numel;
  info->shard_numel = u->layout.shard_numel;
  info->shards = u->layout.shards;
  info->params = (uint32_t)u->layout.n_params;
  info->local_world_size = job->local_world_size;
  info->registered_ranks = u->n_registered;
  info->gathered_step = u->flight->gathered ? u->flight->gathered_step : 0;
  info->reduced_step = u->flight->reduced_step;
  info->reshard_after_forward = u->flight->reshard_after_forward;
  info->forward_index = u->flight->order_index;
  info->deferred_reduces = u->flight->n_deferred;
  info->reduces = u->flight->reduces;
  info->layout = (Fsdp__V1__UnitLayout)u->spec->layout;
  info->replica_all_reduces = u->flight->replica_all_reduces;
  info->optimizer_steps = fsdp_optimizer_unit_steps(job, u);
  info->last_gather_us = u->flight->last_gather_us;
  info->last_reduce_us = u->flight->last_reduce_us;
  info->copy = copy_kind(u);
  info->copy_holders = store->copy_holders;
  info->n_copy_holders = list_ranks(&u->flight->holders, job->local_world_size, store->copy_holders);
  info->gradient_holders = store->gradient_holders;
  info->n_gradient_holders =
      list_ranks(&u->flight->grads_lent, job->local_world_size, store->gradient_holders);
  fill_collectives(info, job, u, now_ms, store);
}

void fsdp_operator_list_units(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                              void *data) {
  const Fsdp__V1__ListUnitsRequest *rq = (const void *)request;
  fsdp_services_context_t *ctx = data;
  if (rq->job[0] && !fsdp_store_find_job(ctx->store, rq->job)) {
    fsdp_rpc_call_fail(call, FSDP_E_NOT_FOUND, "%s: no job '%s' holds units",
                       fsdp_rpc_call_method(call), rq->job);
    return;
  }
  size_t n = 0;
  for (const fsdp_job_t *j = ctx->store->jobs; j; j = j->next)
    n += j->n_units;
  Fsdp__V1__UnitInfo *infos = calloc(n ? n : 1, sizeof *infos);
  Fsdp__V1__UnitInfo **ptrs = calloc(n ? n : 1, sizeof *ptrs);
  unit_info_storage_t *storage = calloc(n ? n : 1, sizeof *storage);
  uint64_t now = fsdp_services_now_ms(ctx);
  if (!infos || !ptrs || !storage) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "out of memory listing units");
    goto out;
  }
  size_t k = 0;
  for (const fsdp_job_t *j = ctx->store->jobs; j; j = j->next) {
    if (rq->job[0] && strcmp(rq->job, j->name) != 0)
      continue;
    for (const fsdp_unit_t *u = j->units; u; u = u->next, k++) {
      fill_unit_info(&infos[k], j, u, now, &storage[k]);
      ptrs[k] = &infos[k];
    }
  }
  Fsdp__V1__ListUnitsReply reply = FSDP__V1__LIST_UNITS_REPLY__INIT;
  reply.n_units = k;
  reply.units = ptrs;
  fsdp_rpc_call_reply(call, &reply.base);
out:
  free(infos);
  free(ptrs);
  free(storage);
}

/* The unit a DescribeUnit names; with no job, the only job that has it. */
static const fsdp_unit_t *find_described_unit(const fsdp_store_t *store,
                                              const Fsdp__V1__DescribeUnitRequest *rq,
                                              const fsdp_job_t **ret_job, fsdp_status_t *st) {
  const fsdp_unit_t *found = NULL;
  unsigned matches = 0;
  for (const fsdp_job_t *j = store->jobs; j; j = j->next) {
    if (rq->job[0] && strcmp(rq->job, j->name) != 0)
      continue;
    for (const fsdp_unit_t *u = j->units; u; u = u->next) {
      if (strcmp(u->spec->unit, rq->unit) == 0) {
        found = u;
        *ret_job = j;
        matches++;
      }
    }
  }
  if (matches == 1)
    return found;
  if (matches > 1)
    fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                    "unit '%s' exists in %u jobs; name the job (field 'job')", rq->unit, matches);
  else if (rq->job[0])
    fsdp_status_set(st, FSDP_E_NOT_FOUND, "job '%s' has no unit '%s'", rq->job, rq->unit);
  else
    fsdp_status_set(st, FSDP_E_NOT_FOUND, "no job has a unit '%s'", rq->unit);
  return NULL;
}

/* DescribeUnit's shards: where each is held, which elements of the shards' space it holds,
 * and how many of them are padding (FLAT's past the unit's end, PER_PARAM's in each piece
 * and at the shard's end). */
static void fill_shard_infos(const fsdp_unit_t *u, Fsdp__V1__ShardInfo *shards,
                             Fsdp__V1__ShardInfo **shard_ptrs) {
  const fsdp_unit_layout_t *l = &u->layout;
  for (unsigned s = 0; s < l->shards; s++) {
    fsdp__v1__shard_info__init(&shards[s]);
    shards[s].shard = s;
    /* A shard group's hosts hold consecutive regions of local_shards shards each. */
    const fsdp_unit_plan_t *p = &u->plan;
    shards[s].host_rank = fsdp_host_ring_host(&p->shard_ring, s / p->local_shards);
    shards[s].local_rank = s % p->local_shards;
    fsdp_unit_layout_shard_range(l, s, &shards[s].begin, &shards[s].end);
    uint64_t held = 0;
    for (size_t k = 0; k < l->n_params; k++) {
      uint64_t begin, end, at;
      fsdp_unit_layout_param_in_shard(l, k, s, &begin, &end, &at);
      held += end - begin;
    }
    shards[s].padding = l->shard_numel - held;
    shard_ptrs[s] = &shards[s];
  }
}

/* DescribeUnit's parameters: each one's shape and where it lies in the flat buffer. */
static void fill_param_infos(const fsdp_unit_t *u, Fsdp__V1__ParamInfo *params,
                             Fsdp__V1__ParamInfo **param_ptrs) {
  const fsdp_unit_layout_t *l = &u->layout;
  for (size_t i = 0; i < l->n_params; i++) {
    const fsdp_param_spec_t *p = &u->spec->params[i];
    fsdp__v1__param_info__init(&params[i]);
    params[i].name = p->name;
    params[i].n_shape = p->n_shape;
    params[i].shape = p->shape;
    params[i].offset = l->offsets[i];
    params[i].numel = l->numels[i];
    params[i].requires_grad = p->requires_grad;
    param_ptrs[i] = &params[i];
  }
}

void fsdp_operator_describe_unit(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                                 void *data) {
  const Fsdp__V1__DescribeUnitRequest *rq = (const void *)request;
  fsdp_services_context_t *ctx = data;
  const fsdp_job_t *job = NULL;
  fsdp_status_t st;
  const fsdp_unit_t *u = find_described_unit(ctx->store, rq, &job, &st);
  if (!u) {
    fsdp_services_fail_call(call, &st);
    return;
  }
  const fsdp_unit_layout_t *l = &u->layout;
  Fsdp__V1__ShardInfo *shards = calloc(l->shards, sizeof *shards);
  Fsdp__V1__ShardInfo **shard_ptrs = calloc(l->shards, sizeof *shard_ptrs);
  Fsdp__V1__ParamInfo *params = calloc(l->n_params, sizeof *params);
  Fsdp__V1__ParamInfo **param_ptrs = calloc(l->n_params, sizeof *param_ptrs);
  unit_info_storage_t *storage = malloc(sizeof *storage);
  if (!shards || !shard_ptrs || !params || !param_ptrs || !storage) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "out of memory describing a unit");
    goto out;
  }
  fill_shard_infos(u, shards, shard_ptrs);
  fill_param_infos(u, params, param_ptrs);
  Fsdp__V1__UnitInfo info;
  fill_unit_info(&info, job, u, fsdp_services_now_ms(ctx), storage);
  Fsdp__V1__DescribeUnitReply reply = FSDP__V1__DESCRIBE_UNIT_REPLY__INIT;
  reply.unit = &info;
  reply.n_shards = l->shards;
  reply.shards = shard_ptrs;
  reply.n_params = l->n_params;
  reply.params = param_ptrs;
  fsdp_rpc_call_reply(call, &reply.base);
out:
  free(storage);
  free(shards);
  free(shard_ptrs);
  free(params);
  free(param_ptrs);
}
