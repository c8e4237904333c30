/* Recovery without a checkpoint (store.recover_from_replicas). With HYBRID_SHARD the hosts
 * of the other replica groups hold this host's shards (a unit's replica ring): their masters,
 * optimizer state and step are this host's. A daemon that starts empty in such a job asks
 * them, as the job's first unit registers, whether they hold it trained; if one does, the
 * job goes on after that host's step, and at its first gather this host's state is copied
 * from that host's memory: the replica takes a snapshot of the job as a save does, sends it
 * over UCX to the daemon that asked (the one it joined at that host rank), and answers with
 * the snapshot's checksum; this host checks it and loads it as a resume loads a checkpoint.
 * No disk is read.
 *
 * Both sides of Peer.Recover (decoded by the Peer service, sent by the peer table): the
 * asking host's look and fetch, and the replica's answers. Loop thread, but for the
 * checksum of what arrived, on the pool. */
#include "daemon/checkpoints/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "common/clock.h"
#include "common/log.h"

/* How often a look asks again while a replica cannot say yet (it resumes itself, or did
 * not answer). */
#define LOOK_RETRY_MS 200

/* The UCX side of a state sent or fetched, and what each side waits for. */
typedef struct replica_io {
  fsdp_checkpoints_t *cp;
  checkpoint_work_t *c;
  fsdp_dataplane_transfer_t *transfer; /* while it runs */
  size_t bytes;
  /* The replica's snapshot, in memory of its own rather than the job's staging memory, so
   * that it waits for no save of the job (and none for it); freed with the work. */
  void *snapshot;
  uint64_t start_ns;
  /* The replica's: the time by which the state must be taken (loop time), whether the
   * host that asked went away meanwhile (then nothing is sent), and who hears the end. */
  uint64_t deadline_ms;
  bool abandoned;
  fsdp_checkpoints_sent_fn sent;
  void *sent_data;
  /* The fetch's: its two halves, the receive and the Recover call, end in either order. */
  bool received, answered;
  fsdp_status_t recv_st, call_st;
  fsdp_peers_recovered_t answer;
} replica_io_t;

/* ---- The replica's side ---- */

/* Whether host is a member of the ring. */
static bool in_ring(const fsdp_host_ring_t *ring, unsigned host) {
  return host >= ring->first && (host - ring->first) % ring->stride == 0 &&
         (host - ring->first) / ring->stride < ring->members;
}

/* Where the job stands, as a replica of `asker`'s shards answers: its last completed step
 * (0: none trained), or why it has none to give. */
static int replica_state(const fsdp_job_t *job, const fsdp_peers_recover_t *ask, unsigned self,
                         uint64_t *ret_step, fsdp_status_t *st) {
  *ret_step = 0;
  if (!job || job->owner.uid != ask->uid)
    return fsdp_status_set(st, FSDP_E_NOT_FOUND, "host %u holds no job '%s' of uid %llu", self,
                           ask->job, (unsigned long long)ask->uid);
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (!u->spec->scratch && !in_ring(&u->plan.replica_ring, ask->host))
      return fsdp_status_set(st, FSDP_E_NOT_FOUND,
                             "host %u holds no replica of host %u's shards of job '%s': unit "
                             "'%s' is %s",
                             self, ask->host, job->name, u->spec->unit,
                             fsdp_unit_strategy_name(u->spec->strategy));
  /* A replica still looking itself holds nothing trained yet, and says so: the hosts of a
   * job that starts everywhere at once look at each other, and each goes on as its own look
   * decides (the same checkpoint.dir, if any, for all). */
  if (fsdp_dataplane_job_resuming(job))
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "host %u: job '%s' resumes itself (its state is not loaded yet)",
                           self, job->name);
  /* A reduce may run: every reduce of a unit whose shards the asking host replicates ends
   * with the all-reduce among the replicas, the asking host's included, so none changes the
   * state until that host takes part (and a run it lost never does). */
  job_steps_t now = ck_job_steps(job);
  *ret_step = now.trained ? now.completed : 0;
  if (now.trained && !now.even)
    return fsdp_status_set(st, FSDP_E_ABORTED,
                           "host %u: job '%s' stopped inside step %llu: some of its units "
                           "stepped it, others not; no replica holds one step of them all",
                           self, job->name, (unsigned long long)now.completed + 1);
  return 0;
}

