/* Rings among hosts.
 *
 * A reduce's local work rides on its rings' hooks, chunk by chunk, so it overlaps the
 * transfers: the first ring (the reduce-scatter among the shard group, or the all-reduce
 * among replicas when the group is this host alone) produces each chunk of the host sum
 * from the local ranks' full gradients (the host-level pre-reduction: one contribution per
 * host leaves it); the last ring finalizes each chunk of this host's region into its
 * ranks' gradient shards (the post-reduction). A gather casts its region first and then
 * starts its ring: the cast is a copy at memory speed, and feeding it through the hooks
 * cost more in round trips to the thread pool than it hid (docs/PERFORMANCE.md). */
#include "daemon/dataplane/internal.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "collectives/local.h"
#include "collectives/ring.h"
#include "common/log.h"
#include "proto/host/formats.h"

static void on_cluster_ready(void *data, int status, const char *why);
static void on_sum_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st);

typedef struct ring_run {
  fsdp_dataplane_t *dp;
  fsdp_job_t *job;
  fsdp_unit_t *unit;
  fsdp_ring_kind_t kind;
  /* The all-reduce among the shard group of the unit's part of the gradient's squared norm
   * (clipping): one fp32 element per member, this host's part in the first, summed there.
   * Not registered with UCX: a few bytes, and the run's own. */
  bool norm;
  float norm_parts[FSDP_RING_MAX];
  uint64_t first_elem;   /* the unit's element at the start of the ring's buffer */
  uint64_t region_numel; /* elements per region of the ring */
  size_t elem_size;      /* of the ring's dtype */
  void *scratch;         /* a sum's staging buffer, from the pool */
  uint64_t generation;   /* the run of the job it belongs to */
  fsdp_ring_t *ring;     /* once started, until it ends */
  bool superseded;       /* cancelled: a newer run of the job began */
  struct ring_run *next; /* while waiting for the cluster, then among the running */
} ring_run_t;

/* The unit's element at the start of a ring chunk. */
static uint64_t chunk_elem(const ring_run_t *run, unsigned region, size_t offset) {
  return run->first_elem + region * run->region_numel + offset / run->elem_size;
}

/* On a pool thread: a chunk of the host sum, from the local ranks' full gradients (in fp32,
 * then in reduce_dtype when that is narrower), divided by the predivide factor. */
static int produce_host_sum(void *arg, unsigned region, size_t offset, size_t bytes) {
  ring_run_t *run = arg;
  const fsdp_unit_t *u = run->unit;
  uint64_t e = chunk_elem(run, region, offset);
  size_t n = bytes / run->elem_size;
  int r = dp_host_sum_runs(run->job, u, e, e + n);
  /* The all-reduce among replicas of a host that is its own shard group: the host sum is
   * the group's, and the deferred one joins it here. */
  if (r == 0 && run->kind == FSDP_RING_ALL_REDUCE && u->flight->has_deferred)
    r = dp_add_deferred(run->job, u, e, e + n);
  return r;
}

/* On a pool thread: a final chunk of this host's region of the shard group's sum, kept
 * (a deferred reduce) or joined by the deferred sum before the all-reduce among replicas. */
static int keep_group_sum(void *arg, unsigned region, size_t offset, size_t bytes) {
  ring_run_t *run = arg;
  uint64_t e = chunk_elem(run, region, offset);
  return dp_keep_deferred(run->job, run->unit, e, e + bytes / run->elem_size);
}

static int add_to_group_sum(void *arg, unsigned region, size_t offset, size_t bytes) {
  ring_run_t *run = arg;
  uint64_t e = chunk_elem(run, region, offset);
  return dp_add_deferred(run->job, run->unit, e, e + bytes / run->elem_size);
}

/* On a pool thread: a final chunk of this host's region of the sum, divided by the
 * postdivide factor into (or onto, when accumulating) the ranks' fp32 gradient shards. */
