/* The parameter store's registry: jobs and their units.
 *
 * A job is created by the first RegisterUnit or memory channel of any of its ranks, with
 * its two arenas, belongs to that trainer's uid and job token (Attach lets no other in),
 * and outlives its trainers' sessions: parameters stay in the daemon when a trainer dies,
 * so that it can attach again and go on.
 *
 * Memory and slots. A job's arenas are sized once (memory.job_limit each) and every local
 * rank holds descriptors to them, so whatever a trainer does it can make at most their
 * capacity resident (daemon/store/arena.h): the capacities, not the bytes allocated, are what
 * the store reserves against memory.limit, when the job is created. A job that nothing
 * refers to any more (retained for store.job_retention after its last session) never
 * keeps a new job out: when a new job needs a slot or memory and none is free, the
 * retained job that went idle first is freed to make room; only jobs in use count against
 * the limits.
 *
 * A unit is registered by every local rank of its job with the same spec; the first
 * registration fixes the spec and the layout, a later one either matches it (and only
 * records that the rank registered) or is refused naming the first differing field, both
 * values and both ranks.
 *
 * Owned by the daemon, loop thread only. */
#ifndef FSDP_STORE_H
#define FSDP_STORE_H

#include <stdbool.h>
#include <stdint.h>

#include "collectives/local.h"
#include "collectives/rank_set.h"
#include "common/status.h"
#include "daemon/backend/backend.h"
#include "daemon/store/arena.h"
#include "daemon/store/job_owner.h"
#include "daemon/store/pool.h"
#include "daemon/store/staging.h"
#include "daemon/store/topology.h"
#include "daemon/store/unit_layout.h"

typedef struct fsdp_unit {
  struct fsdp_job *job;   /* the owner */
  uint32_t id;            /* its place among the job's units, in registration order */
  bool trainable;         /* some parameter requires its gradient */
  fsdp_unit_spec_t *spec; /* private copy; owned */
  fsdp_unit_plan_t plan; /* shards across hosts, and the rings of its collectives */
  fsdp_unit_layout_t layout;
  float pre_scale, post_scale; /* the reduction's, from the gradient divide factors */
  uint64_t buffers_offset;    /* the arena block holding the persistent buffers */
  uint64_t master_offset;     /* these in the job's arena; master and grad: this host's */
  uint64_t grad_offset;
  /* The param dtype is fp32 and this host holds every shard, so the masters themselves are
   * the unsharded copy: nothing is gathered or held. */
  bool copy_in_masters;
  /* What the data plane does with it (daemon/dataplane/dataplane.h): made and freed with
   * the unit through the hooks' unit_made and unit_freed; the data plane's. */
  struct fsdp_unit_flight *flight;
  uint32_t first_rank;       /* the rank whose registration fixed the spec */
  fsdp_rank_set_t registered;
  unsigned n_registered;
  struct fsdp_unit *next;
} fsdp_unit_t;

typedef struct fsdp_job {
  char name[FSDP_JOB_NAME_MAX + 1];
  uint32_t local_world_size;
  /* The bounded pools (daemon/store/pool.h), capped at max_inflight: the unsharded copies
   * of units that reshard after forward, in shared_arena, each local rank's full-gradient
   * buffers (local_world_size pools) and the host sums of reduces across hosts, in arena. */
  unsigned max_inflight;
  fsdp_pool_t copies;
  fsdp_pool_t *grad_pools;
  fsdp_pool_t sums;
  const fsdp_backend_t *backend; /* whose memory the arenas are: the store's */
  fsdp_staging_t staging; /* host buffers of the rings, where the backend stages them */
  fsdp_job_owner_t owner; /* of the session that created it: whom Attach lets in */
  /* The memory every local rank maps, made on first need, owned: the unsharded buffers in
   * `shared_arena`, sealed so that trainers can only map it read-only, and every other
   * buffer in `arena`, which trainers map read-write. */
  fsdp_arena_t *arena;
  fsdp_arena_t *shared_arena;
  fsdp_unit_t *units; /* in registration order */
  fsdp_unit_t **units_tail;
  unsigned n_units;
  fsdp_unit_t **units_by_id; /* unit i's id is i (its place in registration order) */
  unsigned units_by_id_capacity;
  /* What the data plane does with it (daemon/dataplane/dataplane.h): made and freed with the
   * job through the hooks' job_made and job_freed; the data plane's. */
  struct fsdp_job_flight *flight;
  /* What the checkpoints keep of it (daemon/checkpoints/), NULL until they need it; freed
   * with the job through checkpoints_free, which their maker sets. */
  struct fsdp_job_checkpoints *checkpoints;
  void (*checkpoints_free)(struct fsdp_job_checkpoints *checkpoints);
  /* The optimizer the daemon runs (daemon/dataplane/optimizer.h), NULL without one; freed
   * with the job through optimizer_free, which its maker sets. */
  struct fsdp_optimizer *optimizer;
  void (*optimizer_free)(struct fsdp_optimizer *optimizer);
  /* Loop time since which nothing refers to it (set as its last session ends, or by the
   * housekeeping when its work ends after that); 0 while in use. */
  uint64_t idle_since_ms;
  /* When it went idle among the jobs, from fsdp_store_job_went_idle: the clock counts whole
   * milliseconds, in which several jobs may go idle, and the first of them is still the one
   * idle longest. */
  uint64_t idle_order;
  struct fsdp_job *next;
} fsdp_job_t;