int fsdp_checkpoints_replica_step(fsdp_checkpoints_t *cp, const fsdp_job_t *job,
                                  const fsdp_peers_recover_t *ask, uint64_t *ret_step,
                                  fsdp_status_t *st) {
  return replica_state(job, ask, fsdp_peers_host_rank(cp->dp->peers), ret_step, st);
}

/* The asking host's units against the job's here, field by field, in registration order. */
static int same_units(const checkpoint_work_t *c, const fsdp_peers_recover_t *ask,
                      unsigned self, fsdp_status_t *st) {
  if (ask->n_units != c->job.n_units)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "host %u holds %zu units of job '%s', host %u %zu", self,
                           c->job.n_units, c->owner->name, ask->host, ask->n_units);
  for (size_t i = 0; i < ask->n_units; i++) {
    const fsdp_checkpoint_unit_t *u = &c->units[i];
    const fsdp_peers_recover_unit_t *r = &ask->units[i];
    const char *field = strcmp(u->name, r->name) != 0               ? "name"
                        : u->numel != r->numel                      ? "numel"
                        : u->shard_numel != r->shard_numel          ? "shard_numel"
                        : u->host_first_shard != r->host_first_shard ? "host_first_shard"
                        : u->host_shards != r->host_shards          ? "host_shards"
                        : u->arrays != r->optimizer_arrays          ? "optimizer_arrays"
                                                                    : NULL;
    if (field)
      return fsdp_status_set(
          st, FSDP_E_FAILED_PRECONDITION,
          "unit %zu of job '%s' differs in %s: host %u holds '%s' (%llu elements, shards "
          "[%u, %u) of %llu elements, %u optimizer arrays), host %u '%s' (%llu, [%u, %u) of "
          "%llu, %u)",
          i, c->owner->name, field, self, u->name, (unsigned long long)u->numel,
          u->host_first_shard, u->host_first_shard + u->host_shards,
          (unsigned long long)u->shard_numel, u->arrays, ask->host, r->name,
          (unsigned long long)r->numel, r->host_first_shard,
          r->host_first_shard + r->host_shards, (unsigned long long)r->shard_numel,
          r->optimizer_arrays);
  }
  size_t bytes = fsdp_checkpoint_staging_bytes(c->units, c->job.n_units);
  if (bytes != ask->bytes)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "job '%s': host %u's state is %zu bytes, host %u takes %llu",
                           c->owner->name, self, bytes, ask->host,
                           (unsigned long long)ask->bytes);
  return 0;
}

static void on_sent(void *data, const fsdp_status_t *st) {
  replica_io_t *io = data;
  checkpoint_work_t *c = io->c;
  io->transfer = NULL;
  c->write_ns = fsdp_clock_now_ns() - io->start_ns;
  if (st)
    fsdp_status_set(&c->st, st->code, "job '%s': %s", c->owner->name, st->message);
  ck_end_work(io->cp, c, 0);
}

void ck_send_snapshot(fsdp_checkpoints_t *cp, checkpoint_work_t *c) {
  replica_io_t *io = c->replica;
  io->start_ns = fsdp_clock_now_ns();
  io->deadline_ms = uv_now(cp->dp->loop) + cp->dp->collective_timeout_ms;
  if (io->abandoned)
    fsdp_status_set(&c->st, FSDP_E_CANCELLED,
                    "job '%s': host %u no longer waits for its state: not sent", c->owner->name,
                    c->peer);
  /* What is sent goes to the daemon that asked, not to one that took its rank since. */
  else if (!cp->dp->peers || !fsdp_peers_joined_as(cp->dp->peers, c->peer, c->peer_incarnation))
    fsdp_status_set(&c->st, FSDP_E_FAILED_PRECONDITION,
                    "job '%s': host %u's daemon is no longer the one that asked for its state",
                    c->owner->name, c->peer);
  else if (fsdp_dataplane_transfer_state(cp->dp, true, c->peer, c->owner->name, c->step,
                                         c->peer_incarnation, io->snapshot, io->bytes, on_sent,
                                         io, &io->transfer, &c->st) == 0)
    return;
  ck_end_work(cp, c, 0);
}

