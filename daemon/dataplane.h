/* The host backend's data path: a registered unit's buffers in its job's arena, and the
 * operations on them.
 *
 * Blocking work (pre-faulting new buffers, the casts of an unshard) runs on libuv's thread
 * pool, one item at a time in arrival order, spread over the collectives worker pool; the
 * calls that wait for it are parked (daemon/rpc_server.h) and answered when it is done. Work
 * never runs on the loop thread, and a unit's memory is never freed while the daemon runs,
 * so a work item's pointers stay valid until its completion runs on the loop.
 *
 * Unshard: the first rank to ask starts one gather (the fp32 master shards cast into the
 * unsharded buffer in param_dtype); ranks that ask meanwhile share it; the unit then stays
 * unsharded while any local rank holds it, and the next Unshard after the last Reshard
 * gathers again (the masters may have changed). A session that ends lets go of its holds.
 *
 * ReduceScatter: each rank submits once its full-gradient buffer is written; the last
 * submission queues one reduce of the L buffers (in reduce_dtype, scaled by the gradient
 * factors) into the fp32 gradient shards, and every waiter is answered when it is done.
 *
 * Loop thread only, except inside work items. */
#ifndef FSDP_DATAPLANE_H
#define FSDP_DATAPLANE_H

#include <stdbool.h>

#include <uv.h>

#include "rpc_server.h"
#include "sessions.h"
#include "status.h"
#include "store.h"
#include "workers.h"

typedef struct fsdp_dataplane_work fsdp_dataplane_work_t;

typedef struct fsdp_dataplane {
  uv_loop_t *loop;
  fsdp_workers_t *workers;
  uv_work_t req;
  fsdp_dataplane_work_t *head, *tail; /* head is running while busy */
  bool busy;
} fsdp_dataplane_t;

/* threads: the worker pool's size, the calling pool thread included. */
int fsdp_dataplane_init(fsdp_dataplane_t *dp, uv_loop_t *loop, unsigned threads,
                        fsdp_status_t *st);
/* Once the loop has ended: no work is in flight then. */
void fsdp_dataplane_cleanup(fsdp_dataplane_t *dp);

/* Answers a RegisterUnit the store accepted for `session`'s rank: with the layout and the
 * buffers' offsets once the unit's buffers are ready. The first registration takes them from
 * the job's arenas (arena_capacity: their size if the job has none yet; memory_free: what
 * memory.limit leaves over all jobs) and pre-faults them. */
void fsdp_dataplane_register(fsdp_dataplane_t *dp, fsdp_rpc_call_t *call, fsdp_job_t *job,
                             fsdp_unit_t *unit, const fsdp_session_t *session,
                             size_t arena_capacity, size_t memory_free);

/* Unshard and Reshard of `unit` for the session's rank. */
void fsdp_dataplane_unshard(fsdp_dataplane_t *dp, fsdp_rpc_call_t *call, fsdp_job_t *job,
                            fsdp_unit_t *unit, const fsdp_session_t *session);
void fsdp_dataplane_reshard(fsdp_rpc_call_t *call, fsdp_unit_t *unit,
                            const fsdp_session_t *session);

/* ReduceScatter (and AllReduce of a NO_SHARD unit) for the session's rank: parks the call
 * until every local rank has submitted for rq->step, then reduces on the worker pool. Ranks
 * that do not submit within timeout_ms of the first are named in the ABORTED every waiter
 * gets (fsdp_dataplane_expire). */
void fsdp_dataplane_reduce(fsdp_dataplane_t *dp, fsdp_rpc_call_t *call, fsdp_job_t *job,
                           fsdp_unit_t *unit, const fsdp_session_t *session,
                           const Fsdp__V1__UnitOpRequest *rq, uint64_t now_ms,
                           uint64_t timeout_ms);

/* Ends reduce-scatters whose deadline passed; from the housekeeping timer. */
void fsdp_dataplane_expire(fsdp_store_t *store, uint64_t now_ms);

/* Whether any queued or running work, or any parked call, refers to the job. */
bool fsdp_dataplane_uses_job(const fsdp_dataplane_t *dp, const fsdp_job_t *job);

/* A session of `job` ended (why: for the messages): its rank lets go of every unit it held
 * unsharded, and reduce-scatters waiting for it end with ABORTED naming it. */
void fsdp_dataplane_release_rank(fsdp_job_t *job, uint32_t rank, const char *why);

#endif
