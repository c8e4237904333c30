/* The Trainer service's handlers: a session's attach, lease and detach, its units and their
 * operations, its job's schedule and optimizer. A unit operation that waits in the data plane
 * (RegisterUnit, Unshard, ReduceScatter, AllReduce) is parked here, keeping its session
 * alive, and answered from the data plane's callback. */
#include "daemon/services/trainer_service.h"

#include <stdlib.h>

#include "fsdp/v1/trainer.pb-c.h"

#include <fsdp/fsdp_version.h>

#include "common/log.h"
#include "daemon/dataplane/optimizer.h"
#include "daemon/services/calls.h"
#include "daemon/services/unit_ops.h"
#include "daemon/services/unit_spec.h"

/* Refuses a peer speaking another protocol version; returns false after failing the call. */
static bool protocol_ok(fsdp_rpc_call_t *call, uint32_t version, const char *who) {
  if (version == FSDP_PROTOCOL_VERSION)
    return true;
  fsdp_rpc_call_fail(call, FSDP_E_PROTOCOL_VERSION,
                     "%s: protocol_version %u from the %s, but this fsdpd %s speaks protocol %u",
                     fsdp_rpc_call_method(call), version, who, FSDP_VERSION_STRING,
                     FSDP_PROTOCOL_VERSION);
  return false;
}

static uint64_t lease_ms(fsdp_services_context_t *ctx) {
  return (uint64_t)fsdp_config_number(ctx->config, FSDP_OPTION_SESSION_LEASE);
}

static void trainer_attach(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  fsdp_services_context_t *ctx = data;
  const Fsdp__V1__AttachRequest *rq = (const void *)request;
  if (!protocol_ok(call, rq->protocol_version, "trainer"))
    return;
  /* A job's units outlive its sessions, and their layout depends on the local world size. */
  const fsdp_job_t *job = fsdp_store_find_job(ctx->store, rq->job);
  if (job && job->local_world_size != rq->local_world_size) {
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION,
                       "%s: job '%s' holds units laid out for local_world_size %u, not %u",
                       fsdp_rpc_call_method(call), job->name, job->local_world_size,
                       rq->local_world_size);
    return;
  }
  /* What torchrun believes must be what the daemons run: ranks would otherwise wait for
   * peers that never come, or train on another shard than they think. */
  const fsdp_topology_t *t = &ctx->store->topology;
  if (rq->launcher && (rq->launcher->world_size != t->hosts * rq->local_world_size ||
                       rq->launcher->node_rank != t->host_rank)) {
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION,
                       "%s: the launcher's topology (world_size %u, node_rank %u, "
                       "local_world_size %u) is not this daemon's (%u host%s x %u local "
                       "ranks = world_size %u, this host's rank %u in cluster.hosts): start "
                       "the daemons and the launcher with the same nodes",
                       fsdp_rpc_call_method(call), rq->launcher->world_size,
                       rq->launcher->node_rank, rq->local_world_size, t->hosts,
                       t->hosts == 1 ? "" : "s", rq->local_world_size,
                       t->hosts * rq->local_world_size, t->host_rank);
    return;
  }
  fsdp_credentials_t cred;
  fsdp_session_t *s;
  fsdp_status_t st;
  if (fsdp_sessions_attach(ctx->sessions, rq, fsdp_services_caller(ctx, call, &cred),
                           job ? &job->owner : NULL, fsdp_services_now_ms(ctx),
                           (unsigned)fsdp_config_number(ctx->config, FSDP_OPTION_MAX_SESSIONS),
                           &s, &st) < 0) {
    fsdp_services_fail_call(call, &st);
    return;
  }
  log_info("session %016llx attached: job '%s' local rank %u of %u, generation %llu, pid %d, "
           "uid %u",
           (unsigned long long)s->id, s->job, s->local_rank, s->local_world_size,
           (unsigned long long)s->generation, (int)s->pid, (unsigned)s->owner.uid);
  Fsdp__V1__AttachReply reply = FSDP__V1__ATTACH_REPLY__INIT;
  reply.session_id = s->id;
  reply.protocol_version = FSDP_PROTOCOL_VERSION;
  reply.lease_ms = lease_ms(ctx);
  reply.memory_socket = ctx->listener->channel_path;
  fsdp_rpc_call_reply(call, &reply.base);
}

