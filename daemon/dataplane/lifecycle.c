/* The data plane's life (made, given its backend, freed), the store's hooks that give each
 * job and unit its flight, a unit's registration, and where a job's steps stand: reached,
 * or resumed from a checkpoint. */
#include "daemon/dataplane/internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/backend/host_backend.h"

static int job_made(void *data, fsdp_job_t *job, fsdp_status_t *st) {
  (void)data;
  job->flight = calloc(1, sizeof *job->flight);
  if (!job->flight)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for job '%s'",
                           job->name);
  return 0;
}

static void job_freed(void *data, fsdp_job_t *job) {
  (void)data;
  free(job->flight->order);
  free(job->flight->recorded);
  free(job->flight->recorder.records);
  free(job->flight);
  job->flight = NULL;
}

static void rank_back(void *data, fsdp_job_t *job, uint32_t local_rank) {
  (void)data;
  job->flight->gone_before_serial[local_rank] = 0;
}

/* The schedule's lists hold at most every unit: they grow with the job's units. */
static int grow_order(fsdp_job_flight_t *jf, unsigned units) {
  if (units <= jf->order_capacity)
    return 0;
  unsigned capacity = jf->order_capacity ? 2 * jf->order_capacity : 16;
  fsdp_unit_t ***lists[2] = {&jf->order, &jf->recorded};
  for (size_t k = 0; k < 2; k++) {
    fsdp_unit_t **grown = realloc(*lists[k], capacity * sizeof *grown);
    if (!grown)
      return -ENOMEM;
    *lists[k] = grown;
  }
  jf->order_capacity = capacity;
  return 0;
}

static int unit_made(void *data, fsdp_unit_t *unit, fsdp_status_t *st) {
  (void)data;
  fsdp_unit_flight_t *f = calloc(1, sizeof *f);
  if (f)
    f->full_grad_offsets = calloc(unit->job->local_world_size, sizeof *f->full_grad_offsets);
  if (!f || !f->full_grad_offsets || grow_order(unit->job->flight, unit->job->n_units + 1) < 0) {
    if (f)
      free(f->full_grad_offsets);
    free(f);
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory registering unit '%s'",
                           unit->spec->unit);
  }
  fsdp_list_init(&f->copy_waiter.link);
  fsdp_list_init(&f->sum_waiter.link);
  /* FSDP's default: FULL_SHARD and HYBRID_SHARD free the copy after the forward; the others
   * hold theirs until the backward. */
  fsdp_unit_strategy_t strategy = unit->spec->strategy;
  f->reshard_after_forward =
      strategy == FSDP_UNIT_FULL_SHARD || strategy == FSDP_UNIT_HYBRID_SHARD;
  f->order_index = -1;
  f->unit = unit;
  unit->flight = f;
  return 0;
}

static void unit_freed(void *data, fsdp_unit_t *unit) {
  (void)data;
  free(unit->flight->full_grad_offsets);
  free(unit->flight);
  unit->flight = NULL;
}

void fsdp_dataplane_hook_store(fsdp_store_hooks_t *hooks) {
  hooks->job_made = job_made;
  hooks->job_freed = job_freed;
  hooks->unit_made = unit_made;
  hooks->unit_freed = unit_freed;
  hooks->rank_back = rank_back;
}

