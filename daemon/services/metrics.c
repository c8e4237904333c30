/* The daemon's metrics (metrics.h). */
#include "daemon/services/metrics.h"

#include <stdbool.h>
#include <stdio.h>

#include <fsdp/fsdp_version.h>

#include "daemon/checkpoints/checkpoints.h"
#include "daemon/dataplane/optimizer.h"
#include "daemon/store/arena.h"
#include "daemon/store/pool.h"
#include "proto/wire.h"

#define N(labels) (sizeof(labels) / sizeof((labels)[0]))

static void render_daemon(const fsdp_services_context_t *ctx, fsdp_exposition_t *e) {
  fsdp_exposition_family(e, "fsdpd_build_info", "gauge",
                         "The fsdpd build serving: its version and protocol, as a label.");
  char protocol[16];
  snprintf(protocol, sizeof protocol, "%u", FSDP_PROTOCOL_VERSION);
  const fsdp_label_t build[] = {{"version", FSDP_VERSION_STRING}, {"protocol", protocol}};
  fsdp_exposition_count(e, "fsdpd_build_info", build, N(build), 1);
  fsdp_exposition_family(e, "fsdpd_sessions", "gauge", "Trainer sessions attached now.");
  fsdp_exposition_count(e, "fsdpd_sessions", NULL, 0, ctx->sessions->count);
  fsdp_exposition_family(e, "fsdpd_jobs", "gauge", "Jobs the daemon holds (their units and "
                         "memory), attached or not.");
  fsdp_exposition_count(e, "fsdpd_jobs", NULL, 0, ctx->store->n_jobs);
}

static void render_method(void *data, const char *endpoint, const char *path,
                          const uint64_t ended[FSDP_RPC_CODES]) {
  fsdp_exposition_t *e = data;
  for (unsigned code = 0; code < FSDP_RPC_CODES; code++) {
    if (!ended[code])
      continue; /* a series appears with its first call */
    const fsdp_label_t labels[] = {
        {"endpoint", endpoint}, {"method", path}, {"code", fsdp_wire_status_name((grpc_status_code)code)}};
    fsdp_exposition_count(e, "fsdpd_rpc_calls_total", labels, N(labels), ended[code]);
  }
}

/* Each job's oldest collective under way, and whether it is past health.stall_after. */
static void render_waits(const fsdp_services_context_t *ctx, fsdp_exposition_t *e) {
  uint64_t now_ms = uv_now(ctx->loop);
  fsdp_exposition_family(e, "fsdpd_job_oldest_wait_seconds", "gauge",
                         "How long a job's oldest collective under way has been (from its "
                         "first rank's asking); 0 without one.");
  for (const fsdp_job_t *job = ctx->store->jobs; job; job = job->next) {
    const fsdp_label_t labels[] = {{"fsdp_job", job->name}};
    fsdp_exposition_value(e, "fsdpd_job_oldest_wait_seconds", labels, N(labels),
                          (double)fsdp_dataplane_oldest_wait_ms(job, now_ms) / 1000.0);
  }
  fsdp_exposition_family(e, "fsdpd_job_stalled", "gauge",
                         "1 while a job's collective has been under way longer than "
                         "health.stall_after (its health service fsdp.job.<name> is then "
                         "NOT_SERVING), as the last check found.");
  for (const fsdp_job_t *job = ctx->store->jobs; job; job = job->next) {
    const fsdp_label_t labels[] = {{"fsdp_job", job->name}};
    fsdp_exposition_count(e, "fsdpd_job_stalled", labels, N(labels), job->flight->stalled);
  }
}

static void render_jobs(const fsdp_services_context_t *ctx, fsdp_exposition_t *e) {
  fsdp_exposition_family(e, "fsdpd_job_memory_bytes", "gauge",
                         "Bytes of a job's memory in use: its read-write arena (masters, "
                         "gradients, optimizer state, buffers lent) and its read-only one "
                         "(unsharded copies).");
  for (const fsdp_job_t *job = ctx->store->jobs; job; job = job->next) {
    const fsdp_arena_t *arenas[] = {job->arena, job->shared_arena};
    const char *names[] = {"read_write", "read_only"};
    for (size_t i = 0; i < 2; i++) {
      if (!arenas[i])
        continue;
      fsdp_arena_stats_t stats;
      fsdp_arena_get_stats(arenas[i], &stats);
      const fsdp_label_t labels[] = {{"fsdp_job", job->name}, {"memory", names[i]}};
      fsdp_exposition_count(e, "fsdpd_job_memory_bytes", labels, N(labels), stats.used);
    }
  }
}

/* A job's pools, by name: its unsharded copies, its host sums, its ranks' full-gradient
 * buffers (every rank's pool counted together). */
typedef struct pool_sums {
  uint64_t lent, bytes, waits;
} pool_sums_t;

static void add_pool(pool_sums_t *sums, const fsdp_pool_t *pool) {
  sums->lent += pool->n_lent;
  sums->waits += pool->n_waits;
  for (unsigned i = 0; i < pool->n_buffers; i++)
    sums->bytes += pool->buffers[i].bytes;
}

