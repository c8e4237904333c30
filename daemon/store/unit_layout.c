/* Unit layouts (FLAT and PER_PARAM, and their runs) and spec checks. */
#include "daemon/store/unit_layout.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *fsdp_unit_dtype_name(fsdp_unit_dtype_t dtype) {
  static const char *const names[] = {"DTYPE_UNSPECIFIED", "DTYPE_FP32", "DTYPE_BF16",
                                      "DTYPE_FP16"};
  return (unsigned)dtype < sizeof names / sizeof names[0] ? names[dtype] : "?";
}

const char *fsdp_unit_layout_name(fsdp_unit_layout_kind_t layout) {
  static const char *const names[] = {"LAYOUT_FLAT", "LAYOUT_PER_PARAM"};
  return (unsigned)layout < sizeof names / sizeof names[0] ? names[layout] : "?";
}

const char *fsdp_unit_strategy_name(fsdp_unit_strategy_t strategy) {
  static const char *const names[] = {"STRATEGY_UNSPECIFIED", "FULL_SHARD", "SHARD_GRAD_OP",
                                      "HYBRID_SHARD", "NO_SHARD"};
  return (unsigned)strategy < sizeof names / sizeof names[0] ? names[strategy] : "?";
}

static size_t align8(size_t n) {
  return (n + 7) / 8 * 8;
}

int fsdp_unit_spec_copy(const fsdp_unit_spec_t *spec, fsdp_unit_spec_t **ret_copy) {
  /* The struct, the parameters, their shapes, then every string. */
  size_t size = align8(sizeof *spec) + align8(spec->n_params * sizeof *spec->params);
  for (size_t i = 0; i < spec->n_params; i++)
    size += spec->params[i].n_shape * sizeof(uint64_t);
  size += strlen(spec->unit) + 1;
  for (size_t i = 0; i < spec->n_params; i++)
    size += strlen(spec->params[i].name) + 1;
  char *block = malloc(size);
  if (!block)
    return -ENOMEM;
  fsdp_unit_spec_t *copy = (fsdp_unit_spec_t *)(void *)block;
  *copy = *spec;
  char *next = block + align8(sizeof *spec);
  copy->params = (fsdp_param_spec_t *)(void *)next;
  next += align8(spec->n_params * sizeof *spec->params);
  for (size_t i = 0; i < spec->n_params; i++) {
    const fsdp_param_spec_t *p = &spec->params[i];
    copy->params[i] = *p;
    copy->params[i].shape = (uint64_t *)(void *)next;
    if (p->n_shape)
      memcpy(next, p->shape, p->n_shape * sizeof(uint64_t));
    next += p->n_shape * sizeof(uint64_t);
  }
  copy->unit = strcpy(next, spec->unit);
  next += strlen(spec->unit) + 1;
  for (size_t i = 0; i < spec->n_params; i++) {
    copy->params[i].name = strcpy(next, spec->params[i].name);
    next += strlen(next) + 1;
  }
  *ret_copy = copy;
  return 0;
}

void fsdp_unit_spec_free(fsdp_unit_spec_t *spec) {
  free(spec);
}

/* "[4096,1024]" into buf; "[]" for a scalar. */
static void format_shape(const fsdp_param_spec_t *p, char *buf, size_t size) {
  size_t used = (size_t)snprintf(buf, size, "[");
  for (size_t d = 0; d < p->n_shape && used < size; d++)
    used += (size_t)snprintf(buf + used, size - used, "%s%llu", d ? "," : "",
                             (unsigned long long)p->shape[d]);
  if (used < size)
    snprintf(buf + used, size - used, "]");
}

/* Element count of a parameter. The product of its nonzero dimensions must stay within
 * FSDP_UNIT_MAX_NUMEL, so that a zero elsewhere ([0, 2^64-1]) hides no dimension that
 * could not be: returns the index of the first dimension past the limit as -1 - d. */