static int finalize_grads(void *arg, unsigned region, size_t offset, size_t bytes) {
  ring_run_t *run = arg;
  const fsdp_unit_t *u = run->unit;
  uint64_t e = chunk_elem(run, region, offset);
  float *grads = (float *)(void *)((char *)fsdp_arena_base(run->job->arena) + u->grad_offset);
  const void *sum = (const char *)dp_host_sum(run->job, u) + e * run->elem_size;
  return fsdp_reduce(grads + (e - host_first(u)), u->flight->reduce_accumulate, &sum, 1,
                     reduce_dtype(u), reduce_dtype(u), 1.0f, u->post_scale,
                     bytes / run->elem_size);
}

/* Rings move 1 MiB chunks, 8 in flight; a sum stages what it receives in a buffer of that
 * size. The buffers are kept for the next ring once faulted in: no collective faults fresh
 * pages. */
#define RING_CHUNK ((size_t)1 << 20)
#define RING_WINDOW 8u
#define RING_SCRATCH (RING_CHUNK * RING_WINDOW)

static void *take_scratch(fsdp_dataplane_t *dp) {
  void *s = dp->free_scratch;
  if (s) {
    memcpy(&dp->free_scratch, s, sizeof(void *));
    return s;
  }
  if (posix_memalign(&s, 4096, RING_SCRATCH) != 0)
    return NULL;
  memset(s, 0, RING_SCRATCH);
  return s;
}

static void give_back_scratch(fsdp_dataplane_t *dp, void *s) {
  if (!s)
    return;
  memcpy(s, &dp->free_scratch, sizeof(void *));
  dp->free_scratch = s;
}

/* The same on every host, different for every collective that may run at once: the job,
 * its run (generation), the unit, the step (and whether this is its second gather) and the
 * ring. A failed ring can leave messages
 * unmatched at a host (UCX matches tags worker-wide, whoever sent them); the run keeps them
 * from the rings of the job's next run, which redoes the same steps. */
static uint32_t ring_op_id(const ring_run_t *run, const fsdp_collection_t *c) {
  const fsdp_job_t *job = run->job;
  const fsdp_unit_t *u = run->unit;
  uint32_t op_kind = run->norm                                            ? FSDP_OP_KIND_NORM
                     : run->kind == FSDP_RING_ALL_GATHER && c->regather ? FSDP_OP_KIND_REGATHER
                                                                        : (uint32_t)run->kind;
  return fsdp_op_id(job->name, u->spec->unit, c->step, c->generation, op_kind);
}

static waiter_kind_t ring_waiter_kind(fsdp_ring_kind_t kind) {
  return kind == FSDP_RING_ALL_GATHER ? WAIT_UNSHARD : WAIT_REDUCE;
}

/* Takes run out of the list it is in (NULL-terminated through next). */
static void unlink_run(ring_run_t **list, const ring_run_t *run) {
  for (ring_run_t **p = list; *p; p = &(*p)->next)
    if (*p == run) {
      *p = run->next;
      return;
    }
}

/* Why a run of an older generation ends, into st. */
static void superseded(const ring_run_t *run, fsdp_status_t *st) {
  fsdp_status_set(st, FSDP_E_ABORTED,
                  "job '%s' unit '%s' step %llu: generation %llu's %s ended: generation %llu "
                  "of the job began",
                  run->job->name, run->unit->spec->unit,
                  (unsigned long long)collection_of(run->unit, ring_waiter_kind(run->kind))->step,
                  (unsigned long long)run->generation, fsdp_ring_kind_name(run->kind),
                  (unsigned long long)run->job->flight->generation);
}

static void on_ring_done(fsdp_ring_t *ring, const fsdp_status_t *status, void *arg) {
  ring_run_t *run = arg;
  fsdp_unit_t *u = run->unit;
  unlink_run(&run->dp->running_rings, run);
  u->flight->ring_sent_bytes += fsdp_ring_bytes_sent(ring);
  give_back_scratch(run->dp, run->scratch);
  if (status->code < 0) {
    fsdp_status_t st;
    if (run->superseded && status->code == FSDP_E_CANCELLED)
      superseded(run, &st);
    else
      fsdp_status_set(&st, status->code, "job '%s' unit '%s' step %llu: %s", run->job->name,
                      u->spec->unit,
                      (unsigned long long)collection_of(u, ring_waiter_kind(run->kind))->step,
                      status->message);
    dp_finish_collective(run->job, u, ring_waiter_kind(run->kind), &st);
  } else if (run->norm) {
    dp_norm_known(run->dp, run->job, u, run->norm_parts[0]);
  } else {
    if (run->kind == FSDP_RING_ALL_REDUCE)
      u->flight->replica_all_reduces++;
    dp_next_stage(run->dp, run->job, u, -1, (int)run->kind);
  }
  free(run);
}

