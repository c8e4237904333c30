/* A job's optimizer: its groups, which unit elements each steps, and the units' state. */
#include "daemon/dataplane/optimizer.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/dataplane/dataplane.h"

/* The state block: the step count on a cache line of its own, then the arrays, each on
 * cache lines of its own. */
#define STATE_HEADER 64

/* Which group steps each parameter of a unit, and the pieces that follow from it. */
typedef struct unit_plan {
  fsdp_optimizer_piece_t *pieces;
  size_t n_pieces;
  bool has_state;
  uint64_t state_offset;
  uint64_t stepped; /* the count its last run stepped with */
} unit_plan_t;

struct fsdp_optimizer {
  fsdp_optimizer_kind_t kind;
  double max_grad_norm; /* 0: none */
  fsdp_optimizer_group_t *groups; /* their params point into names */
  size_t n_groups;
  char **names; /* every group's parameter names, owned */
  size_t n_names;
  unsigned arrays; /* state arrays per unit */
  unit_plan_t *units; /* by unit id, made on first need */
  size_t n_units;
};

static const char *kind_name(fsdp_optimizer_kind_t kind) {
  switch (kind) {
  case FSDP_OPTIMIZER_ADAMW:
    return "ADAMW";
  case FSDP_OPTIMIZER_ADAM:
    return "ADAM";
  case FSDP_OPTIMIZER_SGD:
    return "SGD";
  default:
    return "OPTIMIZER_KIND_UNSPECIFIED";
  }
}

/* torch's own checks, field by field, naming the first that fails. */
static int check_group(fsdp_optimizer_kind_t kind, const fsdp_optimizer_group_t *group,
                       size_t i, fsdp_status_t *st) {
  const fsdp_optim_hyper_t *g = &group->hyper;
  bool sgd = kind == FSDP_OPTIMIZER_SGD;
  const struct {
    const char *name;
    double value, low, high; /* value in [low, high) */
    bool applies;
  } fields[] = {
      {"lr", g->lr, 0, INFINITY, true},
      {"weight_decay", g->weight_decay, 0, INFINITY, true},
      {"beta1", g->beta1, 0, 1, !sgd},
      {"beta2", g->beta2, 0, 1, !sgd},
      {"eps", g->eps, 0, INFINITY, !sgd},
      {"momentum", g->momentum, 0, INFINITY, sgd},
      {"dampening", g->dampening, -INFINITY, INFINITY, sgd},
  };
  for (size_t k = 0; k < sizeof fields / sizeof fields[0]; k++) {
    double v = fields[k].value;
    if (fields[k].applies && !(isfinite(v) && v >= fields[k].low && v < fields[k].high))
      return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                             "SetOptimizer: groups[%zu].%s = %g is outside [%g, %g)", i,
                             fields[k].name, v, fields[k].low, fields[k].high);
  }
  if (sgd && g->nesterov && (g->momentum <= 0 || g->dampening != 0))
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "SetOptimizer: groups[%zu].nesterov needs momentum > 0 and dampening "
                           "0 (momentum %g, dampening %g)",
                           i, g->momentum, g->dampening);
  return 0;
}

/* The unit holding the parameter called name, and its index there; NULL if none. */
static fsdp_unit_t *find_param(const fsdp_job_t *job, const char *name, size_t *ret_index) {
  for (fsdp_unit_t *u = job->units; u; u = u->next)
    for (size_t p = 0; p < u->spec->n_params; p++)
      if (strcmp(u->spec->params[p].name, name) == 0) {
        *ret_index = p;
        return u;
      }
  return NULL;
}

/* Every group's parameters are registered, trainable and named once; at most one group
 * names none. */