static int64_t param_numel(const fsdp_param_spec_t *p, uint64_t *ret_numel) {
  uint64_t nonzero = 1;
  bool empty = false;
  for (size_t d = 0; d < p->n_shape; d++) {
    if (p->shape[d] == 0)
      empty = true;
    else if (__builtin_mul_overflow(nonzero, p->shape[d], &nonzero) ||
             nonzero > FSDP_UNIT_MAX_NUMEL)
      return -1 - (int64_t)d;
  }
  *ret_numel = empty ? 0 : nonzero;
  return 0;
}

static int compare_names(const void *a, const void *b) {
  return strcmp((*(const fsdp_param_spec_t *const *)a)->name,
                (*(const fsdp_param_spec_t *const *)b)->name);
}

/* Duplicate parameter names, found by sorting pointers (a unit may hold 65536 of them). */
static int check_unique_names(const fsdp_unit_spec_t *spec, fsdp_status_t *st) {
  const fsdp_param_spec_t **sorted = malloc(spec->n_params * sizeof *sorted);
  if (!sorted)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory checking unit '%s'",
                           spec->unit);
  for (size_t i = 0; i < spec->n_params; i++)
    sorted[i] = &spec->params[i];
  qsort(sorted, spec->n_params, sizeof *sorted, compare_names);
  int r = 0;
  for (size_t i = 1; i < spec->n_params && r == 0; i++)
    if (strcmp(sorted[i - 1]->name, sorted[i]->name) == 0)
      r = fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                          "unit '%s': parameter name '%s' appears more than once", spec->unit,
                          sorted[i]->name);
  free(sorted);
  return r;
}

/* The bounds of a gradient divide factor f, and of the product of the two: 2^-24 <= f <=
 * 2^24. The kernels scale by 1/f in fp32 and refuse a scale that is not finite: 1e-310 is
 * subnormal and its reciprocal overflows, and 1e308 leaves the other factor world/1e308,
 * whose reciprocal overflows too (before these bounds every ReduceScatter of such a unit
 * failed, as INTERNAL); the bounds keep 1/f a normal fp32. A reduce may run in fp16, the narrowest range of the three
 * reduce types: finite magnitudes from 2^-24 to 65504 < 2^16, 40 binades (bf16 and fp32
 * span 277). Dividing by f moves every magnitude by log2 f binades, the predivide factor
 * on each rank's gradient and the postdivide factor on the sum; with each factor and their
 * product within 2^24, a gradient meets three placements of fp16's range (its own, after
 * the predivide, after both) at most 24 binades apart, so at least 16 binades of values
 * survive every step: no factor in bounds turns every gradient into 0 or Inf, where 2^40
 * would. FSDP's own factors lie between 1 and the data-parallel size, at most 4096 hosts
 * x 256 ranks = 2^20. */
#define FACTOR_MIN 0x1p-24
#define FACTOR_MAX 0x1p24

static int factor_out_of_bounds(const fsdp_unit_spec_t *spec, const char *what,
                                double v, fsdp_status_t *st) {
  return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                         "unit '%s': %s = %g, outside [%g (2^-24), %g (2^24)] (0 asks for the "
                         "default)",
                         spec->unit, what, v, FACTOR_MIN, FACTOR_MAX);
}

static bool factor_in_bounds(double v) {
  return v >= FACTOR_MIN && v <= FACTOR_MAX; /* false for NaN */
}

static int check_factors(const fsdp_unit_spec_t *spec, fsdp_status_t *st) {
  double pre = spec->gradient_predivide_factor, post = spec->gradient_postdivide_factor;
  if (pre != 0 && !factor_in_bounds(pre))
    return factor_out_of_bounds(spec, "gradient_predivide_factor", pre, st);
  if (post != 0 && !factor_in_bounds(post))
    return factor_out_of_bounds(spec, "gradient_postdivide_factor", post, st);
  if (pre != 0 && post != 0 && !factor_in_bounds(pre * post))
    return factor_out_of_bounds(spec, "gradient_predivide_factor * gradient_postdivide_factor",
                                pre * post, st);
  return 0;
}