static void trainer_detach(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  fsdp_services_context_t *ctx = data;
  const Fsdp__V1__DetachRequest *rq = (const void *)request;
  fsdp_session_t *s = fsdp_services_use_session(call, ctx, rq->session_id);
  if (!s)
    return;
  ctx->lifecycle.end_session(ctx->lifecycle.data, s, "detached");
  Fsdp__V1__DetachReply reply = FSDP__V1__DETACH_REPLY__INIT;
  fsdp_rpc_call_reply(call, &reply.base);
}

/* A trainer call waiting in the data plane: answered when the data plane calls back, or
 * ended by the adapter when its client gives up. It keeps its session alive until then. */
typedef struct parked_call {
  fsdp_rpc_call_t *call;
  fsdp_services_context_t *ctx;
  fsdp_session_t *session;
  fsdp_dataplane_op_t op;
} parked_call_t;

static void unpark(parked_call_t *p) {
  fsdp_session_call_ended(p->session, uv_now(p->ctx->loop));
  free(p);
}

static void on_parked_cancel(fsdp_rpc_call_t *call, void *data) {
  (void)call;
  parked_call_t *p = data;
  fsdp_dataplane_cancel(&p->op);
  unpark(p);
}

/* Parks a call for the data plane, or fails it and returns NULL. */
static parked_call_t *park_call(fsdp_rpc_call_t *call, fsdp_services_context_t *ctx,
                                fsdp_session_t *session) {
  parked_call_t *p = calloc(1, sizeof *p);
  if (!p) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "out of memory parking a call");
    return NULL;
  }
  *p = (parked_call_t){.call = call, .ctx = ctx, .session = session};
  fsdp_session_call_parked(session);
  fsdp_rpc_call_on_cancel(call, on_parked_cancel, p);
  return p;
}

/* The data plane called back: no cancel may follow. Returns false after failing the call
 * with st. */
static bool take_parked(parked_call_t *p, const fsdp_status_t *st) {
  fsdp_rpc_call_on_cancel(p->call, NULL, NULL);
  if (st->code >= 0)
    return true;
  fsdp_services_fail_call(p->call, st);
  return false;
}

static void on_registered(void *data, const fsdp_status_t *st) {
  parked_call_t *p = data;
  if (take_parked(p, st)) {
    const fsdp_unit_t *u = p->op.unit;
    fsdp_dataplane_buffers_t b;
    fsdp_dataplane_buffers(u, p->session->local_rank, &b);
    Fsdp__V1__RegisterUnitReply reply = FSDP__V1__REGISTER_UNIT_REPLY__INIT;
    reply.numel = u->layout.numel;
    reply.padded_numel = u->layout.padded_numel;
    reply.shard_numel = u->layout.shard_numel;
    reply.unit_id = u->id;
    reply.n_param_offsets = u->layout.n_params;
    reply.param_offsets = u->layout.offsets;
    if (!fsdp_unit_layout_is_flat(&u->layout)) {
      reply.n_param_shard_offsets = reply.n_param_rows_per_shard = u->layout.n_params;
      reply.param_shard_offsets = u->layout.shard_offsets;
      reply.param_rows_per_shard = u->layout.rows_per_shard;
    }
    reply.master_offset = b.master_offset;
    reply.grad_offset = b.grad_offset;
    reply.shard = b.shard;
    reply.gathered_step = b.gathered_step;
    reply.reduced_step = b.reduced_step;
    reply.replica = b.replica;
    reply.host_first_shard = b.host_first_shard;
    reply.host_shards = b.host_shards;
    fsdp_rpc_call_reply(p->call, &reply.base);
  }
  unpark(p);
}

