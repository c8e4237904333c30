/* Operator.Why: what a job waits for, the analysis PyTorch's fr_trace does on a dump, done
 * by the daemon, which sees every local rank's requests: each collective under way with the
 * local ranks it has and those it waits for (daemon/dataplane's), and what each local rank
 * last did (its last operation the job's flight recorder holds), for fsdpctl why. */
#include "daemon/services/operator_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "daemon/services/calls.h"
#include "daemon/services/context.h"

typedef struct why {
  const fsdp_job_t *job;
  uint32_t world;
  Fsdp__V1__WaitingCollective *waiting, **waiting_ptrs;
  uint32_t *ranks_storage; /* asked and missing ranks, world x 2 for each collective */
  size_t n_waiting, cap;
  fsdp_op_record_t *last; /* world of them */
  bool *has_last, *attached;
} why_t;

static void count_wait(void *data, const fsdp_dataplane_wait_t *w) {
  (void)w;
  ((why_t *)data)->cap++;
}

static void add_wait(void *data, const fsdp_dataplane_wait_t *w) {
  why_t *y = data;
  Fsdp__V1__WaitingCollective *out = &y->waiting[y->n_waiting];
  uint32_t *asked = y->ranks_storage + 2 * y->world * y->n_waiting, *missing = asked + y->world;
  fsdp__v1__waiting_collective__init(out);
  out->unit = (char *)w->unit->spec->unit;
  out->what = (char *)w->what;
  out->step = w->step;
  out->waited_ms = w->waited_ms;
  out->running = w->running;
  out->across_hosts = w->across_hosts;
  out->asked = asked;
  out->missing = missing;
  for (uint32_t r = 0; r < y->world; r++) {
    if (fsdp_rank_set_has(&w->asked, r))
      asked[out->n_asked++] = r;
    else if (!w->running)
      missing[out->n_missing++] = r;
  }
  y->waiting_ptrs[y->n_waiting++] = out;
}

/* Each rank's newest gather or reduce: the records come oldest first. */
static void note_last(void *data, const fsdp_op_record_t *r) {
  why_t *y = data;
  if (r->kind == FSDP_RECORD_WORK || r->rank >= y->world)
    return;
  y->last[r->rank] = *r;
  y->has_last[r->rank] = true;
}

/* The longest waits first, ties in the data plane's order (units in order, a gather before
 * a reduce): a stable sort, so that the first is the one health's reason names. */
static void oldest_first(Fsdp__V1__WaitingCollective **w, size_t n) {
  for (size_t i = 1; i < n; i++)
    for (size_t j = i; j > 0 && w[j]->waited_ms > w[j - 1]->waited_ms; j--) {
      Fsdp__V1__WaitingCollective *t = w[j];
      w[j] = w[j - 1];
      w[j - 1] = t;
    }
}

static const char *unit_name(const fsdp_job_t *job, uint32_t id) {
  const fsdp_unit_t *u = fsdp_store_unit_by_id(job, id);
  return u ? u->spec->unit : "";
}

/* The missing ranks the verdict tells of; the table lists every one. With unit names of at
 * most FSDP_UNIT_NAME_MAX bytes, the verdict then always fits its buffer whole. */
#define VERDICT_RANKS 8
#define VERDICT_BYTES 4096

/* The verdict: the oldest wait as health says it, then what each rank it waits for did. */
static void verdict(const why_t *y, uint64_t now_ms, uint64_t now_ns, char *buf, size_t size) {
  if (!fsdp_dataplane_describe_oldest(y->job, now_ms, buf, size)) {
    snprintf(buf, size, "job '%s': nothing waits", y->job->name);
    return;
  }
  const Fsdp__V1__WaitingCollective *oldest = y->waiting_ptrs[0];
  for (size_t i = 0; i < oldest->n_missing && i < VERDICT_RANKS; i++) {
    uint32_t r = oldest->missing[i];
    size_t at = strlen(buf);
    if (!y->attached[r]) {
      snprintf(buf + at, size - at, "; local rank %u has no session", r);
    } else if (!y->has_last[r]) {
      snprintf(buf + at, size - at, "; local rank %u never asked for a gather or reduce", r);
    } else {
      const fsdp_op_record_t *l = &y->last[r];
      double ago = now_ns > l->end_ns ? (double)(now_ns - l->end_ns) / 1e9 : 0.0;
      snprintf(buf + at, size - at, "; local rank %u last: %s of unit '%s' step %llu, %.1f s ago",
               r, l->kind == FSDP_RECORD_GATHER ? "gather" : "reduce",
               unit_name(y->job, l->unit_id), (unsigned long long)l->step, ago);
    }
  }
  if (oldest->n_missing > VERDICT_RANKS) {
    size_t at = strlen(buf);
    snprintf(buf + at, size - at, "; and %zu more (the table)",
             oldest->n_missing - VERDICT_RANKS);
  }
}