/* The arena's bytes, for forgetting what was registered in it. */
static size_t arena_capacity(const fsdp_arena_t *arena) {
  fsdp_arena_stats_t stats;
  fsdp_arena_get_stats(arena, &stats);
  return stats.capacity;
}

/* The run's collective ends with st, and the run with it. */
static void fail_run(ring_run_t *run, const fsdp_status_t *st) {
  dp_finish_collective(run->job, run->unit, ring_waiter_kind(run->kind), st);
  free(run);
}

/* The hosts of the run's ring: the replicas for an all-reduce of gradients, else the shard
 * group. */
static const fsdp_host_ring_t *ring_hosts(const ring_run_t *run) {
  return run->kind == FSDP_RING_ALL_REDUCE && !run->norm ? &run->unit->plan.replica_ring
                                                         : &run->unit->plan.shard_ring;
}

/* The other hosts' endpoints, into peers: 0 when every one is connected; 1 when the run
 * waits for the cluster to be joined (on_cluster_ready starts it again); -1 when a host is
 * missing for good, the run ended then. */
static int connect_ring(ring_run_t *run, fsdp_ucx_peer_t *peers[FSDP_RING_MAX]) {
  fsdp_dataplane_t *dp = run->dp;
  const fsdp_host_ring_t *hosts = ring_hosts(run);
  for (unsigned i = 0; i < hosts->members; i++) {
    const char *why = "the data plane is not running";
    unsigned host = fsdp_host_ring_host(hosts, i);
    if (i == hosts->self || (dp->fabric && (peers[i] = fsdp_fabric_peer(dp->fabric, host, &why))))
      continue;
    if (dp->peers && !fsdp_peers_ready(dp->peers)) {
      run->next = dp->cluster_waiting;
      dp->cluster_waiting = run;
      if (!dp->waiting_for_cluster) {
        dp->waiting_for_cluster = true;
        fsdp_peers_when_ready(dp->peers, &dp->cluster_waiter, on_cluster_ready, dp);
      }
      return 1;
    }
    fsdp_status_t st;
    fsdp_status_set(&st, FSDP_E_UNAVAILABLE,
                    "job '%s' unit '%s' step %llu: the %s needs host %u: %s", run->job->name,
                    run->unit->spec->unit,
                    (unsigned long long)collection_of(run->unit, ring_waiter_kind(run->kind))->step,
                    fsdp_ring_kind_name(run->kind), host, why);
    fail_run(run, &st);
    return -1;
  }
  return 0;
}

/* What the ring moves: sets the run's element size, its first element and its regions'
 * length, and says where the buffer starts, and its registration with UCX (NULL for the
 * norm's few bytes). The unit's buffer the rings move (its unsharded copy or its host sum)
 * is registered once, on its first ring, and stays so until its job goes; only that, since
 * registering pins memory on RDMA transports, and an arena is mostly not in use. */
static char *ring_buffer(ring_run_t *run, fsdp_dtype_t *ret_dtype,
                         const fsdp_ucx_mem_t **ret_mem) {
  fsdp_unit_t *u = run->unit;
  bool gather = run->kind == FSDP_RING_ALL_GATHER;
  if (run->norm) {
    *ret_dtype = FSDP_DTYPE_FP32;
    *ret_mem = NULL;
    run->elem_size = sizeof run->norm_parts[0];
    run->first_elem = 0;
    run->region_numel = 1;
    return (char *)run->norm_parts;
  }
  *ret_dtype = gather ? param_dtype(u) : reduce_dtype(u);
  run->elem_size = fsdp_dtype_size(*ret_dtype);
  run->region_numel = host_numel(u);
  if (run->kind == FSDP_RING_ALL_REDUCE) { /* this host's region, among its replicas */
    run->first_elem = host_first(u);
    run->region_numel /= ring_hosts(run)->members;
  }
  fsdp_staging_buffer_t *stage = gather ? u->flight->gather_stage : u->flight->sum_stage;
  char *whole = stage ? stage->base
                : gather ? (char *)fsdp_arena_base(run->job->shared_arena) + u->flight->copy_offset
                         : dp_host_sum(run->job, u);
  /* A staging buffer is registered whole: one registration whatever unit it serves. */
  *ret_mem = fsdp_fabric_memory(run->dp->fabric, whole,
                                stage ? stage->bytes : u->layout.padded_numel * run->elem_size);
  return whole + run->first_elem * run->elem_size;
}