/* Set by the daemon: what the store cannot see itself. */
typedef struct fsdp_store_hooks {
  /* Whether nothing refers to the job (no session, parked call or queued work), so that it
   * may be freed to make room for a new one. */
  bool (*job_idle)(void *data, const fsdp_job_t *job);
  /* Frees such a job (logging `why`), ending with fsdp_store_remove_job(). */
  void (*free_job)(void *data, fsdp_job_t *job, const char *why);
  /* A job or a unit is made, before anything sees it (what made it fails with st when this
   * does), and is about to be freed: the rooms above keep what they do with it beside it
   * (fsdp_job_t.flight, fsdp_unit_t.flight). */
  int (*job_made)(void *data, fsdp_job_t *job, fsdp_status_t *st);
  void (*job_freed)(void *data, fsdp_job_t *job);
  int (*unit_made)(void *data, fsdp_unit_t *unit, fsdp_status_t *st);
  void (*unit_freed)(void *data, fsdp_unit_t *unit);
  /* A rank of an existing job asked for it again (fsdp_store_job_for): its session is there. */
  void (*rank_back)(void *data, fsdp_job_t *job, uint32_t local_rank);
  void *data;
} fsdp_store_hooks_t;

typedef struct fsdp_store {
  fsdp_job_t *jobs;
  unsigned n_jobs;
  /* Set by the daemon: jobs at once (session.max_sessions: jobs cost descriptors), the
   * bytes their arenas may reserve together (memory.limit) and each arena's size
   * (memory.job_limit). */
  unsigned max_jobs;
  size_t memory_limit;
  size_t arena_capacity;
  unsigned max_inflight; /* a new job's (store.max_inflight) */
  const fsdp_backend_t *backend; /* whose memory the arenas are (daemon.backend) */
  size_t reserved; /* the capacities of every job's arenas */
  uint64_t idle_serial; /* the last idle_order given */
  fsdp_store_hooks_t hooks;
  /* Set by the daemon from cluster.*: the hosts, and the local world size every job must
   * have when there are several (0: any). */
  fsdp_topology_t topology;
  uint32_t local_world_size;
} fsdp_store_t;

void fsdp_store_init(fsdp_store_t *store);
/* Frees every job (NULL-safe). */
void fsdp_store_cleanup(fsdp_store_t *store);

/* Who asks for its job: one of its local ranks (a trainer's session, daemon/session/). */
typedef struct fsdp_store_rank {
  const char *job;
  uint32_t local_rank;
  uint32_t local_world_size;
  const fsdp_job_owner_t *owner; /* the job's, if the rank's request creates it */
} fsdp_store_rank_t;

/* Registers spec's unit for the rank, creating the job on first use. Returns the unit
 * (borrowed) whose layout the reply carries. */
int fsdp_store_register_unit(fsdp_store_t *store, const fsdp_store_rank_t *rank,
                             const fsdp_unit_spec_t *spec, fsdp_unit_t **ret_unit,
                             fsdp_status_t *st);

fsdp_job_t *fsdp_store_find_job(const fsdp_store_t *store, const char *name);
/* Records that nothing refers to job any more since now_ms (loop time, not 0): its
 * retention counts from then, and it gives way to a new job after those idle before it. */
void fsdp_store_job_went_idle(fsdp_store_t *store, fsdp_job_t *job, uint64_t now_ms);
fsdp_unit_t *fsdp_store_find_unit(const fsdp_job_t *job, const char *name);
/* The unit whose id (fsdp_unit_t.id) is id, or NULL. */
fsdp_unit_t *fsdp_store_unit_by_id(const fsdp_job_t *job, uint32_t id);
bool fsdp_store_unit_registered_by(const fsdp_unit_t *unit, uint32_t rank);

/* The rank's job, created on first use with its two arenas of store->arena_capacity
 * bytes (no pre-fault: buffers are pre-faulted as they are allocated), freeing retained jobs
 * to make room when needed. FAILED_PRECONDITION if it exists with another local world size,
 * or if its local world size is not cluster.local_world_size; RESOURCE_EXHAUSTED naming the
 * job, its arenas, what jobs in use reserve and the limit when the jobs in use leave no
 * room. A rank of an existing job is back (the hooks' rank_back). */
int fsdp_store_job_for(fsdp_store_t *store, const fsdp_store_rank_t *rank, fsdp_job_t **ret_job,
                       fsdp_status_t *st);

/* Bytes of buffers allocated over every job's arenas. */
size_t fsdp_store_memory_used(const fsdp_store_t *store);

/* Frees a job, its units and arenas. Only when nothing refers to them: no session, no waiting
 * operation, no work queued (daemon/dataplane/dataplane.h says when). */
void fsdp_store_remove_job(fsdp_store_t *store, fsdp_job_t *job);


#endif