static void on_unit_op_done(void *data, const fsdp_status_t *st) {
  parked_call_t *p = data;
  if (take_parked(p, st)) {
    const fsdp_dataplane_lent_t *lent = &p->op.lent;
    Fsdp__V1__UnitOpReply reply = FSDP__V1__UNIT_OP_REPLY__INIT;
    reply.unsharded_offset = lent->unsharded_offset;
    reply.unsharded_memory = lent->unsharded_in_masters ? 0 : 1;
    reply.full_grad_offset = lent->full_grad_offset;
    reply.full_grad_bytes = lent->full_grad_bytes;
    fsdp_rpc_call_reply(p->call, &reply.base);
  }
  unpark(p);
}

static void trainer_register_unit(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                                  void *data) {
  fsdp_services_context_t *ctx = data;
  const Fsdp__V1__RegisterUnitRequest *rq = (const void *)request;
  fsdp_session_t *s = fsdp_services_use_session(call, ctx, rq->session_id);
  if (!s)
    return;
  fsdp_unit_spec_t spec;
  if (fsdp_unit_spec_init_from_proto(&spec, rq) < 0) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "%s: out of memory registering unit '%s'",
                       fsdp_rpc_call_method(call), rq->unit);
    return;
  }
  fsdp_unit_t *u;
  fsdp_status_t st;
  fsdp_store_rank_t rank = fsdp_services_store_rank(s);
  int r = fsdp_store_register_unit(ctx->store, &rank, &spec, &u, &st);
  fsdp_unit_spec_cleanup(&spec);
  if (r < 0) {
    fsdp_services_fail_call(call, &st);
    return;
  }
  parked_call_t *p = park_call(call, ctx, s);
  if (!p)
    return;
  fsdp_dataplane_rank_t who = fsdp_unit_ops_rank(s);
  fsdp_dataplane_register(ctx->dataplane, fsdp_store_find_job(ctx->store, s->job), u,
                          &who, &p->op, on_registered, p);
}

/* The session and unit a UnitOp names, the unit registered by the session's rank, the
 * daemon's device work ordered after the trainer's (its event); fails the call and returns
 * NULL otherwise. */
static fsdp_unit_t *op_unit(fsdp_rpc_call_t *call, fsdp_services_context_t *ctx,
                            const Fsdp__V1__UnitOpRequest *rq, fsdp_session_t **ret_session,
                            fsdp_job_t **ret_job) {
  fsdp_session_t *s = fsdp_services_use_session(call, ctx, rq->session_id);
  if (!s)
    return NULL;
  fsdp_job_t *job = fsdp_store_find_job(ctx->store, s->job);
  fsdp_unit_t *u = job ? fsdp_store_find_unit(job, rq->unit) : NULL;
  fsdp_status_t st;
  if (fsdp_unit_ops_check_unit(s, u, rq->unit, &st) < 0 ||
      fsdp_unit_ops_order_after_trainer(s, rq->event, &st) < 0) {
    fsdp_services_fail_call(call, &st);
    return NULL;
  }
  *ret_session = s;
  *ret_job = job;
  return u;
}

static void trainer_unshard(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  fsdp_services_context_t *ctx = data;
  const Fsdp__V1__UnitOpRequest *rq = (const void *)request;
  fsdp_session_t *s;
  fsdp_job_t *job;
  fsdp_unit_t *u = op_unit(call, ctx, rq, &s, &job);
  if (!u)
    return;
  fsdp_status_t st;
  if (fsdp_unit_ops_check_step(job, u, rq->step, &st) < 0) {
    fsdp_services_fail_call(call, &st);
    return;
  }
  parked_call_t *p = park_call(call, ctx, s);
  if (!p)
    return;
  fsdp_dataplane_rank_t who = fsdp_unit_ops_rank(s);
  fsdp_dataplane_unshard(ctx->dataplane, job, u, &who, rq->step, rq->backward,
                         fsdp_unit_ops_deadline(ctx), &p->op, on_unit_op_done, p);
}

