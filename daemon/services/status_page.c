/* The status page (status_page.h): HTML written on the loop from the daemon's state, the
 * timeline an SVG drawn from each job's flight recorder. Every name a caller chose (units,
 * parameters) is escaped; job names are of [A-Za-z0-9._-] but escaped all the same. */
#include "daemon/services/status_page.h"

#include <inttypes.h>
#include <stdint.h>
#include <string.h>

#include <fsdp/fsdp_version.h>

#include "daemon/cluster/membership.h"
#include "daemon/store/arena.h"

/* The steps the timeline draws, the newest. */
#define TIMELINE_STEPS 3
#define TIMELINE_WIDTH 960
#define ROW_HEIGHT 18

static void html(FILE *out, const char *s) {
  for (; *s; s++) {
    switch (*s) {
    case '&':
      fputs("&amp;", out);
      break;
    case '<':
      fputs("&lt;", out);
      break;
    case '>':
      fputs("&gt;", out);
      break;
    case '"':
      fputs("&quot;", out);
      break;
    case '\'':
      fputs("&#39;", out);
      break;
    default:
      fputc(*s, out);
    }
  }
}

static void mib(FILE *out, uint64_t bytes) {
  fprintf(out, "%.1f MiB", (double)bytes / (1 << 20));
}

static void page_head(const fsdp_services_context_t *ctx, FILE *out) {
  fputs("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"refresh\" content=\"5\"><title>fsdpd</title><style>"
        "body{font-family:sans-serif;margin:1.5em;color:#222}"
        "table{border-collapse:collapse;margin:.5em 0 1.5em}"
        "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}"
        "th{background:#f2f2f2}.bad{color:#b00020;font-weight:bold}"
        "</style></head><body>\n", out);
  uint64_t up_s = (uv_now(ctx->loop) - ctx->started_ms) / 1000;
  unsigned host = ctx->peers ? fsdp_peers_host_rank(ctx->peers) : 0;
  unsigned hosts = ctx->peers ? fsdp_peers_host_count(ctx->peers) : 1;
  fprintf(out, "<h1>fsdpd %s</h1><p>backend %s, host %u of %u, up %" PRIu64 " s, %u session%s, "
          "%u job%s</p>\n", FSDP_VERSION_STRING, fsdp_backend_name(&ctx->dataplane->backend),
          host, hosts, up_s,
          ctx->sessions->count, ctx->sessions->count == 1 ? "" : "s", ctx->store->n_jobs,
          ctx->store->n_jobs == 1 ? "" : "s");
}

static void peers_table(const fsdp_services_context_t *ctx, FILE *out) {
  unsigned hosts = ctx->peers ? fsdp_peers_host_count(ctx->peers) : 1;
  if (hosts < 2)
    return;
  fputs("<h2>Peers</h2><table><tr><th>host</th><th>address</th><th>state</th>"
        "<th>last heard</th><th>round trip</th></tr>\n", out);
  for (unsigned h = 0; h < hosts; h++) {
    fsdp_peer_info_t p;
    fsdp_peers_get(ctx->peers, h, &p);
    fprintf(out, "<tr><td>%u</td><td>", h);
    html(out, p.address ? p.address : "");
    fprintf(out, "</td><td>%s</td><td>", fsdp_peer_state_name(p.state));
    if (p.last_heard_ms >= 0)
      fprintf(out, "%" PRId64 " ms ago", p.last_heard_ms);
    fprintf(out, "</td><td>%" PRIu64 " &micro;s</td></tr>\n", p.rtt_us);
  }
  fputs("</table>\n", out);
}

static unsigned job_sessions(const fsdp_services_context_t *ctx, const fsdp_job_t *job) {
  unsigned n = 0;
  for (const fsdp_session_t *s = ctx->sessions->head; s; s = s->next)
    n += strcmp(s->job, job->name) == 0;
  return n;
}

static void job_table(const fsdp_services_context_t *ctx, const fsdp_job_t *job, FILE *out) {
  fputs("<h2>Job ", out);
  html(out, job->name);
  fprintf(out, "</h2><p>%u of %u local ranks attached, max_inflight %u", job_sessions(ctx, job),
          job->local_world_size, job->max_inflight);
  const fsdp_arena_t *arenas[] = {job->arena, job->shared_arena};
  for (size_t i = 0; i < 2; i++) {
    if (!arenas[i])
      continue;
    fsdp_arena_stats_t stats;
    fsdp_arena_get_stats(arenas[i], &stats);
    fputs(i ? ", copies' arena " : ", arena ", out);
    mib(out, stats.used);
    fputs(" of ", out);
    mib(out, stats.capacity);
  }
  fprintf(out, ", copies lent %u of %u made</p>\n", job->copies.n_lent, job->copies.n_buffers);
  if (job->flight->stalled) {
    fputs("<p class=\"bad\">stalled: ", out);
    html(out, job->flight->stall);
    fputs("</p>\n", out);
  }
  fputs("<table><tr><th>unit</th><th>elements</th><th>shards</th><th>gathers</th>"
        "<th>reduces</th><th>last gather</th><th>last reduce</th></tr>\n", out);
  for (const fsdp_unit_t *u = job->units; u; u = u->next) {
    fputs("<tr><td>", out);
    html(out, u->spec->unit);
    fprintf(out, "</td><td>%" PRIu64 "</td><td>%u</td><td>%" PRIu64 "</td><td>%" PRIu64
            "</td><td>%" PRIu64 " &micro;s</td><td>%" PRIu64 " &micro;s</td></tr>\n",
            u->layout.numel, u->layout.shards, u->flight->gathers, u->flight->reduces,
            u->flight->last_gather_us, u->flight->last_reduce_us);
  }
  fputs("</table>\n", out);
}

