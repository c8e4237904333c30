/* The host backend's data path: a registered unit's buffers in its job's arena, and the
 * operations on them.
 *
 * Blocking work (pre-faulting new buffers, the casts of an unshard) runs on libuv's thread
 * pool, one item at a time in arrival order, spread over the collectives worker pool; the
 * calls that wait for it are parked (daemon/rpc/rpc_server.h) and answered when it is done. Work
 * never runs on the loop thread, and a unit's memory is never freed while the daemon runs,
 * so a work item's pointers stay valid until its completion runs on the loop.
 *
 * Unshard is a collective of the job's local ranks, like FSDP's all-gather: a rank asking
 * for step s says its master shards are final for s. Once every local rank has asked for s,
 * one gather (the fp32 master shards cast into the unsharded buffer in param_dtype) runs and
 * answers them all. The buffer then holds step s until the gather of a newer step, so an
 * Unshard of s after a Reshard (FULL_SHARD's backward) is answered at once; an older step
 * is refused. Reshard only checks the unit: the host backend keeps the buffer.
 *
 * ReduceScatter is the same kind of collective: each rank submits once its full-gradient
 * buffer is written; the last submission queues one reduce of the L buffers (in
 * reduce_dtype, scaled by the gradient factors) into the fp32 gradient shards, and every
 * waiter is answered when it is done.
 *
 * Across hosts, the cast of a gather is followed by an all-gather among the hosts; a reduce
 * is rings among the hosts (see dataplane.c) that do its local work chunk by chunk on the
 * thread pool while the transfers run: the pre-reduction of the L gradients into a host
 * sum, the post-reduction of this host's region into the gradient shards.
 *
 * A collective names one step; a rank asking for another step than the others aborts it
 * for all. Ranks that do not ask within the deadline of the first (store.collective_timeout)
 * are named in the ABORTED every waiter gets (fsdp_dataplane_expire), and so is a rank whose
 * session ends (fsdp_dataplane_release_session). A parked call keeps its session alive
 * (fsdp_session_call_parked) until it is answered.
 *
 * Loop thread only, except inside work items. */
#ifndef FSDP_DATAPLANE_H
#define FSDP_DATAPLANE_H

#include <stdbool.h>

#include <uv.h>

#include "fsdp/v1/trainer.pb-c.h"

#include "common/status.h"
#include "daemon/cluster/fabric.h"
#include "daemon/cluster/peers.h"
#include "daemon/rpc/rpc_server.h"
#include "daemon/session/sessions.h"
#include "daemon/store/store.h"
#include "kernels/workers.h"

typedef struct fsdp_dataplane_work fsdp_dataplane_work_t;

typedef struct ring_run ring_run_t;

typedef struct fsdp_dataplane {
  uv_loop_t *loop;
  fsdp_workers_t *workers;
  uv_work_t req;
  fsdp_dataplane_work_t *head, *tail; /* head is running while busy */
  bool busy;
  /* Across hosts (fsdp_dataplane_set_cluster): the peers, the connections to them, and the
   * rings waiting for the cluster to be joined. */
  fsdp_peers_t *peers;
  fsdp_fabric_t *fabric;
  uint64_t collective_timeout_ms; /* each ring's deadline after it starts */
  ring_run_t *cluster_waiting;
  fsdp_peers_waiter_t cluster_waiter;
  bool waiting_for_cluster;
  void *free_scratch; /* the rings' staging buffers not in use, linked through their start */
} fsdp_dataplane_t;

/* threads: the worker pool's size, the calling pool thread included. */
int fsdp_dataplane_init(fsdp_dataplane_t *dp, uv_loop_t *loop, unsigned threads,
                        fsdp_status_t *st);
/* Once the loop has ended: no work is in flight then. */
void fsdp_dataplane_cleanup(fsdp_dataplane_t *dp);

/* The other hosts: peers (borrowed; one host: no fabric) and the deadline of a collective
 * among hosts once it starts. Again with NULLs when they close. */
void fsdp_dataplane_set_cluster(fsdp_dataplane_t *dp, fsdp_peers_t *peers, fsdp_fabric_t *fabric,
                                uint64_t collective_timeout_ms);

/* Answers a RegisterUnit the store accepted for `session`'s rank: with the layout and the
 * buffers' offsets once the unit's buffers are ready. The first registration takes them from
 * the job's arenas (reserved against memory.limit as a whole when the job was made) and
 * pre-faults them. */
void fsdp_dataplane_register(fsdp_dataplane_t *dp, fsdp_rpc_call_t *call, fsdp_job_t *job,
                             fsdp_unit_t *unit, fsdp_session_t *session);

/* Unshard of `unit` for the session's rank at rq->step; deadline_ms: loop time by which
 * every local rank must have asked, if this call starts the collective. */
void fsdp_dataplane_unshard(fsdp_dataplane_t *dp, fsdp_rpc_call_t *call, fsdp_job_t *job,
                            fsdp_unit_t *unit, fsdp_session_t *session,
                            const Fsdp__V1__UnitOpRequest *rq, uint64_t deadline_ms);

/* Reshard: answered at once once the unit has buffers. */
void fsdp_dataplane_reshard(fsdp_rpc_call_t *call, const fsdp_unit_t *unit);

/* ReduceScatter (and AllReduce of a NO_SHARD unit) for the session's rank at rq->step, with
 * rq->accumulate; deadline_ms as for Unshard. */
void fsdp_dataplane_reduce(fsdp_dataplane_t *dp, fsdp_rpc_call_t *call, fsdp_job_t *job,
                           fsdp_unit_t *unit, fsdp_session_t *session,
                           const Fsdp__V1__UnitOpRequest *rq, uint64_t deadline_ms);

/* Ends collectives whose deadline passed; from the housekeeping timer. */
void fsdp_dataplane_expire(fsdp_store_t *store, uint64_t now_ms);

/* Whether any queued or running work, or any parked call, refers to the job. */
bool fsdp_dataplane_uses_job(const fsdp_dataplane_t *dp, const fsdp_job_t *job);

/* Before the job's memory goes (nothing may use it: fsdp_dataplane_uses_job is false):
 * releases its registrations with the transport. */
void fsdp_dataplane_forget_job(fsdp_dataplane_t *dp, const fsdp_job_t *job);

/* A session of `job` ended (why: for the messages), before it is freed; next_serial: the
 * serial the next session will get. Its own parked calls end with ABORTED naming it, even in
 * a collective already running, so that no call is answered OK for a session that ended.
 * Collectives waiting for its rank end with ABORTED naming it, and so do those that sessions
 * older than its end start until the rank attaches again (its session reaches the store:
 * fsdp_store_job_for). */
void fsdp_dataplane_release_session(fsdp_job_t *job, fsdp_session_t *session, const char *why,
                                    uint64_t next_serial);

#endif
