/* Jobs and units of the parameter store. */
#include "daemon/store/store.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"
#include "config/config_value.h"

fsdp_job_t *fsdp_store_find_job(const fsdp_store_t *store, const char *name) {
  for (fsdp_job_t *j = store->jobs; j; j = j->next)
    if (strcmp(j->name, name) == 0)
      return j;
  return NULL;
}

bool fsdp_store_unit_registered_by(const fsdp_unit_t *unit, uint32_t rank) {
  return fsdp_rank_set_has(&unit->registered, rank);
}

fsdp_unit_t *fsdp_store_find_unit(const fsdp_job_t *job, const char *name) {
  for (fsdp_unit_t *u = job->units; u; u = u->next)
    if (strcmp(u->spec->unit, name) == 0)
      return u;
  return NULL;
}

fsdp_unit_t *fsdp_store_unit_by_id(const fsdp_job_t *job, uint32_t id) {
  return id < job->n_units ? job->units_by_id[id] : NULL;
}

static void unit_free(const fsdp_store_t *store, fsdp_unit_t *u) {
  if (!u)
    return;
  if (u->flight && store->hooks.unit_freed)
    store->hooks.unit_freed(store->hooks.data, u);
  fsdp_unit_layout_cleanup(&u->layout);
  fsdp_unit_spec_free(u->spec);
  free(u);
}

static void mark_registered(fsdp_unit_t *u, uint32_t rank) {
  if (fsdp_rank_set_put(&u->registered, rank, true))
    u->n_registered++;
}

static int new_unit(const fsdp_store_t *store, fsdp_job_t *job, const fsdp_store_rank_t *rank,
                    const fsdp_unit_spec_t *rq, fsdp_unit_t **ret_unit, fsdp_status_t *st) {
  fsdp_unit_t *u = calloc(1, sizeof *u);
  if (!u || fsdp_unit_spec_copy(rq, &u->spec) < 0) {
    unit_free(store, u);
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory registering unit '%s'",
                           rq->unit);
  }
  u->job = job;
  fsdp_unit_plan(&store->topology, rq->strategy, job->local_world_size, &u->plan);
  int r = fsdp_unit_gradient_scales(u->spec, u->plan.data_parallel_size, &u->pre_scale,
                                    &u->post_scale, st);
  if (r == 0)
    r = fsdp_unit_layout_init(&u->layout, u->spec, u->plan.shards, u->plan.pad_multiple, st);
  if (r == 0 && store->hooks.unit_made)
    r = store->hooks.unit_made(store->hooks.data, u, st);
  if (r < 0) {
    unit_free(store, u);
    return r;
  }
  if (job->n_units == job->units_by_id_capacity) {
    unsigned capacity = job->units_by_id_capacity ? 2 * job->units_by_id_capacity : 16;
    fsdp_unit_t **grown = realloc(job->units_by_id, capacity * sizeof *grown);
    if (!grown) {
      unit_free(store, u);
      return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory registering unit '%s'",
                             rq->unit);
    }
    job->units_by_id = grown;
    job->units_by_id_capacity = capacity;
  }
  for (size_t i = 0; i < rq->n_params; i++)
    u->trainable |= rq->params[i].requires_grad;
  u->id = job->n_units;
  job->units_by_id[u->id] = u;
  u->first_rank = rank->local_rank;
  mark_registered(u, rank->local_rank);
  *job->units_tail = u;
  job->units_tail = &u->next;
  job->n_units++;
  *ret_unit = u;
  return 0;
}

static int make_arenas(fsdp_job_t *job, const fsdp_backend_t *backend, size_t capacity,
                       fsdp_status_t *st) {
  fsdp_arena_options_t options = FSDP_ARENA_OPTIONS_INIT;
  options.prefault = FSDP_ARENA_PREFAULT_NONE;
  options.backend = backend;
  options.capacity_key = fsdp_option_get(FSDP_OPTION_JOB_MEMORY)->key;
  fsdp_arena_t *arena, *shared;
  int r = fsdp_arena_new(job->name, capacity, &options, &arena, st);
  if (r < 0)
    return r;
  /* F_SEAL_FUTURE_WRITE after our own mapping: nobody, root included, maps it writable. */
  options.peers_read_only = true;
  if ((r = fsdp_arena_new(job->name, capacity, &options, &shared, st)) < 0) {
    fsdp_arena_free(arena);
    return r;
  }
  job->arena = arena;
  job->shared_arena = shared;
  return 0;
}

