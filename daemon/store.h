/* The parameter store's registry: jobs and their units.
 *
 * A job is created by the first RegisterUnit or memory channel of any of its ranks and
 * outlives its trainers' sessions, with its arena: parameters stay in the daemon when a
 * trainer dies, so that it can attach again and go on. A unit is registered by every local
 * rank of its job with the same spec; the first registration fixes the spec and the layout,
 * a later one either matches it (and only records that the rank registered) or is refused
 * naming the first differing field, both values and both ranks.
 *
 * Owned by the daemon, loop thread only. */
#ifndef FSDP_STORE_H
#define FSDP_STORE_H

#include <stdbool.h>
#include <stdint.h>

#include "fsdp/v1/trainer.pb-c.h"

#include "arena.h"
#include "sessions.h"
#include "status.h"
#include "unit_layout.h"

typedef struct fsdp_unit {
  Fsdp__V1__RegisterUnitRequest *spec; /* private copy, session_id cleared; owned */
  fsdp_unit_layout_t layout;
  uint32_t first_rank;       /* the rank whose registration fixed the spec */
  uint64_t registered[FSDP_LOCAL_WORLD_MAX / 64]; /* bit r: local rank r registered */
  unsigned n_registered;
  struct fsdp_unit *next;
} fsdp_unit_t;

typedef struct fsdp_job {
  char name[FSDP_JOB_NAME_MAX + 1];
  uint32_t local_world_size;
  fsdp_arena_t *arena; /* the memory every local rank maps; made on first need; owned */
  fsdp_unit_t *units; /* in registration order */
  fsdp_unit_t **units_tail;
  unsigned n_units;
  struct fsdp_job *next;
} fsdp_job_t;

typedef struct fsdp_store {
  fsdp_job_t *jobs;
  unsigned n_jobs;
} fsdp_store_t;

void fsdp_store_init(fsdp_store_t *store);
void fsdp_store_cleanup(fsdp_store_t *store);

/* Registers rq's unit for the session's rank, creating the job on first use. Returns the
 * unit (borrowed) whose layout the reply carries. */
int fsdp_store_register_unit(fsdp_store_t *store, const fsdp_session_t *session,
                             const Fsdp__V1__RegisterUnitRequest *rq, fsdp_unit_t **ret_unit,
                             fsdp_status_t *st);

fsdp_job_t *fsdp_store_find_job(const fsdp_store_t *store, const char *name);

/* The session's job, created on first use; FAILED_PRECONDITION if it exists with another
 * local world size. */
int fsdp_store_job_for(fsdp_store_t *store, const fsdp_session_t *session, fsdp_job_t **ret_job,
                       fsdp_status_t *st);

/* Shards of a unit on this host: the local world size, or 1 for NO_SHARD. */
unsigned fsdp_store_shard_count(Fsdp__V1__ShardingStrategy strategy, uint32_t local_world_size);

#endif