int fsdp_unit_gradient_scales(const fsdp_unit_spec_t *spec, unsigned world,
                              float *ret_pre, float *ret_post, fsdp_status_t *st) {
  double pre = spec->gradient_predivide_factor, post = spec->gradient_postdivide_factor;
  char what[160] = "";
  if (pre == 0 && post != 0) {
    pre = world / post;
    snprintf(what, sizeof what,
             "gradient_predivide_factor (0: data-parallel size %u / gradient_postdivide_factor "
             "%g)",
             world, post);
  } else if (post == 0) {
    if (pre == 0)
      pre = 1;
    post = world / pre;
    snprintf(what, sizeof what,
             "gradient_postdivide_factor (0: data-parallel size %u / gradient_predivide_factor "
             "%g)",
             world, pre);
  }
  /* The factors given were checked; a derived one is checked here, their product being the
   * data-parallel size. */
  if (!factor_in_bounds(pre))
    return factor_out_of_bounds(spec, what, pre, st);
  if (!factor_in_bounds(post))
    return factor_out_of_bounds(spec, what, post, st);
  *ret_pre = (float)(1 / pre);
  *ret_post = (float)(1 / post);
  return 0;
}

int fsdp_unit_spec_check(const fsdp_unit_spec_t *spec, fsdp_status_t *st) {
  size_t len = strlen(spec->unit);
  if (len == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "field 'unit' is empty");
  if (len > FSDP_UNIT_NAME_MAX)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'unit' is %zu bytes long, more than %d", len, FSDP_UNIT_NAME_MAX);
  if (spec->layout != FSDP_UNIT_LAYOUT_FLAT && spec->layout != FSDP_UNIT_LAYOUT_PER_PARAM)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "unit '%s': field 'layout' = %d is not LAYOUT_FLAT or "
                           "LAYOUT_PER_PARAM",
                           spec->unit, (int)spec->layout);
  if (spec->strategy == FSDP_UNIT_STRATEGY_UNSPECIFIED)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "unit '%s': field 'strategy' is unspecified; expected FULL_SHARD, "
                           "SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD",
                           spec->unit);
  if (spec->n_params == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "unit '%s' has no parameters", spec->unit);
  if (spec->n_params > FSDP_UNIT_MAX_PARAMS)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "unit '%s' has %zu parameters, more than %d",
                           spec->unit, spec->n_params, FSDP_UNIT_MAX_PARAMS);

  uint64_t total = 0;
  for (size_t i = 0; i < spec->n_params; i++) {
    const fsdp_param_spec_t *p = &spec->params[i];
    size_t name_len = strlen(p->name);
    if (name_len == 0 || name_len > FSDP_UNIT_NAME_MAX)
      return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                             "unit '%s': params[%zu].name is %s", spec->unit, i,
                             name_len ? "longer than 256 bytes" : "empty");
    if (p->dtype == FSDP_UNIT_DTYPE_UNSPECIFIED)
      return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                             "unit '%s': params[%zu].dtype of '%s' is unspecified", spec->unit, i,
                             p->name);
    if (p->dtype != spec->params[0].dtype)
      return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                             "unit '%s': params[%zu] '%s' is %s but params[0] '%s' is %s; a unit "
                             "holds one element type",
                             spec->unit, i, p->name, fsdp_unit_dtype_name(p->dtype),
                             spec->params[0].name, fsdp_unit_dtype_name(spec->params[0].dtype));
    if (p->n_shape > FSDP_UNIT_MAX_DIMS)
      return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                             "unit '%s': params[%zu] '%s' has %zu dimensions, more than %d",
                             spec->unit, i, p->name, p->n_shape, FSDP_UNIT_MAX_DIMS);
    uint64_t numel;
    int64_t bad_dim = param_numel(p, &numel);
    if (bad_dim < 0) {
      size_t d = (size_t)(-1 - bad_dim);
      return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                             "unit '%s': params[%zu] '%s' shape[%zu] = %llu takes the product of "
                             "its nonzero dimensions past the limit of %llu elements",
                             spec->unit, i, p->name, d, (unsigned long long)p->shape[d],
                             (unsigned long long)FSDP_UNIT_MAX_NUMEL);
    }
    if (__builtin_add_overflow(total, numel, &total) || total > FSDP_UNIT_MAX_NUMEL) {
      char shape[128];
      format_shape(p, shape, sizeof shape);
      return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                             "unit '%s': params[%zu] '%s' shape %s brings the unit past %llu "
                             "elements",
                             spec->unit, i, p->name, shape,
                             (unsigned long long)FSDP_UNIT_MAX_NUMEL);
    }
  }
  if (total == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "unit '%s' has no elements: every parameter has size 0", spec->unit);
  int r = check_unique_names(spec, st);
  if (r < 0)
    return r;
  return check_factors(spec, st);
}