/* The job's pools over its arenas, capped at max_inflight. */
static int make_pools(fsdp_job_t *job, unsigned max_inflight, fsdp_status_t *st) {
  job->grad_pools = calloc(job->local_world_size, sizeof *job->grad_pools);
  if (!job->grad_pools)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for job '%s'",
                           job->name);
  job->max_inflight = max_inflight;
  fsdp_pool_init(&job->copies, job->shared_arena, max_inflight);
  fsdp_pool_init(&job->sums, job->arena, max_inflight);
  for (uint32_t r = 0; r < job->local_world_size; r++)
    fsdp_pool_init(&job->grad_pools[r], job->arena, max_inflight);
  return 0;
}

static void job_free(const fsdp_store_t *store, fsdp_job_t *job) {
  for (fsdp_unit_t *u = job->units, *next; u; u = next) {
    next = u->next;
    unit_free(store, u);
  }
  if (job->flight && store->hooks.job_freed)
    store->hooks.job_freed(store->hooks.data, job);
  if (job->grad_pools) {
    fsdp_pool_cleanup(&job->copies);
    fsdp_pool_cleanup(&job->sums);
    for (uint32_t r = 0; r < job->local_world_size; r++)
      fsdp_pool_cleanup(&job->grad_pools[r]);
    free(job->grad_pools);
  }
  if (job->optimizer)
    job->optimizer_free(job->optimizer);
  fsdp_staging_cleanup(&job->staging);
  if (job->checkpoints)
    job->checkpoints_free(job->checkpoints);
  free(job->units_by_id);
  fsdp_arena_free(job->arena);
  fsdp_arena_free(job->shared_arena);
  free(job);
}

/* A job's two arenas together: the bytes its buffers use, and the bytes the arenas hold at
 * most (what it reserves against memory.limit). */
static void job_memory(const fsdp_job_t *job, size_t *ret_used, size_t *ret_capacity) {
  size_t used = 0, capacity = 0;
  const fsdp_arena_t *arenas[2] = {job->arena, job->shared_arena};
  for (size_t k = 0; k < 2 && arenas[k]; k++) {
    fsdp_arena_stats_t stats;
    fsdp_arena_get_stats(arenas[k], &stats);
    used += stats.used;
    capacity += stats.capacity;
  }
  *ret_used = used;
  *ret_capacity = capacity;
}

static size_t job_reserved(const fsdp_job_t *job) {
  size_t used, capacity;
  job_memory(job, &used, &capacity);
  return capacity;
}

void fsdp_store_job_went_idle(fsdp_store_t *store, fsdp_job_t *job, uint64_t now_ms) {
  job->idle_since_ms = now_ms;
  job->idle_order = ++store->idle_serial;
}

/* The retained job that went idle first (idle_since_ms 0: its work ended after its last
 * session and the housekeeping has not looked since, so the most recent), or NULL when
 * every job is in use. Jobs are compared by idle_order, not by idle_since_ms: jobs that
 * went idle in the same millisecond would tie, and the newest of them (first in the list)
 * would win. */
static fsdp_job_t *oldest_idle_job(const fsdp_store_t *store) {
  fsdp_job_t *oldest = NULL;
  for (fsdp_job_t *j = store->jobs; j; j = j->next) {
    if (!store->hooks.job_idle || !store->hooks.job_idle(store->hooks.data, j))
      continue;
    if (!oldest || (j->idle_since_ms != 0 &&
                    (oldest->idle_since_ms == 0 || j->idle_order < oldest->idle_order)))
      oldest = j;
  }
  return oldest;
}

static const char *format_bytes(size_t bytes, char *buf, size_t size) {
  if (fsdp_config_value_format(fsdp_option_get(FSDP_OPTION_MEMORY_LIMIT), (int64_t)bytes, buf,
                               size) < 0)
    snprintf(buf, size, "%zuB", bytes);
  return buf;
}

/* Frees retained jobs, the one idle longest first, until a new job fits in a slot and in
 * memory.limit; fails naming what the jobs in use hold when it cannot. The arenas' size
 * counted is an upper bound of what fsdp_arena_new makes of arena_capacity (it rounds up
 * to whole pages), so that the reservation never passes the limit. */
static int make_room(fsdp_store_t *store, const char *name, fsdp_status_t *st) {
  size_t need = 2 * ((store->arena_capacity + FSDP_ARENA_PAGE_MAX - 1) / FSDP_ARENA_PAGE_MAX *
                     FSDP_ARENA_PAGE_MAX);
  for (;;) {
    bool slot = store->n_jobs < store->max_jobs;
    bool memory = store->reserved <= store->memory_limit &&
                  need <= store->memory_limit - store->reserved;
    if (slot && memory)
      return 0;
    fsdp_job_t *victim = oldest_idle_job(store);
    if (victim) {
      char why[FSDP_JOB_NAME_MAX + 96];
      snprintf(why, sizeof why, "retained with no session, but job '%s' needs the room (%s)",
               name, slot ? "memory.limit" : "session.max_sessions jobs at once");
      store->hooks.free_job(store->hooks.data, victim, why);
      continue;
    }
    if (!slot)
      return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED,
                             "job '%s': the daemon holds %u jobs in use already "
                             "(session.max_sessions)",
                             name, store->n_jobs);
    char arena_s[32], need_s[32], reserved_s[32], limit_s[32];
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED,
                           "job '%s': its two arenas of %s (memory.job_limit) need %s, but %s "
                           "of memory.limit = %s is reserved by %u job%s in use",
                           name, format_bytes(store->arena_capacity, arena_s, sizeof arena_s),
                           format_bytes(need, need_s, sizeof need_s),
                           format_bytes(store->reserved, reserved_s, sizeof reserved_s),
                           format_bytes(store->memory_limit, limit_s, sizeof limit_s),
                           store->n_jobs, store->n_jobs == 1 ? "" : "s");
  }
}