void fsdp_operator_why(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data) {
  const Fsdp__V1__WhyRequest *rq = (const void *)request;
  fsdp_services_context_t *ctx = data;
  const fsdp_job_t *job = fsdp_operator_job(call, ctx->store, rq->job);
  if (!job)
    return;
  uint64_t now_ms = uv_now(ctx->loop), now_ns = fsdp_clock_now_ns();
  why_t y = {.job = job, .world = job->local_world_size};
  fsdp_dataplane_each_wait(job, now_ms, count_wait, &y);
  size_t slots = y.cap ? y.cap : 1;
  y.waiting = calloc(slots, sizeof *y.waiting);
  y.waiting_ptrs = calloc(slots, sizeof *y.waiting_ptrs);
  y.ranks_storage = calloc(slots * 2 * (y.world ? y.world : 1), sizeof *y.ranks_storage);
  y.last = calloc(y.world ? y.world : 1, sizeof *y.last);
  y.has_last = calloc(y.world ? y.world : 1, sizeof *y.has_last);
  y.attached = calloc(y.world ? y.world : 1, sizeof *y.attached);
  Fsdp__V1__RankActivity *ranks = calloc(y.world ? y.world : 1, sizeof *ranks);
  Fsdp__V1__RankActivity **rank_ptrs = calloc(y.world ? y.world : 1, sizeof *rank_ptrs);
  Fsdp__V1__OpRecord *lasts = calloc(y.world ? y.world : 1, sizeof *lasts);
  if (!y.waiting || !y.waiting_ptrs || !y.ranks_storage || !y.last || !y.has_last ||
      !y.attached || !ranks || !rank_ptrs || !lasts) {
    fsdp_rpc_call_fail(call, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for job '%s''s why",
                       job->name);
    goto out;
  }
  fsdp_dataplane_each_wait(job, now_ms, add_wait, &y);
  oldest_first(y.waiting_ptrs, y.n_waiting);
  fsdp_dataplane_each_record(job, note_last, &y);
  for (const fsdp_session_t *s = ctx->sessions->head; s; s = s->next)
    if (strcmp(s->job, job->name) == 0 && s->local_rank < y.world)
      y.attached[s->local_rank] = true;
  for (uint32_t r = 0; r < y.world; r++) {
    fsdp__v1__rank_activity__init(&ranks[r]);
    ranks[r].rank = r;
    ranks[r].attached = y.attached[r];
    if (y.has_last[r]) {
      fsdp_operator_op_record(&y.last[r], unit_name(job, y.last[r].unit_id), &lasts[r]);
      ranks[r].last = &lasts[r];
      ranks[r].idle_ms = now_ns > y.last[r].end_ns ? (now_ns - y.last[r].end_ns) / 1000000 : 0;
    }
    rank_ptrs[r] = &ranks[r];
  }
  char line[VERDICT_BYTES];
  verdict(&y, now_ms, now_ns, line, sizeof line);
  Fsdp__V1__WhyReply reply = FSDP__V1__WHY_REPLY__INIT;
  reply.job = (char *)job->name;
  reply.verdict = line;
  reply.n_waiting = y.n_waiting;
  reply.waiting = y.waiting_ptrs;
  reply.n_ranks = y.world;
  reply.ranks = rank_ptrs;
  fsdp_rpc_call_reply(call, &reply.base);
out:
  free(y.waiting);
  free(y.waiting_ptrs);
  free(y.ranks_storage);
  free(y.last);
  free(y.has_last);
  free(y.attached);
  free(ranks);
  free(rank_ptrs);
  free(lasts);
}