/* PER_PARAM's pieces: parameter i's rows per shard (torch.chunk's ceil(dim0 / S); a scalar is
 * one row) and where its piece is in each shard; the shard's length before padding. */
static uint64_t lay_pieces(fsdp_unit_layout_t *layout, const fsdp_unit_spec_t *spec) {
  uint64_t at = 0;
  for (size_t i = 0; i < spec->n_params; i++) {
    const fsdp_param_spec_t *p = &spec->params[i];
    uint64_t dim0 = p->n_shape ? p->shape[0] : 1;
    uint64_t rows = (dim0 + layout->shards - 1) / layout->shards;
    layout->row_numels[i] = dim0 ? layout->numels[i] / dim0 : 0;
    layout->rows_per_shard[i] = rows;
    layout->shard_offsets[i] = at;
    at += rows * layout->row_numels[i]; /* within the unit's limit: rows <= dim0 */
  }
  return at;
}

int fsdp_unit_layout_init(fsdp_unit_layout_t *layout, const fsdp_unit_spec_t *spec,
                          unsigned shards, unsigned pad_multiple, fsdp_status_t *st) {
  memset(layout, 0, sizeof *layout);
  if (shards == 0 || pad_multiple % shards != 0)
    return fsdp_status_set(st, -EINVAL, "unit '%s': %u shards padded to a multiple of %u",
                           spec->unit, shards, pad_multiple);
  bool per_param = spec->layout == FSDP_UNIT_LAYOUT_PER_PARAM;
  size_t arrays = per_param ? 5 : 2;
  layout->offsets = calloc(arrays * (spec->n_params ? spec->n_params : 1), sizeof(uint64_t));
  if (!layout->offsets)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory laying out unit '%s'",
                           spec->unit);
  layout->numels = layout->offsets + spec->n_params;
  if (per_param) {
    layout->shard_offsets = layout->numels + spec->n_params;
    layout->rows_per_shard = layout->shard_offsets + spec->n_params;
    layout->row_numels = layout->rows_per_shard + spec->n_params;
  }
  layout->kind = spec->layout;
  layout->n_params = spec->n_params;
  layout->shards = shards;
  for (size_t i = 0; i < spec->n_params; i++) {
    /* The spec was checked: no element count overflows. */
    param_numel(&spec->params[i], &layout->numels[i]);
    layout->offsets[i] = layout->numel;
    layout->numel += layout->numels[i];
  }
  /* Each shard is padded so that the whole is a multiple of pad_multiple. */
  unsigned per_shard = pad_multiple / shards;
  uint64_t shard = per_param ? lay_pieces(layout, spec) : (layout->numel + shards - 1) / shards;
  layout->shard_numel = (shard + per_shard - 1) / per_shard * per_shard;
  layout->padded_numel = layout->shard_numel * shards;
  return 0;
}

void fsdp_unit_layout_cleanup(fsdp_unit_layout_t *layout) {
  if (!layout)
    return;
  free(layout->offsets);
  layout->offsets = layout->numels = NULL;
  layout->shard_offsets = layout->rows_per_shard = layout->row_numels = NULL;
}