int fsdp_store_job_for(fsdp_store_t *store, const fsdp_store_rank_t *rank, fsdp_job_t **ret_job,
                       fsdp_status_t *st) {
  if (store->local_world_size && rank->local_world_size != store->local_world_size)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "job '%s': local_world_size %u, but every host of this cluster runs "
                           "cluster.local_world_size = %u trainers",
                           rank->job, rank->local_world_size, store->local_world_size);
  fsdp_job_t *job = fsdp_store_find_job(store, rank->job);
  if (job) {
    if (job->local_world_size != rank->local_world_size)
      return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                             "job '%s' holds units for local_world_size %u, but this session has "
                             "%u",
                             job->name, job->local_world_size, rank->local_world_size);
    if (store->hooks.rank_back)
      store->hooks.rank_back(store->hooks.data, job, rank->local_rank);
    *ret_job = job;
    return 0;
  }
  int r = make_room(store, rank->job, st);
  if (r < 0)
    return r;
  job = calloc(1, sizeof *job);
  if (!job)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for job '%s'",
                           rank->job);
  snprintf(job->name, sizeof job->name, "%s", rank->job);
  job->local_world_size = rank->local_world_size;
  job->owner = *rank->owner;
  job->units_tail = &job->units;
  job->backend = store->backend;
  fsdp_staging_init(&job->staging, store->backend);
  if ((r = make_arenas(job, store->backend, store->arena_capacity, st)) < 0 ||
      (r = make_pools(job, store->max_inflight, st)) < 0 ||
      (store->hooks.job_made && (r = store->hooks.job_made(store->hooks.data, job, st)) < 0)) {
    job_free(store, job);
    return r;
  }
  store->reserved += job_reserved(job);
  job->next = store->jobs;
  store->jobs = job;
  store->n_jobs++;
  *ret_job = job;
  return 0;
}

int fsdp_store_register_unit(fsdp_store_t *store, const fsdp_store_rank_t *rank,
                             const fsdp_unit_spec_t *rq, fsdp_unit_t **ret_unit,
                             fsdp_status_t *st) {
  int r = fsdp_unit_spec_check(rq, st);
  if (r < 0)
    return r;
  fsdp_job_t *job = NULL;
  if ((r = fsdp_store_job_for(store, rank, &job, st)) < 0)
    return r;
  fsdp_unit_t *u = fsdp_store_find_unit(job, rq->unit);
  if (!u)
    return new_unit(store, job, rank, rq, ret_unit, st);

  fsdp_spec_difference_t d;
  if (fsdp_unit_spec_diff(rq, u->spec, &d))
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "unit '%s' %s %s on rank %u, expected %s as on rank %u", rq->unit,
                           d.field, d.a, rank->local_rank, d.b, u->first_rank);
  mark_registered(u, rank->local_rank);
  *ret_unit = u;
  return 0;
}

void fsdp_store_init(fsdp_store_t *store) {
  memset(store, 0, sizeof *store);
}

size_t fsdp_store_memory_used(const fsdp_store_t *store) {
  size_t used = 0;
  for (const fsdp_job_t *j = store->jobs; j; j = j->next) {
    size_t job_used, capacity;
    job_memory(j, &job_used, &capacity);
    used += job_used;
  }
  return used;
}

void fsdp_store_remove_job(fsdp_store_t *store, fsdp_job_t *job) {
  for (fsdp_job_t **p = &store->jobs; *p; p = &(*p)->next) {
    if (*p == job) {
      *p = job->next;
      store->n_jobs--;
      store->reserved -= job_reserved(job);
      job_free(store, job);
      return;
    }
  }
}

void fsdp_store_cleanup(fsdp_store_t *store) {
  if (!store)
    return;
  while (store->jobs) {
    fsdp_job_t *job = store->jobs;
    store->jobs = job->next;
    job_free(store, job);
  }
  store->n_jobs = 0;
  store->reserved = 0;
}
