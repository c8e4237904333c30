/* The job as the checkpoints see it, on the loop: where it stands among its steps, and its
 * state described for a checkpoint (every unit's layout, masters and optimizer state). */
#include "daemon/checkpoints/internal.h"

#include <stdlib.h>

#include "checkpoint/checkpoint.h"
#include "daemon/dataplane/optimizer.h"

static void free_job_checkpoints(fsdp_job_checkpoints_t *ck) {
  free(ck->staging);
  free(ck->last_path);
  free(ck->resume_from);
  free(ck->recover_error);
  free(ck);
}

fsdp_job_checkpoints_t *ck_job(fsdp_job_t *job) {
  if (!job->checkpoints && (job->checkpoints = calloc(1, sizeof *job->checkpoints)))
    job->checkpoints_free = free_job_checkpoints;
  return job->checkpoints;
}

void fsdp_checkpoints_job_info(const fsdp_job_t *job, fsdp_checkpoints_job_info_t *ret_info) {
  const fsdp_job_checkpoints_t *ck = job->checkpoints;
  *ret_info = (fsdp_checkpoints_job_info_t){
      .staging_bytes = ck ? ck->staging_bytes : 0,
      .last_step = ck ? ck->last_step : 0,
      .last_path = ck && ck->last_path ? ck->last_path : "",
  };
  if (ck) {
    ret_info->saved = ck->saved;
    ret_info->save_failed = ck->save_failed;
    ret_info->loaded = ck->loaded;
    ret_info->load_failed = ck->load_failed;
    ret_info->saved_bytes = ck->saved_bytes;
    ret_info->loaded_bytes = ck->loaded_bytes;
    ret_info->save_ns = ck->save_ns;
    ret_info->load_ns = ck->load_ns;
  }
}

job_steps_t ck_job_steps(const fsdp_job_t *job) {
  job_steps_t s = {.even = true};
  for (const fsdp_unit_t *u = job->units; u; u = u->next) {
    if (u->spec->scratch)
      continue;
    s.reducing |= u->flight->reduce.running;
    uint64_t reduced = u->flight->reduce.running ? u->flight->reduce.step : u->flight->reduced_step;
    s.newest = reduced > s.newest ? reduced : s.newest;
    if (!u->trainable)
      continue;
    s.even &= !s.trained || u->flight->reduced_step == s.completed;
    s.completed = s.trained && u->flight->reduced_step > s.completed ? s.completed : u->flight->reduced_step;
    s.trained = true;
  }
  return s;
}

bool ck_masters_final(fsdp_job_t *job, uint64_t step) {
  return ck_daemon_steps_every_unit(job) || job->flight->masters_final_step > step;
}

const fsdp_unit_t *ck_collective_running(const fsdp_job_t *job) {
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (u->flight->gather.running || u->flight->reduce.running)
      return u;
  return NULL;
}

/* The job's state as a checkpoint holds it: every unit's masters, and the optimizer's state
 * of the units it steps. */
static int describe_checkpoint(fsdp_job_t *job, checkpoint_work_t *c, fsdp_status_t *st) {
  size_t n_params = 0;
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    n_params += u->spec->scratch ? 0 : u->spec->n_params;
  c->units = calloc(job->n_units ? job->n_units : 1, sizeof *c->units);
  c->params = calloc(n_params ? n_params : 1, sizeof *c->params);
  if (!c->units || !c->params)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for a checkpoint");
  fsdp_checkpoint_param_t *params = c->params;
  char *base = fsdp_arena_base(job->arena);
  size_t n = 0;
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    if (u->spec->scratch)
      continue; /* a client's own buffer: not the model's state */
    if (u->flight->state != FSDP_UNIT_READY)
      return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                             "job '%s': unit '%s' has no buffers ready yet", job->name,
                             u->spec->unit);
    /* The files hold a unit's elements as one range of its flat buffer per host. */
    if (!fsdp_unit_layout_is_flat(&u->layout))
      return fsdp_status_set(st, FSDP_E_UNIMPLEMENTED,
                             "job '%s': unit '%s' is %s, which checkpoints do not hold yet "
                             "(LAYOUT_FLAT only)",
                             job->name, u->spec->unit, fsdp_unit_layout_name(u->spec->layout));
    fsdp_dataplane_buffers_t b;
    fsdp_dataplane_buffers(u, 0, &b);
    fsdp_checkpoint_unit_t *cu = &c->units[n++];
    for (size_t k = 0; k < u->spec->n_params; k++) {
      const fsdp_param_spec_t *p = &u->spec->params[k];
      params[k] = (fsdp_checkpoint_param_t){.name = p->name,
                                            .shape = p->shape,
                                            .ndim = p->n_shape,
                                            .offset = u->layout.offsets[k],
                                            .dtype = fsdp_unit_dtype_name(p->dtype)};
    }
    *cu = (fsdp_checkpoint_unit_t){
        .name = u->spec->unit,
        .strategy = fsdp_unit_strategy_name(u->spec->strategy),
        .params = params,
        .n_params = u->spec->n_params,
        .numel = u->layout.numel,
        .padded_numel = u->layout.padded_numel,
        .shard_numel = u->layout.shard_numel,
        .shards = u->layout.shards,
        .host_first_shard = b.host_first_shard,
        .host_shards = b.host_shards,
        .masters = (float *)(void *)(base + u->master_offset),
    };
    params += u->spec->n_params;
    fsdp_optimizer_state_t state;
    if (fsdp_optimizer_steps_unit(job, u)) {
      if (fsdp_optimizer_unit_state(job, u, &state, st) < 0)
        return st->code;
      cu->arrays = state.arrays;
      for (unsigned a = 0; a < state.arrays; a++)
        cu->state[a] = (float *)(void *)(base + state.arrays_offset + a * state.array_stride);
      cu->steps = (uint64_t *)(void *)(base + state.steps_offset);
    }
  }
  c->job.step = ck_job_steps(job).completed;
  c->job.job = job->name;
  c->job.uid = job->owner.uid;
  c->job.same_uid_only = c->as_daemon; /* the job's trainers cannot read its files */
  c->job.own_job_only = c->as_daemon;  /* nor another job's there: the daemon's rights */
  c->job.host = c->cp->dp->peers ? fsdp_peers_host_rank(c->cp->dp->peers) : 0;
  c->job.hosts = c->cp->dp->peers ? fsdp_peers_host_count(c->cp->dp->peers) : 1;
  c->job.optimizer = fsdp_optimizer_kind_name(job);
  c->job.write_rate = c->cp->write_rate;
  c->job.disk_share = c->scheduled && c->cp->disk_share ? c->cp->disk_share : 100;
  /* Host 0 waits for the others' files as long as a collective among hosts may take, and
   * as many times longer as pacing makes the saves last. */
  c->job.hosts_wait_ms = c->cp->dp->collective_timeout_ms * 100 / c->job.disk_share;
  c->job.stopping = &c->cp->stopping;
  c->job.units = c->units;
  c->job.n_units = n;
  return 0;
}

bool ck_daemon_steps_every_unit(fsdp_job_t *job) {
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (u->trainable && !u->spec->scratch && !fsdp_optimizer_steps_unit(job, u))
      return false;
  return true;
}

int ck_describe(fsdp_job_t *job, checkpoint_work_t *c, fsdp_status_t *st) {
  free(c->params);
  free(c->units);
  c->params = NULL;
  c->units = NULL;
  int r = describe_checkpoint(job, c, st);
  if (r < 0)
    return r;
  if (c->asked_step)
    c->job.step = c->asked_step;
  c->step = c->job.step; /* a load's is the checkpoint's, read with it */
  return 0;
}