/* ReduceScatter for sharded units, AllReduce for NO_SHARD ones: the same local step. */
static void reduce(fsdp_rpc_call_t *call, fsdp_services_context_t *ctx,
                   const Fsdp__V1__UnitOpRequest *rq, bool all_reduce) {
  fsdp_session_t *s;
  fsdp_job_t *job;
  fsdp_unit_t *u = op_unit(call, ctx, rq, &s, &job);
  if (!u)
    return;
  fsdp_status_t st;
  if (fsdp_unit_ops_check_reduce(u, all_reduce, &st) < 0 ||
      fsdp_unit_ops_check_step(job, u, rq->step, &st) < 0) {
    fsdp_services_fail_call(call, &st);
    return;
  }
  parked_call_t *p = park_call(call, ctx, s);
  if (!p)
    return;
  fsdp_dataplane_rank_t who = fsdp_unit_ops_rank(s);
  fsdp_dataplane_reduce_how_t how = {.accumulate = rq->accumulate,
                                     .defer_all_reduce = rq->defer_all_reduce,
                                     .step_optimizer = rq->step_optimizer,
                                     .step_only = rq->step_only};
  fsdp_dataplane_reduce(ctx->dataplane, job, u, &who, rq->step, &how,
                        fsdp_unit_ops_deadline(ctx), &p->op, on_unit_op_done, p);
}

static void trainer_reduce_scatter(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                                   void *data) {
  reduce(call, data, (const void *)request, false);
}

static void trainer_all_reduce(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                               void *data) {
  reduce(call, data, (const void *)request, true);
}

static void trainer_reshard(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  fsdp_services_context_t *ctx = data;
  const Fsdp__V1__UnitOpRequest *rq = (const void *)request;
  fsdp_session_t *s;
  fsdp_job_t *job;
  fsdp_unit_t *u = op_unit(call, ctx, rq, &s, &job);
  if (!u)
    return;
  fsdp_status_t st;
  fsdp_dataplane_rank_t who = fsdp_unit_ops_rank(s);
  if (fsdp_dataplane_reshard(job, u, &who, &st) < 0) {
    fsdp_services_fail_call(call, &st);
    return;
  }
  Fsdp__V1__UnitOpReply reply = FSDP__V1__UNIT_OP_REPLY__INIT;
  fsdp_rpc_call_reply(call, &reply.base);
}

/* SetSchedule's depths within what a pool can hold; false after failing the call. */
static bool schedule_depths_ok(fsdp_rpc_call_t *call, const fsdp_job_t *job,
                               const Fsdp__V1__SetScheduleRequest *rq) {
  if (rq->max_inflight > FSDP_POOL_CAPACITY_MAX) {
    fsdp_rpc_call_fail(call, FSDP_E_INVALID_ARGUMENT,
                       "SetSchedule: max_inflight %u is outside [1, %d] (0 keeps the job's %u)",
                       rq->max_inflight, FSDP_POOL_CAPACITY_MAX, job->max_inflight);
    return false;
  }
  const char *depth_names[2] = {"forward_prefetch", "backward_prefetch"};
  uint32_t depths[2] = {rq->forward_prefetch, rq->backward_prefetch};
  for (size_t i = 0; i < 2; i++)
    if (depths[i] > FSDP_POOL_CAPACITY_MAX) {
      fsdp_rpc_call_fail(call, FSDP_E_INVALID_ARGUMENT, "SetSchedule: %s %u is outside [0, %d]",
                         depth_names[i], depths[i], FSDP_POOL_CAPACITY_MAX);
      return false;
    }
  return true;
}

/* SetSchedule's per-unit entries, each of a registered unit; false after failing the call. */
static bool schedule_units_ok(fsdp_rpc_call_t *call, const fsdp_job_t *job,
                              const Fsdp__V1__SetScheduleRequest *rq) {
  /* Each unit's entry once: where two disagree, neither silently wins. Indexed by unit id,
   * which is below n_units, so that a long list costs one pass. */
  size_t *entry_of = calloc(job->n_units ? job->n_units : 1, sizeof *entry_of);
  if (!entry_of) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "SetSchedule: out of memory");
    return false;
  }
  for (size_t i = 0; i < rq->n_units; i++) {
    const fsdp_unit_t *u = fsdp_store_find_unit(job, rq->units[i]->unit);
    if (!u) {
      fsdp_rpc_call_fail(call, FSDP_E_NOT_FOUND,
                         "SetSchedule: units[%zu].unit '%s' is not registered in job '%s'", i,
                         rq->units[i]->unit, job->name);
      free(entry_of);
      return false;
    }
    if (entry_of[u->id]) { /* the index plus one: 0 is none yet */
      fsdp_rpc_call_fail(call, FSDP_E_INVALID_ARGUMENT,
                         "SetSchedule: units[%zu].unit '%s' is units[%zu].unit already: a unit "
                         "takes one entry",
                         i, rq->units[i]->unit, entry_of[u->id] - 1);
      free(entry_of);
      return false;
    }
    entry_of[u->id] = i + 1;
  }
  free(entry_of);
  return true;
}

