/* A unit's layout, and the checks its spec must pass.
 *
 * A unit is an ordered list of parameters, held in two spaces. The unsharded buffer, which
 * the trainers compute with, holds them flattened and concatenated in order: parameter i's
 * elements at offsets[i]. The shards' space is the S shards side by side, each shard_numel
 * long: shard s at s * shard_numel (a host's shards are one region of it: its masters, its
 * gradient shards, its optimizer state). The layout says which element of the one is which
 * of the other, as runs (fsdp_unit_runs_next):
 *
 *   FLAT (FSDP1's FlatParameter): the two spaces are one. The concatenation is right-padded
 *        to a multiple of S (padding < S; across hosts a multiple of a larger count, see
 *        daemon/store/topology.h) and cut into S equal shards; the padding sits at the end
 *        of the last shards.
 *   PER_PARAM (FSDP2's): each parameter is cut on dim 0 into S pieces of rows_per_shard =
 *        ceil(dim0 / S) rows (torch.chunk's), and each shard holds its piece of every
 *        parameter in order, at shard_offsets[i], rows past the parameter's last being
 *        padding; the shard is right-padded as FLAT's buffer is. A rank's piece of a
 *        parameter is then a tensor of its own, as FSDP2's DTensor shard is.
 *
 * A spec is the project's own struct: the service layer makes one from a RegisterUnit request
 * (daemon/services/unit_spec.h), keeping its field names, which the messages here use. Every
 * rank of a host registers the same spec; fsdp_unit_spec_diff() names the first field where
 * two specs differ, so the daemon can say which rank disagrees and how.
 *
 * Pure functions on caller-owned data; any thread. */
#ifndef FSDP_UNIT_LAYOUT_H
#define FSDP_UNIT_LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "proto/limits.h" /* what one RegisterUnit may ask for: FSDP_UNIT_* */

/* Element types, with fsdp.v1.DType's values. */
typedef enum fsdp_unit_dtype {
  FSDP_UNIT_DTYPE_UNSPECIFIED = 0,
  FSDP_UNIT_DTYPE_FP32 = 1,
  FSDP_UNIT_DTYPE_BF16 = 2,
  FSDP_UNIT_DTYPE_FP16 = 3,
} fsdp_unit_dtype_t;

/* Sharding strategies, with fsdp.v1.ShardingStrategy's values. */
typedef enum fsdp_unit_strategy {
  FSDP_UNIT_STRATEGY_UNSPECIFIED = 0,
  FSDP_UNIT_FULL_SHARD = 1,
  FSDP_UNIT_SHARD_GRAD_OP = 2,
  FSDP_UNIT_HYBRID_SHARD = 3,
  FSDP_UNIT_NO_SHARD = 4,
} fsdp_unit_strategy_t;

/* Layouts, with fsdp.v1.UnitLayout's values. */
typedef enum fsdp_unit_layout_kind {
  FSDP_UNIT_LAYOUT_FLAT = 0,
  FSDP_UNIT_LAYOUT_PER_PARAM = 1,
} fsdp_unit_layout_kind_t;

typedef struct fsdp_param_spec {
  char *name;
  uint64_t *shape;
  size_t n_shape;
  fsdp_unit_dtype_t dtype;
  bool requires_grad;
} fsdp_param_spec_t;

/* What RegisterUnit asks for, the session aside. Factors of 0 ask for the default. */
typedef struct fsdp_unit_spec {
  char *unit;
  fsdp_param_spec_t *params;
  size_t n_params;
  fsdp_unit_strategy_t strategy;
  fsdp_unit_dtype_t param_dtype; /* UNSPECIFIED: the parameters' own */
  fsdp_unit_dtype_t reduce_dtype; /* UNSPECIFIED: param_dtype */
  double gradient_predivide_factor;
  double gradient_postdivide_factor;
  bool scratch; /* the client's own, not the model's: not checkpointed, not a step's */
  fsdp_unit_layout_kind_t layout;
} fsdp_unit_spec_t;

/* A deep copy of spec in one allocation, freed with fsdp_unit_spec_free() (NULL-safe). */
int fsdp_unit_spec_copy(const fsdp_unit_spec_t *spec, fsdp_unit_spec_t **ret_copy);
void fsdp_unit_spec_free(fsdp_unit_spec_t *spec);

/* The names the messages give a dtype ("DTYPE_BF16"), a strategy ("FULL_SHARD") and a
 * layout ("LAYOUT_PER_PARAM"), as in the .proto; "?" for another value. */
const char *fsdp_unit_dtype_name(fsdp_unit_dtype_t dtype);
const char *fsdp_unit_strategy_name(fsdp_unit_strategy_t strategy);
const char *fsdp_unit_layout_name(fsdp_unit_layout_kind_t layout);