void ck_expire_sends(fsdp_checkpoints_t *cp, uint64_t now_ms) {
  for (checkpoint_work_t *c = cp->works; c; c = c->next)
    if (c->stage == SAVE_SENDING && c->replica->transfer && now_ms >= c->replica->deadline_ms) {
      char why[160];
      snprintf(why, sizeof why,
               "job '%s': host %u did not take its state within store.collective_timeout",
               c->owner->name, c->peer);
      fsdp_dataplane_transfer_end(c->replica->transfer, why);
      c->replica->transfer = NULL; /* its end comes, once */
    }
}

/* The end of a send, to whoever asked (the Peer service's answer). */
static void sent(void *data, const fsdp_status_t *st, const char *path, uint64_t step) {
  (void)path;
  replica_io_t *io = data;
  fsdp_peers_recovered_t answer = {.step = step, .bytes = io->bytes, .xxh64 = io->c->xxh64};
  io->sent(io->sent_data, st->code < 0 ? st : NULL, &answer);
}

int fsdp_checkpoints_send_to_replica(fsdp_checkpoints_t *cp, fsdp_job_t *job,
                                     const fsdp_peers_recover_t *ask,
                                     fsdp_checkpoints_sent_fn done, void *data,
                                     fsdp_status_t *st) {
  unsigned self = fsdp_peers_host_rank(cp->dp->peers);
  uint64_t step;
  if (replica_state(job, ask, self, &step, st) < 0)
    return st->code;
  if (step != ask->step)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "host %u holds job '%s' after step %llu, not %llu", self, job->name,
                           (unsigned long long)step, (unsigned long long)ask->step);
  replica_io_t *io = calloc(1, sizeof *io);
  if (!io)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "Recover: out of memory");
  *io = (replica_io_t){.cp = cp, .sent = done, .sent_data = data};
  checkpoint_work_t *c = ck_new_work(cp, job, "", NULL, SAVE_SNAPSHOT, step, sent, io,
                                     "Recover", st);
  if (!c) {
    free(io);
    return st->code;
  }
  c->by_replica = true;
  c->peer = ask->host;
  c->peer_incarnation = ask->incarnation;
  c->replica = io;
  io->c = c;
  int r = ck_describe(job, c, st);
  if (r == 0 && (r = same_units(c, ask, self, st)) == 0) {
    io->bytes = fsdp_checkpoint_staging_bytes(c->units, c->job.n_units);
    r = ck_queue_checkpoint(cp, job, c, st);
  }
  if (r < 0) {
    ck_unlink_work(cp, c);
    ck_free_checkpoint_work(c); /* and io */
  }
  return r;
}

void fsdp_checkpoints_abandon_send(fsdp_checkpoints_t *cp, const void *data) {
  for (checkpoint_work_t *c = cp->works; c; c = c->next)
    if (ck_is_replica_send(c) && c->replica->sent_data == data)
      c->replica->abandoned = true;
}

void *ck_replica_snapshot(checkpoint_work_t *c) {
  replica_io_t *io = c->replica;
  size_t size = io->bytes;
  if (!io->snapshot && !(io->snapshot = ck_alloc_staging(&size)))
    fsdp_status_set(&c->st, FSDP_E_RESOURCE_EXHAUSTED,
                    "job '%s': no memory for the %zu bytes of the state host %u asked for",
                    c->owner->name, io->bytes, c->peer);
  return io->snapshot;
}

void ck_free_replica_io(replica_io_t *io) {
  if (io)
    free(io->snapshot);
  free(io);
}

/* ---- The asking host's side: the look ---- */

typedef struct replica_look {
  fsdp_checkpoints_t *cp;
  fsdp_job_t *job; /* lives while the look runs (fsdp_checkpoints_uses_job) */
  fsdp_peers_waiter_t waiter;
  uv_timer_t timer; /* the look's start, then its rounds */
  fsdp_host_ring_t replicas; /* the first unit's replica ring, this host a member */
  unsigned next;             /* the member asked next */
  uint64_t deadline_ms;      /* loop time; past it a replica that could not say fails the job */
  char busy[512];            /* why a replica could not say, this round */
  struct replica_look *next_look;
} replica_look_t;

static void ask_next(replica_look_t *l);

static void look_closed(uv_handle_t *handle) {
  free(handle->data);
}

/* The look ends: found (the job goes on from host's step), or not (the disk's look, if
 * any, goes on). */