void fsdp_unit_layout_shard_range(const fsdp_unit_layout_t *layout, unsigned s,
                                  uint64_t *ret_begin, uint64_t *ret_end) {
  *ret_begin = (uint64_t)s * layout->shard_numel;
  *ret_end = *ret_begin + layout->shard_numel;
}

/* PER_PARAM: the elements of parameter i in shard s, padding left out. */
static uint64_t piece_numel(const fsdp_unit_layout_t *layout, size_t i, unsigned s) {
  uint64_t rows = layout->rows_per_shard[i], row_numel = layout->row_numels[i];
  uint64_t dim0 = row_numel ? layout->numels[i] / row_numel : 0;
  uint64_t first = (uint64_t)s * rows;
  return first >= dim0 ? 0 : (dim0 - first < rows ? dim0 - first : rows) * row_numel;
}

void fsdp_unit_layout_param_in_shard(const fsdp_unit_layout_t *layout, size_t i, unsigned s,
                                     uint64_t *ret_begin, uint64_t *ret_end,
                                     uint64_t *ret_unsharded_at) {
  uint64_t shard_begin, shard_end;
  fsdp_unit_layout_shard_range(layout, s, &shard_begin, &shard_end);
  if (fsdp_unit_layout_is_flat(layout)) {
    uint64_t begin = layout->offsets[i], end = begin + layout->numels[i];
    *ret_begin = begin > shard_begin ? begin : shard_begin;
    *ret_end = end < shard_end ? end : shard_end;
    if (*ret_end < *ret_begin)
      *ret_end = *ret_begin;
    *ret_unsharded_at = *ret_begin;
    return;
  }
  *ret_begin = shard_begin + layout->shard_offsets[i];
  *ret_end = *ret_begin + piece_numel(layout, i, s);
  *ret_unsharded_at =
      layout->offsets[i] + (uint64_t)s * layout->rows_per_shard[i] * layout->row_numels[i];
}

fsdp_unit_runs_t fsdp_unit_runs(const fsdp_unit_layout_t *layout, uint64_t begin, uint64_t end) {
  return (fsdp_unit_runs_t){.layout = layout, .at = begin, .end = end};
}

/* The next run, each piece's padding a run of its own. */
static bool next_piece(fsdp_unit_runs_t *it, fsdp_unit_run_t *ret_run) {
  const fsdp_unit_layout_t *l = it->layout;
  if (it->at >= it->end)
    return false;
  if (fsdp_unit_layout_is_flat(l)) {
    *ret_run = (fsdp_unit_run_t){
        .shard_at = it->at, .unsharded_at = it->at, .numel = it->end - it->at};
    it->at = it->end;
    return true;
  }
  unsigned s = (unsigned)(it->at / l->shard_numel);
  uint64_t shard_begin = (uint64_t)s * l->shard_numel, within = it->at - shard_begin;
  /* The parameter whose piece holds `within`, or the first after it; the pieces are in
   * order, so the search goes on from the last run's, and starts again in a new shard. */
  if (it->param >= l->n_params || l->shard_offsets[it->param] > within)
    it->param = 0;
  while (it->param + 1 < l->n_params && l->shard_offsets[it->param + 1] <= within)
    it->param++;
  size_t i = it->param;
  uint64_t piece_begin = l->shard_offsets[i];
  uint64_t piece_end = i + 1 < l->n_params ? l->shard_offsets[i + 1] : l->shard_numel;
  uint64_t valid_end = piece_begin + piece_numel(l, i, s);
  uint64_t run_end = within < valid_end ? valid_end : piece_end;
  run_end = shard_begin + run_end < it->end ? shard_begin + run_end : it->end;
  *ret_run = (fsdp_unit_run_t){.shard_at = it->at, .numel = run_end - it->at,
                               .padding = within >= valid_end};
  if (!ret_run->padding)
    ret_run->unsharded_at = l->offsets[i] + (uint64_t)s * l->rows_per_shard[i] * l->row_numels[i] +
                            (within - piece_begin);
  it->at = run_end;
  return true;
}