static void render_pools(const fsdp_services_context_t *ctx, fsdp_exposition_t *e) {
  static const char *const names[] = {"copies", "host_sums", "gradients"};
  static const char *const families[][3] = {
      {"fsdpd_pool_buffers_lent", "gauge", "Buffers of a job's pool lent now."},
      {"fsdpd_pool_bytes", "gauge", "Bytes of the buffers a job's pool has made."},
      {"fsdpd_pool_waits_total", "counter",
       "Takes from a job's pool that found every buffer lent and waited (its in-flight cap, "
       "max_inflight)."}};
  for (size_t f = 0; f < 3; f++) {
    fsdp_exposition_family(e, families[f][0], families[f][1], families[f][2]);
    for (const fsdp_job_t *job = ctx->store->jobs; job; job = job->next) {
      pool_sums_t sums[3] = {{0}};
      add_pool(&sums[0], &job->copies);
      add_pool(&sums[1], &job->sums);
      for (uint32_t r = 0; job->grad_pools && r < job->local_world_size; r++)
        add_pool(&sums[2], &job->grad_pools[r]);
      for (size_t k = 0; k < 3; k++) {
        const fsdp_label_t labels[] = {{"fsdp_job", job->name}, {"pool", names[k]}};
        uint64_t v = f == 0 ? sums[k].lent : f == 1 ? sums[k].bytes : sums[k].waits;
        fsdp_exposition_count(e, families[f][0], labels, N(labels), v);
      }
    }
  }
}

/* One family over every unit of every job: value(job, unit) per unit. */
static void render_unit_counts(const fsdp_services_context_t *ctx, fsdp_exposition_t *e,
                               const char *name, const char *help,
                               uint64_t (*value)(fsdp_job_t *job, const fsdp_unit_t *u)) {
  fsdp_exposition_family(e, name, "counter", help);
  for (fsdp_job_t *job = ctx->store->jobs; job; job = job->next)
    for (const fsdp_unit_t *u = job->units; u; u = u->next) {
      const fsdp_label_t labels[] = {{"fsdp_job", job->name}, {"unit", u->spec->unit}};
      fsdp_exposition_count(e, name, labels, N(labels), value(job, u));
    }
}

static uint64_t gathers(fsdp_job_t *job, const fsdp_unit_t *u) {
  (void)job;
  return u->flight->gathers;
}

static uint64_t gathered_bytes(fsdp_job_t *job, const fsdp_unit_t *u) {
  (void)job;
  uint64_t size = fsdp_unit_spec_param_dtype(u->spec) == FSDP_UNIT_DTYPE_FP32 ? 4 : 2;
  return u->flight->gathers * u->layout.numel * size;
}

static uint64_t ring_sent_bytes(fsdp_job_t *job, const fsdp_unit_t *u) {
  (void)job;
  return u->flight->ring_sent_bytes;
}

static uint64_t reduces(fsdp_job_t *job, const fsdp_unit_t *u) {
  (void)job;
  return u->flight->reduces;
}

static uint64_t optimizer_steps(fsdp_job_t *job, const fsdp_unit_t *u) {
  return fsdp_optimizer_unit_steps(job, u);
}

/* One histogram family over every unit: its gather's and its reduce's (which: the unit's
 * flight's pair). */
static void render_unit_histograms(const fsdp_services_context_t *ctx, fsdp_exposition_t *e,
                                   const char *name, const char *help, bool queue) {
  fsdp_exposition_family(e, name, "histogram", help);
  for (const fsdp_job_t *job = ctx->store->jobs; job; job = job->next)
    for (const fsdp_unit_t *u = job->units; u; u = u->next) {
      const fsdp_label_t gather[] = {{"fsdp_job", job->name}, {"unit", u->spec->unit},
                                     {"work", "gather"}};
      const fsdp_label_t reduce[] = {{"fsdp_job", job->name}, {"unit", u->spec->unit},
                                     {"work", "reduce"}};
      fsdp_exposition_histogram(e, name, gather, N(gather),
                                queue ? &u->flight->gather_queue : &u->flight->gather_work);
      fsdp_exposition_histogram(e, name, reduce, N(reduce),
                                queue ? &u->flight->reduce_queue : &u->flight->reduce_work);
    }
}