/* The reduce's first ring makes the host sum, its last one writes the gradient shards; a
 * reduce-scatter followed by an all-reduce keeps its result for a later one, or adds what
 * was kept, when the all-reduce is deferred. Where the rings are staged, the host sum is
 * made and the shards written by the work around them (staged.c). */
static void reduce_hooks(const ring_run_t *run, fsdp_ring_args_t *args) {
  const fsdp_unit_t *u = run->unit;
  if (run->kind == FSDP_RING_ALL_GATHER || run->norm)
    return;
  bool staged = u->flight->sum_stage != NULL;
  bool first_of_reduce = run->kind == FSDP_RING_REDUCE_SCATTER || u->plan.shard_ring.members == 1;
  bool last_of_reduce = run->kind == FSDP_RING_ALL_REDUCE || u->plan.replica_ring.members == 1;
  args->produce = first_of_reduce && !staged ? produce_host_sum : NULL;
  args->finalize = last_of_reduce  ? (staged ? NULL : finalize_grads) /* else WORK_UNSTAGE_SUM */
                   : u->flight->reduce_defer ? keep_group_sum
                   : u->flight->has_deferred ? add_to_group_sum
                                     : NULL;
}

/* Starts a ring of the unit's collective once the hosts it needs are connected; while the
 * cluster is still joining, it waits for it (at most peer.join_timeout after start). */
static void start_run(ring_run_t *run) {
  fsdp_dataplane_t *dp = run->dp;
  fsdp_unit_t *u = run->unit;
  const fsdp_collection_t *c = collection_of(u, ring_waiter_kind(run->kind));
  fsdp_ucx_peer_t *peers[FSDP_RING_MAX] = {0};
  fsdp_status_t st;
  if (run->generation < run->job->flight->generation) {
    superseded(run, &st); /* its hosts go on with the newer run, never with this one */
    fail_run(run, &st);
    return;
  }
  if (connect_ring(run, peers) != 0)
    return;
  fsdp_ring_args_t args = {.kind = run->kind, .hook_arg = run};
  args.buf = ring_buffer(run, &args.dtype, &args.buf_mem);
  if (run->kind != FSDP_RING_ALL_GATHER && !(run->scratch = take_scratch(dp))) {
    fsdp_status_set(&st, FSDP_E_RESOURCE_EXHAUSTED,
                    "job '%s' unit '%s' step %llu: out of memory for the %s's staging buffer",
                    run->job->name, u->spec->unit, (unsigned long long)c->step,
                    fsdp_ring_kind_name(run->kind));
    fail_run(run, &st);
    return;
  }
  const fsdp_host_ring_t *hosts = ring_hosts(run);
  args.n = hosts->members;
  args.self = hosts->self;
  args.peers = peers;
  args.region_bytes = run->region_numel * run->elem_size;
  args.op_id = ring_op_id(run, c);
  args.deadline_ms = uv_now(dp->loop) + dp->collective_timeout_ms;
  args.chunk_bytes = RING_CHUNK;
  args.window = RING_WINDOW;
  if (run->scratch) {
    args.scratch = run->scratch;
    args.scratch_bytes = RING_SCRATCH;
    args.scratch_mem = fsdp_fabric_memory(dp->fabric, run->scratch, RING_SCRATCH);
  }
  reduce_hooks(run, &args);
  if (fsdp_ring_start(fsdp_fabric_ucx(dp->fabric), &args, on_ring_done, run, &run->ring, &st) <
      0) {
    give_back_scratch(dp, run->scratch);
    fail_run(run, &st);
    return;
  }
  run->next = dp->running_rings;
  dp->running_rings = run;
}