bool fsdp_unit_runs_next(fsdp_unit_runs_t *it, fsdp_unit_run_t *ret_run) {
  if (!next_piece(it, ret_run))
    return false;
  /* Padding that goes on into the next pieces is one run. */
  fsdp_unit_runs_t ahead = *it;
  fsdp_unit_run_t next;
  while (ret_run->padding && next_piece(&ahead, &next) && next.padding) {
    ret_run->numel += next.numel;
    *it = ahead;
  }
  return true;
}

fsdp_unit_dtype_t fsdp_unit_spec_param_dtype(const fsdp_unit_spec_t *spec) {
  return spec->param_dtype != FSDP_UNIT_DTYPE_UNSPECIFIED ? spec->param_dtype
                                                          : spec->params[0].dtype;
}

fsdp_unit_dtype_t fsdp_unit_spec_reduce_dtype(const fsdp_unit_spec_t *spec) {
  return spec->reduce_dtype != FSDP_UNIT_DTYPE_UNSPECIFIED ? spec->reduce_dtype
                                                           : fsdp_unit_spec_param_dtype(spec);
}

static bool differ(fsdp_spec_difference_t *ret, const char *field, const char *a, const char *b) {
  if (strcmp(a, b) == 0)
    return false;
  snprintf(ret->field, sizeof ret->field, "%s", field);
  snprintf(ret->a, sizeof ret->a, "%s", a);
  snprintf(ret->b, sizeof ret->b, "%s", b);
  return true;
}

static bool differ_number(fsdp_spec_difference_t *ret, const char *field, double a, double b) {
  char ta[32], tb[32];
  snprintf(ta, sizeof ta, "%.17g", a);
  snprintf(tb, sizeof tb, "%.17g", b);
  return differ(ret, field, ta, tb);
}

bool fsdp_unit_spec_diff(const fsdp_unit_spec_t *a,
                         const fsdp_unit_spec_t *b, fsdp_spec_difference_t *ret) {
  if (differ(ret, "unit", a->unit, b->unit) ||
      differ(ret, "strategy", fsdp_unit_strategy_name(a->strategy),
             fsdp_unit_strategy_name(b->strategy)) ||
      differ(ret, "param_dtype", fsdp_unit_dtype_name(a->param_dtype),
             fsdp_unit_dtype_name(b->param_dtype)) ||
      differ(ret, "reduce_dtype", fsdp_unit_dtype_name(a->reduce_dtype),
             fsdp_unit_dtype_name(b->reduce_dtype)) ||
      differ_number(ret, "gradient_predivide_factor", a->gradient_predivide_factor,
                    b->gradient_predivide_factor) ||
      differ_number(ret, "gradient_postdivide_factor", a->gradient_postdivide_factor,
                    b->gradient_postdivide_factor) ||
      differ(ret, "scratch", a->scratch ? "true" : "false", b->scratch ? "true" : "false") ||
      differ(ret, "layout", fsdp_unit_layout_name(a->layout), fsdp_unit_layout_name(b->layout)) ||
      differ_number(ret, "params (count)", (double)a->n_params, (double)b->n_params))
    return true;
  for (size_t i = 0; i < a->n_params; i++) {
    const fsdp_param_spec_t *pa = &a->params[i], *pb = &b->params[i];
    char field[64], sa[128], sb[128];
    snprintf(field, sizeof field, "params[%zu].name", i);
    if (differ(ret, field, pa->name, pb->name))
      return true;
    format_shape(pa, sa, sizeof sa);
    format_shape(pb, sb, sizeof sb);
    snprintf(field, sizeof field, "params[%zu].shape", i);
    if (differ(ret, field, sa, sb))
      return true;
    snprintf(field, sizeof field, "params[%zu].dtype", i);
    if (differ(ret, field, fsdp_unit_dtype_name(pa->dtype), fsdp_unit_dtype_name(pb->dtype)))
      return true;
    snprintf(field, sizeof field, "params[%zu].requires_grad", i);
    if (differ(ret, field, pa->requires_grad ? "true" : "false", pb->requires_grad ? "true" : "false"))
      return true;
  }
  return false;
}