/* SetSchedule's forward_order as the job's units, each registered and named once; the
 * caller frees it. NULL after failing the call. */
static fsdp_unit_t **schedule_order(fsdp_rpc_call_t *call, const fsdp_job_t *job,
                                    const Fsdp__V1__SetScheduleRequest *rq) {
  fsdp_unit_t **order = calloc(rq->n_forward_order ? rq->n_forward_order : 1, sizeof *order);
  if (!order) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "SetSchedule: out of memory");
    return NULL;
  }
  for (size_t i = 0; i < rq->n_forward_order; i++) {
    const char *name = rq->forward_order[i];
    order[i] = fsdp_store_find_unit(job, name);
    for (size_t k = 0; order[i] && k < i; k++)
      if (order[k] == order[i]) {
        fsdp_rpc_call_fail(call, FSDP_E_INVALID_ARGUMENT,
                           "SetSchedule: forward_order[%zu] '%s' is forward_order[%zu] already",
                           i, name, k);
        free(order);
        return NULL;
      }
    if (!order[i]) {
      fsdp_rpc_call_fail(call, FSDP_E_NOT_FOUND,
                         "SetSchedule: forward_order[%zu] '%s' is not registered in job '%s'", i,
                         name, job->name);
      free(order);
      return NULL;
    }
  }
  return order;
}

/* The job's schedule: checked whole before any of it applies. */
static void trainer_set_schedule(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                                 void *data) {
  fsdp_services_context_t *ctx = data;
  const Fsdp__V1__SetScheduleRequest *rq = (const void *)request;
  fsdp_session_t *s = fsdp_services_use_session(call, ctx, rq->session_id);
  if (!s)
    return;
  fsdp_job_t *job = fsdp_store_find_job(ctx->store, s->job);
  if (!job) {
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION,
                       "SetSchedule: job '%s' has no units yet: register them first", s->job);
    return;
  }
  if (!schedule_depths_ok(call, job, rq) || !schedule_units_ok(call, job, rq))
    return;
  fsdp_unit_t **order = schedule_order(call, job, rq);
  if (!order)
    return;
  if (rq->max_inflight)
    fsdp_dataplane_set_max_inflight(job, rq->max_inflight);
  for (size_t i = 0; i < rq->n_units; i++)
    fsdp_store_find_unit(job, rq->units[i]->unit)->flight->reshard_after_forward =
        rq->units[i]->reshard_after_forward;
  if (rq->n_forward_order || job->flight->order_given) /* empty keeps a recorded order */
    fsdp_dataplane_set_order(job, order, (unsigned)rq->n_forward_order);
  free(order);
  job->flight->forward_prefetch = rq->forward_prefetch;
  job->flight->backward_prefetch = rq->backward_prefetch;
  Fsdp__V1__SetScheduleReply reply = FSDP__V1__SET_SCHEDULE_REPLY__INIT;
  fsdp_rpc_call_reply(call, &reply.base);
}

/* The job's optimizer (daemon/dataplane/optimizer.h): the request becomes the data plane's
 * groups, checked there whole; the reply says where each trainable unit's state is. */