/* A run like `proto`, started. */
static void launch_run(const ring_run_t *proto) {
  ring_run_t *run = malloc(sizeof *run);
  if (!run) {
    dp_abort_collection(proto->job, proto->unit, ring_waiter_kind(proto->kind),
                        FSDP_E_RESOURCE_EXHAUSTED,
                        "out of memory starting a collective among hosts");
    return;
  }
  *run = *proto;
  run->generation = collection_of(run->unit, ring_waiter_kind(run->kind))->generation;
  start_run(run);
}

void dp_start_ring(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                   fsdp_ring_kind_t kind) {
  launch_run(&(ring_run_t){.dp = dp, .job = job, .unit = u, .kind = kind});
}

void dp_start_norm_ring(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                        double part) {
  launch_run(&(ring_run_t){.dp = dp, .job = job, .unit = u, .kind = FSDP_RING_ALL_REDUCE,
                           .norm = true, .norm_parts = {(float)part}});
}

static void on_cluster_ready(void *data, int status, const char *why) {
  fsdp_dataplane_t *dp = data;
  ring_run_t *runs = dp->cluster_waiting;
  dp->cluster_waiting = NULL;
  dp->waiting_for_cluster = false;
  while (runs) {
    ring_run_t *run = runs;
    runs = run->next;
    if (status == 0) {
      start_run(run);
      continue;
    }
    fsdp_unit_t *u = run->unit;
    fsdp_status_t st;
    fsdp_status_set(&st, status, "job '%s' unit '%s' step %llu: the hosts did not all join: %s",
                    run->job->name, u->spec->unit,
                    (unsigned long long)collection_of(u, ring_waiter_kind(run->kind))->step, why);
    fail_run(run, &st);
  }
}

void dp_supersede_rings(fsdp_dataplane_t *dp, fsdp_job_t *job) {
  uint64_t generation = job->flight->generation;
  for (ring_run_t *run = dp->running_rings; run; run = run->next)
    if (run->job == job && run->generation < generation && !run->superseded) {
      run->superseded = true;
      fsdp_ring_cancel(run->ring); /* on_ring_done ends it, later */
    }
  for (ring_run_t **p = &dp->cluster_waiting; *p;) {
    ring_run_t *run = *p;
    if (run->job != job || run->generation >= generation) {
      p = &run->next;
      continue;
    }
    *p = run->next;
    fsdp_status_t st;
    superseded(run, &st);
    fail_run(run, &st);
  }
}

/* Before a reduce across hosts runs: a deferred sum of another run is dropped; a reduce
 * that defers makes the block when it is the first, and one that does not writes the
 * gradient shards only if every deferred reduce it takes in asked to accumulate too. */
static int prepare_deferred(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u,
                            fsdp_status_t *st) {
  const fsdp_collection_t *c = &u->flight->reduce;
  if (u->flight->has_deferred && u->flight->deferred_generation != c->generation) {
    log_warning("unit '%s': the gradients of %u reduces of generation %llu that deferred "
                "their all-reduce among replicas are dropped: generation %llu runs now",
                u->spec->unit, u->flight->n_deferred, (unsigned long long)u->flight->deferred_generation,
                (unsigned long long)c->generation);
    dp_drop_deferred(job, u);
  }
  if (!u->flight->reduce_defer) {
    if (u->flight->has_deferred)
      u->flight->reduce_accumulate = u->flight->reduce_accumulate && u->flight->deferred_accumulate;
    return 0;
  }
  if (u->flight->has_deferred) {
    u->flight->deferred_accumulate = u->flight->deferred_accumulate && u->flight->reduce_accumulate;
    return 0;
  }
  size_t bytes = round64((size_t)host_numel(u) * fsdp_dtype_size(reduce_dtype(u)));
  int r = stages_rings(job) ? dp_take_stage(dp, job, bytes, &u->flight->deferred_stage, st)
                            : fsdp_arena_alloc(job->arena, bytes, 64, &u->flight->deferred_offset, st);
  if (r < 0)
    return fsdp_status_set(st, r, "unit '%s' step %llu: no room to keep the gradients whose "
                           "all-reduce among replicas is deferred: %s",
                           u->spec->unit, (unsigned long long)c->step, st->message);
  u->flight->has_deferred = true;
  u->flight->deferred_generation = c->generation;
  u->flight->deferred_accumulate = u->flight->reduce_accumulate;
  return 0;
}