static int check_names(const fsdp_job_t *job, const fsdp_optimizer_group_t *groups, size_t n,
                       fsdp_status_t *st) {
  size_t catch_all = n;
  for (size_t i = 0; i < n; i++) {
    if (groups[i].n_params == 0) {
      if (catch_all < n)
        return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                               "SetOptimizer: groups[%zu] and groups[%zu] both name no "
                               "parameter; one group at most takes those no group names",
                               catch_all, i);
      catch_all = i;
    }
    for (size_t k = 0; k < groups[i].n_params; k++) {
      const char *name = groups[i].params[k];
      size_t index;
      fsdp_unit_t *u = find_param(job, name, &index);
      if (!u)
        return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                               "SetOptimizer: groups[%zu].params[%zu] '%s' is no parameter of "
                               "a unit registered in job '%s'",
                               i, k, name, job->name);
      if (!u->spec->params[index].requires_grad)
        return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                               "SetOptimizer: groups[%zu].params[%zu] '%s' (unit '%s') does not "
                               "require a gradient",
                               i, k, name, u->spec->unit);
      for (size_t j = 0; j <= i; j++)
        for (size_t m = 0; m < (j == i ? k : groups[j].n_params); m++)
          if (strcmp(groups[j].params[m], name) == 0)
            return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                                   "SetOptimizer: groups[%zu].params[%zu] '%s' is "
                                   "groups[%zu].params[%zu] already",
                                   i, k, name, j, m);
    }
  }
  return 0;
}

/* A change of kind, or of which parameters a group holds, after the first SetOptimizer. */
static int check_same_shape(const struct fsdp_optimizer *o, fsdp_optimizer_kind_t kind,
                            const fsdp_optimizer_group_t *groups, size_t n, fsdp_status_t *st) {
  if (kind != o->kind)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "SetOptimizer: kind %s, but the job's optimizer is %s: its kind "
                           "stays as first set",
                           kind_name(kind), kind_name(o->kind));
  if (n != o->n_groups)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "SetOptimizer: %zu groups, but the job's optimizer has %zu: its groups "
                           "stay as first set",
                           n, o->n_groups);
  for (size_t i = 0; i < n; i++) {
    bool same = groups[i].n_params == o->groups[i].n_params;
    for (size_t k = 0; same && k < groups[i].n_params; k++)
      same = strcmp(groups[i].params[k], o->groups[i].params[k]) == 0;
    if (!same)
      return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                             "SetOptimizer: groups[%zu] names other parameters than the job's "
                             "optimizer gave it: a group's parameters stay as first set",
                             i);
    /* amsgrad decides the state's arrays, and with it the state's layout. */
    if (groups[i].hyper.amsgrad != o->groups[i].hyper.amsgrad)
      return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                             "SetOptimizer: groups[%zu].amsgrad %s, but the job's optimizer set "
                             "it %s: it stays as first set",
                             i, groups[i].hyper.amsgrad ? "true" : "false",
                             o->groups[i].hyper.amsgrad ? "true" : "false");
  }
  return 0;
}

static void optimizer_free(struct fsdp_optimizer *o);

/* A new optimizer holding copies of the groups' names. */
static struct fsdp_optimizer *optimizer_new(fsdp_optimizer_kind_t kind,
                                            const fsdp_optimizer_group_t *groups, size_t n) {
  struct fsdp_optimizer *o = calloc(1, sizeof *o);
  size_t n_names = 0;
  for (size_t i = 0; i < n; i++)
    n_names += groups[i].n_params;
  if (!o || !(o->groups = calloc(n ? n : 1, sizeof *o->groups)) ||
      !(o->names = calloc(n_names ? n_names : 1, sizeof *o->names))) {
    optimizer_free(o);
    return NULL;
  }
  o->kind = kind;
  o->n_groups = n;
  bool amsgrad = false;
  for (size_t i = 0; i < n; i++) {
    o->groups[i] = groups[i];
    o->groups[i].params = (const char *const *)&o->names[o->n_names];
    for (size_t k = 0; k < groups[i].n_params; k++)
      if (!(o->names[o->n_names++] = strdup(groups[i].params[k]))) {
        optimizer_free(o);
        return NULL;
      }
    amsgrad = amsgrad || groups[i].hyper.amsgrad;
  }
  o->arrays = kind == FSDP_OPTIMIZER_SGD ? 1 : amsgrad ? 3 : 2;
  return o;
}