static void look_ends(replica_look_t *l, bool found, unsigned host, uint64_t step) {
  fsdp_checkpoints_t *cp = l->cp;
  fsdp_job_t *job = l->job;
  for (replica_look_t **p = &cp->replica_looks; *p; p = &(*p)->next_look)
    if (*p == l) {
      *p = l->next_look;
      break;
    }
  uv_close((uv_handle_t *)&l->timer, look_closed);
  fsdp_job_checkpoints_t *ck = ck_job(job);
  if (found && ck) {
    ck->recover = true;
    ck->recover_host = host;
    ck->checkpointed_step = step; /* the schedule does not save it again */
    log_info("job '%s': host %u, a replica of this host's shards, holds it after step %llu: "
             "its state is copied from there at its first gather",
             job->name, host, (unsigned long long)step);
    fsdp_dataplane_looked(cp->dp, job, true, step);
    return;
  }
  if (l->busy[0] && ck && (ck->recover_error = strdup(l->busy))) {
    log_error("job '%s': cannot recover from its replicas: %s", job->name, l->busy);
    fsdp_dataplane_looked(cp->dp, job, true, 0); /* its first gather fails naming why */
    return;
  }
  if (!cp->dp->peers || !ck_disk_look(cp, job)) /* no peers: the daemon stops */
    fsdp_dataplane_looked(cp->dp, job, false, 0);
}

static void on_round(uv_timer_t *timer) {
  replica_look_t *l = timer->data;
  l->busy[0] = '\0';
  l->next = 0;
  ask_next(l);
}

static void on_step_answer(void *data, const fsdp_status_t *st,
                           const fsdp_peers_recovered_t *answer) {
  replica_look_t *l = data;
  unsigned host = fsdp_host_ring_host(&l->replicas, l->next++);
  if (!st && answer->step > 0) {
    look_ends(l, true, host, answer->step);
    return;
  }
  if (st && st->code == FSDP_E_ABORTED) { /* it holds the job inside a step: no waiting helps */
    snprintf(l->busy, sizeof l->busy, "%s", st->message);
    l->deadline_ms = 0;
  } else if (st && st->code != FSDP_E_NOT_FOUND) {
    snprintf(l->busy, sizeof l->busy, "%s", st->message); /* it may say once it can */
  }
  ask_next(l);
}

/* Asks the next replica where the job stands; after the last, asks them all again while one
 * could not say and the deadline allows. */
static void ask_next(replica_look_t *l) {
  fsdp_checkpoints_t *cp = l->cp;
  fsdp_peers_t *peers = cp->dp->peers;
  if (!peers) { /* the daemon stops */
    l->busy[0] = '\0';
    look_ends(l, false, 0, 0);
    return;
  }
  if (l->next == l->replicas.self)
    l->next++;
  if (l->next == l->replicas.members) {
    if (l->busy[0] && uv_now(cp->dp->loop) + LOOK_RETRY_MS < l->deadline_ms) {
      uv_timer_start(&l->timer, on_round, LOOK_RETRY_MS, 0);
      return;
    }
    look_ends(l, false, 0, 0);
    return;
  }
  fsdp_peers_recover_t ask = {.job = l->job->name, .uid = l->job->owner.uid};
  fsdp_status_t st;
  if (fsdp_peers_recover(peers, fsdp_host_ring_host(&l->replicas, l->next), &ask,
                         cp->dp->collective_timeout_ms, on_step_answer, l, &st) < 0) {
    snprintf(l->busy, sizeof l->busy, "%s", st.message);
    l->next++;
    ask_next(l);
  }
}

static void on_cluster(void *data, int status, const char *why) {
  replica_look_t *l = data;
  if (status < 0) {
    log_warning("job '%s': its replicas cannot be asked whether they hold it (%s): it does "
                "not recover from them",
                l->job->name, why);
    look_ends(l, false, 0, 0);
    return;
  }
  l->deadline_ms = uv_now(l->cp->dp->loop) + l->cp->dp->collective_timeout_ms;
  ask_next(l);
}

/* On the loop's next turn, so that the look never ends inside the hook that starts it. */
static void on_look_start(uv_timer_t *timer) {
  replica_look_t *l = timer->data;
  if (!l->cp->dp->peers) {
    look_ends(l, false, 0, 0);
    return;
  }
  fsdp_peers_when_ready(l->cp->dp->peers, &l->waiter, on_cluster, l);
}