/* The timeline's extent: the newest steps' records, and their first and last times. */
typedef struct extent {
  uint64_t min_step, newest, t0, t1;
  uint32_t world;
  FILE *out;
  const fsdp_job_t *job;
} extent_t;

static void find_newest(void *data, const fsdp_op_record_t *r) {
  extent_t *x = data;
  if (r->step > x->newest)
    x->newest = r->step;
}

static void find_times(void *data, const fsdp_op_record_t *r) {
  extent_t *x = data;
  if (r->step < x->min_step || !r->end_ns)
    return;
  if (r->submit_ns < x->t0)
    x->t0 = r->submit_ns;
  if (r->end_ns > x->t1)
    x->t1 = r->end_ns;
}


static double x_of(const extent_t *x, uint64_t ns) {
  return (double)(ns - x->t0) * TIMELINE_WIDTH / (double)(x->t1 - x->t0);
}

/* One record: its wait pale, its run solid, on its rank's row (the daemon's work last). */
static void draw(void *data, const fsdp_op_record_t *r) {
  extent_t *x = data;
  if (r->step < x->min_step || !r->end_ns)
    return;
  bool work = r->kind == FSDP_RECORD_WORK;
  uint32_t row = work ? x->world : r->rank;
  const char *color = work ? "#7b5ea7" : r->kind == FSDP_RECORD_GATHER ? "#2a7ab9" : "#d17a22";
  uint64_t run_from = r->start_ns ? r->start_ns : r->end_ns;
  double y = row * ROW_HEIGHT + 2, wait_x = x_of(x, r->submit_ns), run_x = x_of(x, run_from);
  double end_x = x_of(x, r->end_ns);
  if (work)
    fprintf(x->out, "<g><title>the daemon's %s of ", fsdp_dataplane_work_name(r->work));
  else
    fprintf(x->out, "<g><title>rank %u's %s of ", r->rank,
            r->kind == FSDP_RECORD_GATHER ? "gather" : "reduce");
  const fsdp_unit_t *u = fsdp_store_unit_by_id(x->job, r->unit_id);
  html(x->out, u ? u->spec->unit : "");
  fprintf(x->out, " step %" PRIu64 ": %.3f ms (%.3f ms waiting)</title>", r->step,
          (double)(r->end_ns - run_from) / 1e6, (double)(run_from - r->submit_ns) / 1e6);
  if (run_x > wait_x)
    fprintf(x->out, "<rect x=\"%.1f\" y=\"%.0f\" width=\"%.1f\" height=\"%d\" fill=\"%s\" "
            "opacity=\"0.3\"/>", wait_x, y, run_x - wait_x, ROW_HEIGHT - 4, color);
  fprintf(x->out, "<rect x=\"%.1f\" y=\"%.0f\" width=\"%.1f\" height=\"%d\" fill=\"%s\"/></g>\n",
          run_x, y, end_x - run_x > 0.5 ? end_x - run_x : 0.5, ROW_HEIGHT - 4, color);
}

static void timeline(const fsdp_job_t *job, FILE *out) {
  extent_t x = {.t0 = UINT64_MAX, .world = job->local_world_size, .out = out, .job = job};
  if (!job->flight->recorder.capacity)
    return;
  fsdp_dataplane_each_record(job, find_newest, &x);
  x.min_step = x.newest >= TIMELINE_STEPS ? x.newest - TIMELINE_STEPS + 1 : 0;
  fsdp_dataplane_each_record(job, find_times, &x);
  if (x.t0 == UINT64_MAX || x.t1 <= x.t0)
    return;
  unsigned rows = x.world + 1, label = 110;
  fprintf(out, "<h3>The last steps (%" PRIu64 " to %" PRIu64 "), %.1f ms</h3>\n"
          "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%u\" height=\"%u\">"
          "<g font-size=\"12\" fill=\"#222\">", x.min_step, x.newest,
          (double)(x.t1 - x.t0) / 1e6, TIMELINE_WIDTH + label, rows * ROW_HEIGHT + 4);
  for (uint32_t r = 0; r <= x.world; r++) {
    if (r < x.world)
      fprintf(out, "<text x=\"0\" y=\"%u\">rank %u</text>", r * ROW_HEIGHT + 14, r);
    else
      fprintf(out, "<text x=\"0\" y=\"%u\">daemon work</text>", r * ROW_HEIGHT + 14);
  }
  fprintf(out, "</g><g transform=\"translate(%u,0)\">\n", label);
  fsdp_dataplane_each_record(job, draw, &x);
  fputs("</g></svg>\n<p>gathers blue, reduces orange, the daemon's work purple; pale: waiting "
        "for the other ranks or a buffer</p>\n", out);
}

void fsdp_services_render_page(void *data, FILE *out) {
  const fsdp_services_context_t *ctx = data;
  page_head(ctx, out);
  peers_table(ctx, out);
  for (const fsdp_job_t *job = ctx->store->jobs; job; job = job->next) {
    job_table(ctx, job, out);
    timeline(job, out);
  }
  if (!ctx->store->jobs)
    fputs("<p>No job yet.</p>\n", out);
  fputs("<p><a href=\"/metrics\">/metrics</a></p></body></html>\n", out);
}