int fsdp_optimizer_set(fsdp_job_t *job, fsdp_optimizer_kind_t kind,
                       const fsdp_optimizer_group_t *groups, size_t n_groups,
                       double max_grad_norm, fsdp_status_t *st) {
  if (kind < FSDP_OPTIMIZER_ADAMW || kind > FSDP_OPTIMIZER_SGD)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "SetOptimizer: kind %d is not ADAMW, ADAM or SGD", (int)kind);
  if (!(isfinite(max_grad_norm) && max_grad_norm >= 0))
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "SetOptimizer: max_grad_norm = %g is outside [0, inf)", max_grad_norm);
  if (n_groups == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "SetOptimizer: groups is empty: give at least one");
  int r;
  for (size_t i = 0; i < n_groups; i++)
    if ((r = check_group(kind, &groups[i], i, st)) < 0)
      return r;
  struct fsdp_optimizer *o = job->optimizer;
  /* Names are looked up among the job's parameters once, at the first set: a later one (an
   * LR schedule's, every step) only has to name the same ones. */
  if ((r = o ? check_same_shape(o, kind, groups, n_groups, st)
             : check_names(job, groups, n_groups, st)) < 0)
    return r;
  if (o) {
    for (size_t i = 0; i < n_groups; i++) { /* the hyperparameters only; the names stay */
      const char *const *names = o->groups[i].params;
      o->groups[i] = groups[i];
      o->groups[i].params = names;
    }
  } else if (!(job->optimizer = optimizer_new(kind, groups, n_groups))) {
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "SetOptimizer: out of memory");
  } else {
    job->optimizer_free = optimizer_free; /* the store frees the job without knowing it */
  }
  job->optimizer->max_grad_norm = max_grad_norm;
  return 0;
}

double fsdp_optimizer_max_grad_norm(const fsdp_job_t *job) {
  return job->optimizer ? job->optimizer->max_grad_norm : 0;
}

int fsdp_optimizer_grad_norm_sq(const fsdp_job_t *job, const fsdp_unit_t *u,
                                const fsdp_backend_t *backend, double *ret, fsdp_status_t *st) {
  const float *g = (const float *)(const void *)((const char *)fsdp_arena_base(job->arena) +
                                                 u->grad_offset);
  return fsdp_backend_sum_squares(backend, g, (size_t)u->plan.local_shards * u->layout.shard_numel,
                                  ret, st);
}

bool fsdp_optimizer_is_set(const fsdp_job_t *job) {
  return job->optimizer != NULL;
}

const char *fsdp_optimizer_kind_name(const fsdp_job_t *job) {
  return job->optimizer ? kind_name(job->optimizer->kind) : "";
}

/* The group of a unit's parameter: the one naming it, or the one naming none; -1: none. */
static int group_of(const struct fsdp_optimizer *o, const char *name) {
  int catch_all = -1;
  for (size_t i = 0; i < o->n_groups; i++) {
    if (o->groups[i].n_params == 0)
      catch_all = (int)i;
    for (size_t k = 0; k < o->groups[i].n_params; k++)
      if (strcmp(o->groups[i].params[k], name) == 0)
        return (int)i;
  }
  return catch_all;
}

static size_t array_stride(const fsdp_unit_t *u) {
  return ((size_t)u->plan.local_shards * u->layout.shard_numel * 4 + 63) / 64 * 64;
}

