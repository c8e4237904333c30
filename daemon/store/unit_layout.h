/* A unit's FlatParameter layout, and the checks its spec must pass.
 *
 * A unit (FlatParameter) is an ordered list of parameters. They are flattened and
 * concatenated in order, right-padded to a multiple of the shard count S (padding < S; across
 * hosts a multiple of a larger count, see daemon/store/topology.h) and
 * split into S equal shards: shard s holds elements [s * shard_numel, (s + 1) * shard_numel)
 * of the flat buffer, and the padding sits at the end of the last shards.
 *
 * Every rank of a host registers the same spec; fsdp_unit_spec_diff() names the first field
 * where two specs differ, so the daemon can say which rank disagrees and how. The session id
 * is not part of the spec.
 *
 * Pure functions on caller-owned data; any thread. */
#ifndef FSDP_UNIT_LAYOUT_H
#define FSDP_UNIT_LAYOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fsdp/v1/trainer.pb-c.h"

#include "common/status.h"
#include "proto/limits.h" /* what one RegisterUnit may ask for: FSDP_UNIT_* */

typedef struct fsdp_unit_layout {
  uint64_t numel;        /* the parameters' elements, without padding */
  uint64_t padded_numel; /* numel rounded up to a multiple of shards */
  uint64_t shard_numel;  /* padded_numel / shards */
  unsigned shards;
  size_t n_params;
  uint64_t *offsets; /* element offset of each parameter in the flat buffer; owned */
  uint64_t *numels;  /* element count of each parameter; owned */
} fsdp_unit_layout_t;

/* Checks a spec on its own: names present, unique and not too long; at least one parameter
 * and one element; shapes whose element counts neither overflow nor pass the limits (each
 * dimension bounded, a zero one included); one element type for all parameters; a strategy;
 * divide factors (0: default) from 2^-24 to 2^24, their product too (unit_layout.c says
 * why). st names the field and the value. */
int fsdp_unit_spec_check(const Fsdp__V1__RegisterUnitRequest *spec, fsdp_status_t *st);

/* The fp32 scales a reduction multiplies by (1 / the gradient divide factors) for a checked
 * spec averaged over `world` ranks: a factor left 0 is world over the other (the
 * predivide 1 when both are). INVALID_ARGUMENT when a factor so derived is out of bounds,
 * naming it and how it was derived; *ret_* are then unset. */
int fsdp_unit_gradient_scales(const Fsdp__V1__RegisterUnitRequest *spec, unsigned world,
                              float *ret_pre, float *ret_post, fsdp_status_t *st);

/* The layout of a checked spec over `shards` shards (1 for NO_SHARD), padded to a multiple
 * of pad_multiple (a multiple of shards; daemon/store/topology.h says why it may be larger). */
int fsdp_unit_layout_init(fsdp_unit_layout_t *layout, const Fsdp__V1__RegisterUnitRequest *spec,
                          unsigned shards, unsigned pad_multiple, fsdp_status_t *st);
void fsdp_unit_layout_cleanup(fsdp_unit_layout_t *layout);

/* The element range [*ret_begin, *ret_end) of shard s within the flat buffer, padding
 * included. */
void fsdp_unit_layout_shard_range(const fsdp_unit_layout_t *layout, unsigned s,
                                  uint64_t *ret_begin, uint64_t *ret_end);

/* The unsharded element type (param_dtype, defaulting to the parameters' own type) and the
 * reduction type (reduce_dtype, defaulting to the unsharded type) of a checked spec. */
Fsdp__V1__DType fsdp_unit_spec_param_dtype(const Fsdp__V1__RegisterUnitRequest *spec);
Fsdp__V1__DType fsdp_unit_spec_reduce_dtype(const Fsdp__V1__RegisterUnitRequest *spec);

/* Whether two specs differ; if so, the first differing field ("params[1].shape") and both
 * values as text ("[4096,1023]", "[4096,1024]"), each truncated to its buffer. */
typedef struct fsdp_spec_difference {
  char field[64];
  char a[128];
  char b[128];
} fsdp_spec_difference_t;

bool fsdp_unit_spec_diff(const Fsdp__V1__RegisterUnitRequest *a,
                         const Fsdp__V1__RegisterUnitRequest *b, fsdp_spec_difference_t *ret);

#endif