static void trainer_set_optimizer(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                                  void *data) {
  fsdp_services_context_t *ctx = data;
  const Fsdp__V1__SetOptimizerRequest *rq = (const void *)request;
  fsdp_session_t *s = fsdp_services_use_session(call, ctx, rq->session_id);
  if (!s)
    return;
  fsdp_job_t *job = fsdp_store_find_job(ctx->store, s->job);
  if (!job || !job->n_units) {
    fsdp_rpc_call_fail(call, FSDP_E_FAILED_PRECONDITION,
                       "SetOptimizer: job '%s' has no units yet: register them first", s->job);
    return;
  }
  fsdp_optimizer_group_t *groups = calloc(rq->n_groups ? rq->n_groups : 1, sizeof *groups);
  Fsdp__V1__OptimizerUnitState *states = calloc(job->n_units, sizeof *states);
  Fsdp__V1__OptimizerUnitState **state_ptrs = calloc(job->n_units, sizeof *state_ptrs);
  fsdp_status_t st;
  if (!groups || !states || !state_ptrs) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "SetOptimizer: out of memory");
    goto out;
  }
  for (size_t i = 0; i < rq->n_groups; i++) {
    const Fsdp__V1__OptimizerGroup *g = rq->groups[i];
    groups[i] = (fsdp_optimizer_group_t){
        .params = (const char *const *)g->params,
        .n_params = g->n_params,
        .hyper = {.lr = g->lr, .weight_decay = g->weight_decay, .maximize = g->maximize,
                  .beta1 = g->beta1, .beta2 = g->beta2, .eps = g->eps, .amsgrad = g->amsgrad,
                  .momentum = g->momentum, .dampening = g->dampening,
                  .nesterov = g->nesterov}};
  }
  if (fsdp_optimizer_set(job, (fsdp_optimizer_kind_t)rq->kind, groups, rq->n_groups,
                         rq->max_grad_norm, &st) < 0) {
    fsdp_services_fail_call(call, &st);
    goto out;
  }
  Fsdp__V1__SetOptimizerReply reply = FSDP__V1__SET_OPTIMIZER_REPLY__INIT;
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    if (!u->trainable || u->flight->state != FSDP_UNIT_READY)
      continue;
    fsdp_optimizer_state_t where;
    if (fsdp_optimizer_unit_state(job, u, &where, &st) < 0) {
      fsdp_services_fail_call(call, &st);
      goto out;
    }
    Fsdp__V1__OptimizerUnitState *m = &states[reply.n_units];
    fsdp__v1__optimizer_unit_state__init(m);
    m->unit = u->spec->unit;
    m->steps_offset = where.steps_offset;
    m->arrays_offset = where.arrays_offset;
    m->arrays = where.arrays;
    m->array_stride = where.array_stride;
    state_ptrs[reply.n_units++] = m;
  }
  reply.units = state_ptrs;
  fsdp_rpc_call_reply(call, &reply.base);
out:
  free(groups);
  free(states);
  free(state_ptrs);
}

static void trainer_keepalive(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  fsdp_services_context_t *ctx = data;
  const Fsdp__V1__KeepAliveRequest *rq = (const void *)request;
  if (!fsdp_services_use_session(call, ctx, rq->session_id))
    return;
  Fsdp__V1__KeepAliveReply reply = FSDP__V1__KEEP_ALIVE_REPLY__INIT;
  reply.lease_ms = lease_ms(ctx);
  fsdp_rpc_call_reply(call, &reply.base);
}

/* Trainer calls, as Peer.Join, are the work a drain refuses and waits for. */
static const fsdp_rpc_handler_t trainer_handlers[] = {
    {"Attach", trainer_attach, false},
    {"Detach", trainer_detach, false},
    {"RegisterUnit", trainer_register_unit, false},
    {"Unshard", trainer_unshard, false},
    {"Reshard", trainer_reshard, false},
    {"ReduceScatter", trainer_reduce_scatter, false},
    {"AllReduce", trainer_all_reduce, false},
    {"SetSchedule", trainer_set_schedule, false},
    {"SetOptimizer", trainer_set_optimizer, false},
    {"KeepAlive", trainer_keepalive, false},
};

fsdp_rpc_service_t fsdp_trainer_service(fsdp_services_context_t *ctx) {
  return (fsdp_rpc_service_t){&fsdp__v1__trainer__descriptor, trainer_handlers,
                              sizeof trainer_handlers / sizeof trainer_handlers[0], ctx};
}