/* The unit's plan: its pieces (made on first need) and its state's place. */
static unit_plan_t *unit_plan(struct fsdp_optimizer *o, const fsdp_unit_t *u, fsdp_status_t *st) {
  if (u->id >= o->n_units) {
    size_t n = u->id + 1;
    unit_plan_t *units = realloc(o->units, n * sizeof *units);
    if (!units) {
      fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for the optimizer");
      return NULL;
    }
    memset(units + o->n_units, 0, (n - o->n_units) * sizeof *units);
    o->units = units;
    o->n_units = n;
  }
  unit_plan_t *p = &o->units[u->id];
  if (p->pieces)
    return p;
  unsigned shards = u->plan.local_shards;
  p->pieces = calloc(u->spec->n_params * shards, sizeof *p->pieces);
  if (!p->pieces) {
    fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for the optimizer");
    return NULL;
  }
  uint64_t first = (uint64_t)u->plan.first_shard * u->layout.shard_numel;
  for (size_t k = 0; k < u->spec->n_params; k++) {
    int g = u->spec->params[k].requires_grad ? group_of(o, u->spec->params[k].name) : -1;
    for (unsigned s = u->plan.first_shard; g >= 0 && s < u->plan.first_shard + shards; s++) {
      uint64_t begin, end, unsharded_at;
      fsdp_unit_layout_param_in_shard(&u->layout, k, s, &begin, &end, &unsharded_at);
      if (begin >= end)
        continue; /* not stepped here */
      fsdp_optimizer_piece_t *last = p->n_pieces ? &p->pieces[p->n_pieces - 1] : NULL;
      if (last && last->group == (unsigned)g && last->end == begin - first)
        last->end = end - first; /* FLAT: the parameter goes on in the next shard */
      else
        p->pieces[p->n_pieces++] = (fsdp_optimizer_piece_t){
            .begin = begin - first, .end = end - first, .group = (unsigned)g};
    }
  }
  return p;
}

bool fsdp_optimizer_steps_unit(fsdp_job_t *job, const fsdp_unit_t *u) {
  if (!job->optimizer || !u->trainable || u->flight->state != FSDP_UNIT_READY)
    return false;
  fsdp_status_t st;
  const unit_plan_t *p = unit_plan(job->optimizer, u, &st);
  return !p || p->n_pieces > 0; /* out of memory: its step will say so */
}

int fsdp_optimizer_unit_state(fsdp_job_t *job, fsdp_unit_t *u, fsdp_optimizer_state_t *ret,
                              fsdp_status_t *st) {
  struct fsdp_optimizer *o = job->optimizer;
  if (!o)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "job '%s' has no optimizer in the daemon (SetOptimizer)", job->name);
  if (!u->trainable)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "unit '%s' has no parameter that requires a gradient", u->spec->unit);
  unit_plan_t *p = unit_plan(o, u, st);
  if (!p)
    return st->code;
  if (!p->has_state) {
    size_t bytes = STATE_HEADER + o->arrays * array_stride(u);
    uint64_t offset;
    int r = fsdp_arena_alloc(job->arena, bytes, 64, &offset, st);
    if (r < 0)
      return fsdp_status_set(st, r, "unit '%s': no room for its optimizer state: %s",
                             u->spec->unit, st->message);
    /* State starts at zero, as torch's does (its step count too). */
    if ((r = fsdp_backend_zero(job->backend, (char *)fsdp_arena_base(job->arena) + offset, bytes,
                               st)) < 0) {
      fsdp_arena_release(job->arena, offset);
      return fsdp_status_set(st, r, "unit '%s': its optimizer state: %s", u->spec->unit,
                             st->message);
    }
    p->has_state = true;
    p->state_offset = offset;
  }
  *ret = (fsdp_optimizer_state_t){.steps_offset = p->state_offset,
                                  .arrays_offset = p->state_offset + STATE_HEADER,
                                  .arrays = o->arrays, .array_stride = array_stride(u)};
  return 0;
}

static uint64_t *step_count(const fsdp_job_t *job, const unit_plan_t *p) {
  return (uint64_t *)(void *)((char *)fsdp_arena_base(job->arena) + p->state_offset);
}

uint64_t fsdp_optimizer_unit_steps(const fsdp_job_t *job, const fsdp_unit_t *u) {
  const struct fsdp_optimizer *o = job->optimizer;
  if (!o || u->id >= o->n_units || !o->units[u->id].has_state)
    return 0;
  const unit_plan_t *p = &o->units[u->id];
  return fsdp_backend_memory_is_host(job->backend) ? *step_count(job, p) : p->stepped;
}