void dp_start_reduce_rings(fsdp_dataplane_t *dp, fsdp_job_t *job, fsdp_unit_t *u) {
  u->flight->sum_waiter.data = dp;
  uint64_t offset = 0;
  fsdp_status_t st = FSDP_STATUS_INIT;
  int r = fsdp_pool_take(&job->sums, dp_host_sum_bytes(u), &u->flight->sum_waiter, on_sum_ready, &offset,
                         &st);
  if (r == 1)
    return; /* on_sum_ready goes on */
  on_sum_ready(&u->flight->sum_waiter, offset, &st);
}

static void on_sum_ready(fsdp_pool_waiter_t *waiter, uint64_t offset, const fsdp_status_t *st) {
  fsdp_unit_t *u =
      ((fsdp_unit_flight_t *)((char *)waiter - offsetof(fsdp_unit_flight_t, sum_waiter)))->unit;
  if (st->code < 0) {
    fsdp_status_t failed;
    fsdp_status_set(&failed, st->code, "unit '%s' step %llu: no host sum: %s", u->spec->unit,
                    (unsigned long long)u->flight->reduce.step, st->message);
    dp_finish_collective(u->job, u, WAIT_REDUCE, &failed);
    return;
  }
  u->flight->has_sum = true;
  u->flight->sum_offset = offset;
  fsdp_status_t deferred;
  if (prepare_deferred(waiter->data, u->job, u, &deferred) < 0) {
    dp_finish_collective(u->job, u, WAIT_REDUCE, &deferred);
    return;
  }
  if (stages_rings(u->job)) {
    size_t bytes = (size_t)u->layout.padded_numel * fsdp_dtype_size(reduce_dtype(u));
    fsdp_status_t staged;
    if (dp_take_stage(waiter->data, u->job, bytes, &u->flight->sum_stage, &staged) < 0) {
      fsdp_status_set(&staged, staged.code, "unit '%s' step %llu: no staged host sum: %s",
                      u->spec->unit, (unsigned long long)u->flight->reduce.step, staged.message);
      dp_finish_collective(u->job, u, WAIT_REDUCE, &staged);
      return;
    }
    dp_queue_or_abort(waiter->data, WORK_STAGE_SUM, u->job, u);
  } else if (u->plan.shard_ring.members > 1) {
    dp_start_ring(waiter->data, u->job, u, FSDP_RING_REDUCE_SCATTER);
  } else if (!u->flight->reduce_defer) {
    dp_start_ring(waiter->data, u->job, u, FSDP_RING_ALL_REDUCE);
  } else {
    int r = dp_queue(waiter->data, WORK_DEFER, u->job, u);
    if (r < 0)
      dp_abort_collection(u->job, u, WAIT_REDUCE, r, "cannot queue the deferred reduce");
  }
}

void fsdp_dataplane_forget_job(fsdp_dataplane_t *dp, const fsdp_job_t *job) {
  const fsdp_arena_t *arenas[] = {job->arena, job->shared_arena};
  for (size_t i = 0; i < 2; i++)
    if (dp->fabric && arenas[i])
      fsdp_fabric_forget_memory(dp->fabric, fsdp_arena_base(arenas[i]),
                                arena_capacity(arenas[i]));
  for (const fsdp_staging_buffer_t *b = job->staging.buffers; b; b = b->next)
    dp_forget_staging(dp, b->base, b->bytes);
}

void fsdp_dataplane_set_cluster(fsdp_dataplane_t *dp, fsdp_peers_t *peers, fsdp_fabric_t *fabric,
                                uint64_t collective_timeout_ms) {
  if (dp->waiting_for_cluster && dp->peers && peers != dp->peers) {
    fsdp_peers_wait_cancel(dp->peers, &dp->cluster_waiter);
    on_cluster_ready(dp, FSDP_E_CANCELLED, "the daemon is stopping");
  }
  dp->peers = peers;
  dp->fabric = fabric;
  dp->collective_timeout_ms = collective_timeout_ms;
}