void fsdp_dataplane_register(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *unit,
                             const fsdp_dataplane_rank_t *who, fsdp_dataplane_op_t *op,
                             fsdp_dataplane_done_fn done, void *data) {
  dp_op_init(op, unit, who, WAIT_REGISTER, done, data);
  fsdp_status_t st;
  fsdp_job_flight_t *jf = job->flight;
  if (who->generation > jf->generation) { /* a new run: its trainers register first */
    jf->generation = who->generation;
    dp_supersede_rings(dp, job);
  }
  switch (unit->flight->state) {
  case FSDP_UNIT_NEW:
    dp_recorder_make(dp, job);
    if (!jf->resume_looked && dp->hooks.job_starts)
      jf->looking = dp->hooks.job_starts(dp->hooks.ctx, job, unit);
    jf->resume_looked = true;
    if (jf->resume_pending && !unit->spec->scratch)
      unit->flight->reduced_step = jf->resume_step; /* its trainers go on after it */
    if (dp_allocate(job, unit, &st) < 0) {
      dp_op_fail(op, st.code, "%s", st.message);
      return;
    }
    int r = dp_queue(dp, WORK_PREFAULT, job, unit);
    if (r < 0) {
      fsdp_arena_release(job->arena, unit->buffers_offset);
      dp_op_fail(op, r, "cannot queue the buffers' preparation");
      return;
    }
    unit->flight->state = FSDP_UNIT_ALLOCATING;
    dp_park(op);
    return;
  case FSDP_UNIT_ALLOCATING:
    dp_park(op);
    return;
  case FSDP_UNIT_FAILED:
    dp_op_fail(op, unit->flight->error.code, "%s", unit->flight->error.message);
    return;
  default:
    if (jf->looking)
      dp_park(op);
    else
      dp_op_ok(op);
  }
}

void fsdp_dataplane_looked(fsdp_dataplane_t *dp, fsdp_job_t *job, bool resume, uint64_t step) {
  (void)dp;
  fsdp_job_flight_t *jf = job->flight;
  jf->looking = false;
  jf->resume_pending = resume;
  jf->resume_step = step;
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    if (resume && !u->spec->scratch)
      u->flight->reduced_step = step; /* its trainers go on after it */
    if (u->flight->state != FSDP_UNIT_ALLOCATING)
      dp_wake(u, WAIT_REGISTER);
  }
}

void fsdp_dataplane_reached_step(fsdp_job_t *job, uint64_t step) {
  if (step > job->flight->last_step)
    job->flight->last_step = step;
}

/* The resume's load ended: the gathers waiting for it start, or, when it failed, the job's
 * units fail naming why (training from the trainers' initial values would be silently
 * wrong). */
bool fsdp_dataplane_job_resuming(const fsdp_job_t *job) {
  return job->flight->resume_pending || job->flight->resuming;
}

void fsdp_dataplane_resumed(fsdp_dataplane_t *dp, fsdp_job_t *job, const fsdp_status_t *st) {
  job->flight->resuming = false;
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    if (st->code < 0) {
      u->flight->state = FSDP_UNIT_FAILED;
      fsdp_status_set(&u->flight->error, st->code,
                      "job '%s' cannot resume: %s", job->name,
                      st->message);
    }
    if (!u->flight->gather_after_resume)
      continue;
    u->flight->gather_after_resume = false;
    if (st->code < 0)
      dp_abort_collection(job, u, WAIT_UNSHARD, u->flight->error.code, u->flight->error.message);
    else
      dp_start_gather(dp, job, u);
  }
}

int fsdp_dataplane_init(fsdp_dataplane_t *dp, uv_loop_t *loop, unsigned threads,
                        fsdp_status_t *st) {
  memset(dp, 0, sizeof *dp);
  dp->loop = loop;
  int r = fsdp_workers_new(threads, &dp->workers);
  if (r < 0)
    return fsdp_status_set(st, r, "cannot start %u worker threads: %s", threads,
                           fsdp_strerror(r));
  fsdp_backend_init_host(&dp->backend, dp->workers);
  return 0;
}

int fsdp_dataplane_use_cuda(fsdp_dataplane_t *dp, const fsdp_cuda_module_t *cuda,
                            const fsdp_cuda_device_t *device, fsdp_status_t *st) {
  return fsdp_backend_init_cuda(&dp->backend, cuda, device, st);
}

void fsdp_dataplane_cleanup(fsdp_dataplane_t *dp) {
  if (!dp)
    return;
  while (dp->free_scratch) {
    void *s = dp->free_scratch;
    memcpy(&dp->free_scratch, s, sizeof(void *));
    free(s);
  }
  fsdp_backend_cleanup(&dp->backend);
  fsdp_workers_free(dp->workers);
  dp->workers = NULL;
}