bool ck_replicas_look(fsdp_checkpoints_t *cp, fsdp_job_t *job, const fsdp_unit_t *unit) {
  const fsdp_host_ring_t *ring = &unit->plan.replica_ring;
  if (!cp->recover || !cp->dp->peers || unit->spec->scratch || ring->members < 2 ||
      !ck_job(job))
    return false;
  replica_look_t *l = calloc(1, sizeof *l);
  if (!l) {
    log_error("job '%s': no memory to ask its replicas whether they hold it", job->name);
    return false;
  }
  l->cp = cp;
  l->job = job;
  l->replicas = *ring;
  uv_timer_init(cp->dp->loop, &l->timer);
  l->timer.data = l;
  uv_timer_start(&l->timer, on_look_start, 0, 0);
  l->next_look = cp->replica_looks;
  cp->replica_looks = l;
  return true;
}

bool ck_replicas_use_job(const fsdp_checkpoints_t *cp, const fsdp_job_t *job) {
  for (const replica_look_t *l = cp->replica_looks; l; l = l->next_look)
    if (l->job == job)
      return true;
  return false;
}

/* ---- The asking host's side: the fetch ---- */

/* On the pool: what arrived is what the replica sent. */
static void verify(uv_work_t *req) {
  checkpoint_work_t *c = req->data;
  replica_io_t *io = c->replica;
  uint64_t got = XXH64(c->owner->checkpoints->staging, io->bytes, 0);
  if (got != io->answer.xxh64)
    fsdp_status_set(&c->st, FSDP_E_DATA_LOSS,
                    "job '%s': the state from host %u has XXH64 %016llx, not the %016llx it "
                    "sent: nothing loaded",
                    c->owner->name, c->peer, (unsigned long long)got,
                    (unsigned long long)io->answer.xxh64);
}

/* Both halves of the fetch ended: the state is checked, then loaded as a checkpoint is. */
static void fetched(replica_io_t *io) {
  checkpoint_work_t *c = io->c;
  if (io->call_st.code < 0)
    c->st = io->call_st;
  else if (io->recv_st.code < 0)
    fsdp_status_set(&c->st, io->recv_st.code, "job '%s': %s", c->owner->name,
                    io->recv_st.message);
  else if (io->answer.bytes != io->bytes || io->answer.step != c->step)
    fsdp_status_set(&c->st, FSDP_E_DATA_LOSS,
                    "job '%s': host %u says it sent %llu bytes of step %llu; %zu of step %llu "
                    "were asked",
                    c->owner->name, c->peer, (unsigned long long)io->answer.bytes,
                    (unsigned long long)io->answer.step, io->bytes, (unsigned long long)c->step);
  c->snapshot_ns = fsdp_clock_now_ns() - io->start_ns;
  if (c->st.code == 0) {
    c->work.data = c;
    if (uv_queue_work(io->cp->dp->loop, &c->work, verify, ck_load_read) == 0)
      return;
    fsdp_status_set(&c->st, FSDP_E_INTERNAL, "job '%s': its recovery could not go on",
                    c->owner->name);
  }
  ck_end_work(io->cp, c, 0);
}

static void on_received(void *data, const fsdp_status_t *st) {
  replica_io_t *io = data;
  io->transfer = NULL;
  io->received = true;
  if (st)
    io->recv_st = *st;
  if (io->answered)
    fetched(io);
}

static void on_fetch_answer(void *data, const fsdp_status_t *st,
                            const fsdp_peers_recovered_t *answer) {
  replica_io_t *io = data;
  io->answered = true;
  io->answer = *answer;
  if (st)
    io->call_st = *st;
  if (io->received)
    fetched(io);
  else if (st) /* nothing will come: the receive's end ends the fetch */
    fsdp_dataplane_transfer_end(io->transfer, NULL);
}