typedef struct fsdp_unit_layout {
  fsdp_unit_layout_kind_t kind;
  uint64_t numel;        /* the parameters' elements, without padding */
  uint64_t padded_numel; /* shards x shard_numel: the shards' space, padding included */
  uint64_t shard_numel;
  unsigned shards;
  size_t n_params;
  uint64_t *offsets; /* element offset of each parameter in the unsharded buffer; owned */
  uint64_t *numels;  /* element count of each parameter; owned */
  /* PER_PARAM (NULL for FLAT): where each parameter's piece is in every shard, its rows per
   * shard and the elements of one row (a scalar or 1-D parameter: 1). Owned, in one block
   * with the above. */
  uint64_t *shard_offsets, *rows_per_shard, *row_numels;
} fsdp_unit_layout_t;

/* Checks a spec on its own: names present, unique and not too long; at least one parameter
 * and one element; shapes whose element counts neither overflow nor pass the limits (each
 * dimension bounded, a zero one included); one element type for all parameters; a strategy;
 * divide factors (0: default) from 2^-24 to 2^24, their product too (unit_layout.c says
 * why). st names the field and the value. */
int fsdp_unit_spec_check(const fsdp_unit_spec_t *spec, fsdp_status_t *st);

/* The fp32 scales a reduction multiplies by (1 / the gradient divide factors) for a checked
 * spec averaged over `world` ranks: a factor left 0 is world over the other (the
 * predivide 1 when both are). INVALID_ARGUMENT when a factor so derived is out of bounds,
 * naming it and how it was derived; *ret_* are then unset. */
int fsdp_unit_gradient_scales(const fsdp_unit_spec_t *spec, unsigned world,
                              float *ret_pre, float *ret_post, fsdp_status_t *st);

/* The layout of a checked spec over `shards` shards (1 for NO_SHARD), as spec->layout says:
 * padded_numel a multiple of pad_multiple (a multiple of shards; daemon/store/topology.h says
 * why it may be larger). */
int fsdp_unit_layout_init(fsdp_unit_layout_t *layout, const fsdp_unit_spec_t *spec,
                          unsigned shards, unsigned pad_multiple, fsdp_status_t *st);
void fsdp_unit_layout_cleanup(fsdp_unit_layout_t *layout); /* NULL-safe */

/* The element range [*ret_begin, *ret_end) of shard s within the shards' space, padding
 * included. */
void fsdp_unit_layout_shard_range(const fsdp_unit_layout_t *layout, unsigned s,
                                  uint64_t *ret_begin, uint64_t *ret_end);

/* The elements of parameter i that shard s holds, padding left out: [*ret_begin, *ret_end)
 * of the shards' space (empty when begin == end), the first of them at *ret_unsharded_at
 * of the unsharded buffer. */
void fsdp_unit_layout_param_in_shard(const fsdp_unit_layout_t *layout, size_t i, unsigned s,
                                     uint64_t *ret_begin, uint64_t *ret_end,
                                     uint64_t *ret_unsharded_at);

/* Whether the shards' space is the unsharded buffer itself (FLAT). */
static inline bool fsdp_unit_layout_is_flat(const fsdp_unit_layout_t *layout) {
  return layout->kind == FSDP_UNIT_LAYOUT_FLAT;
}

/* A run of elements, consecutive in both spaces: numel elements of the shards' space from
 * shard_at, which are the unsharded buffer's from unsharded_at, or padding (no parameter's
 * elements: unsharded_at is meaningless; they stay zero). FLAT's runs are never padding:
 * its padding is in the unsharded buffer too. */
typedef struct fsdp_unit_run {
  uint64_t shard_at, unsharded_at, numel;
  bool padding;
} fsdp_unit_run_t;

/* The runs that make up [begin, end) of the shards' space, in order:
 *   fsdp_unit_runs_t it = fsdp_unit_runs(layout, begin, end);
 *   for (fsdp_unit_run_t run; fsdp_unit_runs_next(&it, &run);) ...
 * FLAT gives one run; PER_PARAM one per parameter piece and padding. */
typedef struct fsdp_unit_runs {
  const fsdp_unit_layout_t *layout;
  uint64_t at, end;
  size_t param; /* PER_PARAM: the parameter whose piece holds `at` or comes after it */
} fsdp_unit_runs_t;
fsdp_unit_runs_t fsdp_unit_runs(const fsdp_unit_layout_t *layout, uint64_t begin, uint64_t end);
bool fsdp_unit_runs_next(fsdp_unit_runs_t *it, fsdp_unit_run_t *ret_run);

/* The unsharded element type (param_dtype, defaulting to the parameters' own type) and the
 * reduction type (reduce_dtype, defaulting to the unsharded type) of a checked spec. */
fsdp_unit_dtype_t fsdp_unit_spec_param_dtype(const fsdp_unit_spec_t *spec);
fsdp_unit_dtype_t fsdp_unit_spec_reduce_dtype(const fsdp_unit_spec_t *spec);

/* Whether two specs differ; if so, the first differing field ("params[1].shape") and both
 * values as text ("[4096,1023]", "[4096,1024]"), each truncated to its buffer. */
typedef struct fsdp_spec_difference {
  char field[64];
  char a[128];
  char b[128];
} fsdp_spec_difference_t;

bool fsdp_unit_spec_diff(const fsdp_unit_spec_t *a,
                         const fsdp_unit_spec_t *b, fsdp_spec_difference_t *ret);

#endif