void fsdp_optimizer_stepped(fsdp_job_t *job, const fsdp_unit_t *u, uint64_t step) {
  if (job->optimizer && u && u->id < job->optimizer->n_units)
    job->optimizer->units[u->id].stepped = step;
}

size_t fsdp_optimizer_state_bytes(const fsdp_job_t *job) {
  const struct fsdp_optimizer *o = job->optimizer;
  size_t bytes = 0;
  for (const fsdp_unit_t *u = job->units; o && u; u = u->next)
    if (u->id < o->n_units && o->units[u->id].has_state)
      bytes += STATE_HEADER + o->arrays * array_stride(u);
  return bytes;
}

int fsdp_optimizer_plan(fsdp_job_t *job, fsdp_unit_t *u, fsdp_optimizer_plan_t *ret_plan,
                        fsdp_status_t *st) {
  fsdp_optimizer_state_t state = {0}; /* set unless r < 0, which -O3 cannot follow */
  int r = fsdp_optimizer_unit_state(job, u, &state, st);
  if (r < 0)
    return r;
  struct fsdp_optimizer *o = job->optimizer;
  const unit_plan_t *p = &o->units[u->id];
  fsdp_optimizer_group_t *groups = malloc(o->n_groups * sizeof *groups);
  if (!groups)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for the optimizer");
  memcpy(groups, o->groups, o->n_groups * sizeof *groups);
  char *base = fsdp_arena_base(job->arena);
  *ret_plan = (fsdp_optimizer_plan_t){
      .kind = o->kind,
      .steps = step_count(job, p),
      .pieces = p->pieces,
      .n_pieces = p->n_pieces,
      .groups = groups,
      .n_groups = o->n_groups,
      .master = (float *)(void *)(base + u->master_offset),
      .grad = (float *)(void *)(base + u->grad_offset),
  };
  for (unsigned a = 0; a < o->arrays; a++)
    ret_plan->state[a] = (float *)(void *)(base + state.arrays_offset + a * state.array_stride);
  return 0;
}

void fsdp_optimizer_plan_cleanup(fsdp_optimizer_plan_t *plan) {
  free(plan->groups);
  plan->groups = NULL;
}

static void optimizer_free(struct fsdp_optimizer *o) {
  if (!o)
    return;
  for (size_t i = 0; i < o->n_units; i++)
    free(o->units[i].pieces);
  free(o->units);
  for (size_t i = 0; o->names && i < o->n_names; i++)
    free(o->names[i]);
  free(o->names);
  free(o->groups);
  free(o);
}

int fsdp_optimizer_run(fsdp_optimizer_plan_t *plan, const fsdp_backend_t *backend,
                       fsdp_status_t *st) {
  fsdp_optim_rule_t rule = plan->kind == FSDP_OPTIMIZER_ADAMW ? FSDP_OPTIM_RULE_ADAMW
                           : plan->kind == FSDP_OPTIMIZER_ADAM ? FSDP_OPTIM_RULE_ADAM
                                                               : FSDP_OPTIM_RULE_SGD;
  uint64_t steps;
  int r = fsdp_backend_copy(backend, &steps, plan->steps, sizeof steps, st);
  if (r < 0)
    return r;
  plan->step = ++steps;
  if ((r = fsdp_backend_copy(backend, plan->steps, &steps, sizeof steps, st)) < 0)
    return r;
  for (size_t k = 0; k < plan->n_pieces; k++) {
    const fsdp_optimizer_piece_t *piece = &plan->pieces[k];
    fsdp_optim_step_t step = fsdp_optim_prepare(rule, &plan->groups[piece->group].hyper,
                                                plan->step, plan->clip, plan->clip_coef);
    float *state[3] = {NULL, NULL, NULL};
    for (size_t a = 0; a < 3; a++)
      if (plan->state[a])
        state[a] = plan->state[a] + piece->begin;
    r = fsdp_backend_optim_step(backend, &step, plan->master + piece->begin,
                                plan->grad + piece->begin, state, piece->end - piece->begin, st);
    if (r < 0)
      return r;
  }
  return 0;
}