/* Posts the receive of the state into the staging memory, then asks for it. */
static int ask_for_state(fsdp_checkpoints_t *cp, checkpoint_work_t *c, fsdp_status_t *st) {
  replica_io_t *io = c->replica;
  size_t n = c->job.n_units;
  fsdp_peers_t *peers = cp->dp->peers;
  if (!peers)
    return fsdp_status_set(st, FSDP_E_CANCELLED, "the daemon stops");
  io->start_ns = fsdp_clock_now_ns();
  if (fsdp_dataplane_transfer_state(cp->dp, false, c->peer, c->owner->name, c->step,
                                    fsdp_peers_incarnation(peers), c->owner->checkpoints->staging,
                                    io->bytes, on_received, io, &io->transfer, st) < 0)
    return st->code;
  fsdp_peers_recover_unit_t *units = calloc(n ? n : 1, sizeof *units);
  for (size_t i = 0; units && i < n; i++) {
    const fsdp_checkpoint_unit_t *u = &c->units[i];
    units[i] = (fsdp_peers_recover_unit_t){
        .name = u->name, .numel = u->numel, .shard_numel = u->shard_numel,
        .host_first_shard = u->host_first_shard, .host_shards = u->host_shards,
        .optimizer_arrays = u->arrays};
  }
  fsdp_peers_recover_t ask = {.job = c->owner->name, .uid = c->owner->owner.uid, .fetch = true,
                              .step = c->step, .bytes = io->bytes, .units = units,
                              .n_units = n};
  int r = units ? fsdp_peers_recover(peers, c->peer, &ask, cp->dp->collective_timeout_ms,
                                     on_fetch_answer, io, st)
                : fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "Recover: out of memory");
  free(units);
  if (r < 0) { /* nobody will send: the receive ends cancelled, and the fetch with it */
    io->answered = true;
    io->call_st = *st;
    fsdp_dataplane_transfer_end(io->transfer, NULL);
  }
  return 0;
}

/* On the pool: the staging memory the state arrives in, made (faulted in: it takes a while
 * for a large job) and laid out as a snapshot of the job's units. */
static void prepare_staging(uv_work_t *req) {
  checkpoint_work_t *c = req->data;
  size_t n = c->job.n_units;
  void *at = ck_staging(c->owner, c);
  if (!at)
    return;
  if (!(c->staged = malloc((n ? n : 1) * sizeof *c->staged))) {
    fsdp_status_set(&c->st, FSDP_E_RESOURCE_EXHAUSTED, "Recover: out of memory");
    return;
  }
  memcpy(c->staged, c->units, n * sizeof *c->staged);
  fsdp_checkpoint_stage(c->staged, n, at, NULL, NULL, &c->st);
}

static void staging_prepared(uv_work_t *req, int status) {
  checkpoint_work_t *c = req->data;
  replica_io_t *io = c->replica;
  if (status == 0 && c->st.code == 0 && ask_for_state(io->cp, c, &c->st) == 0)
    return;
  ck_end_work(io->cp, c, status);
}

int ck_recover_from_replica(fsdp_checkpoints_t *cp, fsdp_job_t *job,
                            fsdp_checkpoints_done_fn done, void *data, fsdp_status_t *st) {
  fsdp_job_checkpoints_t *ck = job->checkpoints;
  ck->recover = false;
  if (ck->recover_error)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "job '%s' cannot recover from its replicas: %s", job->name,
                           ck->recover_error);
  replica_io_t *io = calloc(1, sizeof *io);
  checkpoint_work_t *c =
      io ? ck_new_work(cp, job, "", NULL, LOADING, 0, done, data, "Recover", st) : NULL;
  if (!c) {
    free(io);
    return io ? st->code : fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory");
  }
  *io = (replica_io_t){.cp = cp, .c = c};
  c->replica = io;
  c->by_replica = true;
  c->resume = true;
  c->peer = ck->recover_host;
  int r = ck_describe(job, c, st);
  if (r == 0) {
    c->step = job->flight->resume_step;
    snprintf(c->path, sizeof c->path, "the memory of host %u (a replica)", c->peer);
    snprintf(c->loaded.path, sizeof c->loaded.path, "%s", c->path);
    snprintf(c->loaded.job, sizeof c->loaded.job, "%s", job->name);
    c->loaded.step = c->step;
    for (size_t i = 0; i < c->job.n_units; i++)
      c->loaded.optimizer_state |= c->units[i].arrays > 0;
    c->replica->bytes = fsdp_checkpoint_staging_bytes(c->units, c->job.n_units);
    c->work.data = c;
    if (uv_queue_work(cp->dp->loop, &c->work, prepare_staging, staging_prepared) < 0)
      r = fsdp_status_set(st, FSDP_E_INTERNAL, "job '%s': its recovery could not start",
                          job->name);
  }
  if (r < 0) {
    ck_unlink_work(cp, c);
    ck_free_checkpoint_work(c);
  }
  return r;
}