/* Each job's checkpoints: saves and loads by outcome, the bytes and seconds of those done. */
static void render_checkpoints(const fsdp_services_context_t *ctx, fsdp_exposition_t *e) {
  static const char *const families[][2] = {
      {"fsdpd_checkpoint_saves_total", "Saves of a job's state on this host that ended, by "
                                       "outcome (ok, failed)."},
      {"fsdpd_checkpoint_loads_total", "Loads into a job's units that ended, by outcome."},
      {"fsdpd_checkpoint_bytes_total", "Bytes of the job's state that saves wrote and loads "
                                       "read (op: save, load)."},
      {"fsdpd_checkpoint_seconds_total", "Time of the saves (snapshot and writing) and loads "
                                         "that succeeded (op: save, load)."}};
  for (size_t f = 0; f < 4; f++) {
    fsdp_exposition_family(e, families[f][0], "counter", families[f][1]);
    for (const fsdp_job_t *job = ctx->store->jobs; job; job = job->next) {
      fsdp_checkpoints_job_info_t info;
      fsdp_checkpoints_job_info(job, &info);
      if (f < 2) {
        uint64_t ok = f == 0 ? info.saved : info.loaded;
        uint64_t failed = f == 0 ? info.save_failed : info.load_failed;
        const fsdp_label_t oks[] = {{"fsdp_job", job->name}, {"outcome", "ok"}};
        const fsdp_label_t fails[] = {{"fsdp_job", job->name}, {"outcome", "failed"}};
        fsdp_exposition_count(e, families[f][0], oks, N(oks), ok);
        fsdp_exposition_count(e, families[f][0], fails, N(fails), failed);
      } else {
        const fsdp_label_t saves[] = {{"fsdp_job", job->name}, {"op", "save"}};
        const fsdp_label_t loads[] = {{"fsdp_job", job->name}, {"op", "load"}};
        if (f == 2) {
          fsdp_exposition_count(e, families[f][0], saves, N(saves), info.saved_bytes);
          fsdp_exposition_count(e, families[f][0], loads, N(loads), info.loaded_bytes);
        } else {
          fsdp_exposition_value(e, families[f][0], saves, N(saves), (double)info.save_ns / 1e9);
          fsdp_exposition_value(e, families[f][0], loads, N(loads), (double)info.load_ns / 1e9);
        }
      }
    }
  }
}

/* The peers (several hosts): whether each is joined, and its heartbeat's round trip; each
 * family's samples together, as the format wants. */
static void render_peers(const fsdp_services_context_t *ctx, fsdp_exposition_t *e) {
  unsigned hosts = ctx->peers ? fsdp_peers_host_count(ctx->peers) : 1;
  if (hosts < 2)
    return;
  static const char *const families[][2] = {
      {"fsdpd_peer_up", "1 while another host's daemon is joined (cluster.hosts), 0 else."},
      {"fsdpd_peer_rtt_seconds",
       "The latest heartbeat's round trip to another host's daemon; 0 before the first."}};
  unsigned self = fsdp_peers_host_rank(ctx->peers);
  for (size_t f = 0; f < 2; f++) {
    fsdp_exposition_family(e, families[f][0], "gauge", families[f][1]);
    for (unsigned h = 0; h < hosts; h++) {
      if (h == self)
        continue;
      fsdp_peer_info_t p;
      fsdp_peers_get(ctx->peers, h, &p);
      char host[16];
      snprintf(host, sizeof host, "%u", h);
      const fsdp_label_t labels[] = {{"host", host}};
      if (f == 0)
        fsdp_exposition_count(e, families[f][0], labels, N(labels), p.state == FSDP_PEER_JOINED);
      else
        fsdp_exposition_value(e, families[f][0], labels, N(labels), (double)p.rtt_us / 1e6);
    }
  }
}

void fsdp_services_render_metrics(void *data, fsdp_exposition_t *e) {
  const fsdp_services_context_t *ctx = data;
  render_daemon(ctx, e);
  fsdp_exposition_family(e, "fsdpd_rpc_calls_total", "counter",
                         "gRPC calls answered with a status, by endpoint, method and code (a "
                         "call its client cancelled first is not counted).");
  if (ctx->rpc)
    fsdp_rpc_server_each_method(ctx->rpc, render_method, e);
  render_jobs(ctx, e);
  render_pools(ctx, e);
  render_waits(ctx, e);
  render_unit_counts(ctx, e, "fsdpd_unit_gathers_total",
                     "Gathers of a unit that completed (each serves every local rank).",
                     gathers);
  render_unit_counts(ctx, e, "fsdpd_unit_gathered_bytes_total",
                     "Bytes of a unit's parameters its gathers made, in the copy's dtype.",
                     gathered_bytes);
  render_unit_counts(ctx, e, "fsdpd_unit_reduces_total",
                     "Reduces of a unit's gradients that completed (each of every local "
                     "rank's).",
                     reduces);
  render_unit_counts(ctx, e, "fsdpd_unit_optimizer_steps_total",
                     "Steps the daemon's optimizer took on a unit.", optimizer_steps);
  render_unit_counts(ctx, e, "fsdpd_unit_ring_sent_bytes_total",
                     "Bytes of a unit's collectives among hosts this host's rings sent to the "
                     "next host over UCX (all-gathers, reduce-scatters, all-reduces).",
                     ring_sent_bytes);
  render_unit_histograms(ctx, e, "fsdpd_unit_work_seconds",
                         "The daemon's own work on a unit's collectives, its kernels' "
                         "completion included: a gather's cast of this host's shards, a "
                         "reduce's sum on one host (across hosts the rings sum as they go).",
                         false);
  render_unit_histograms(ctx, e, "fsdpd_unit_queue_seconds",
                         "How long that work waited in the daemon's queue (behind other "
                         "units' and jobs' work) before it ran: with the work's own time, what "
                         "the daemon added to a collective.",
                         true);
  render_checkpoints(ctx, e);
  render_peers(ctx, e);
}
