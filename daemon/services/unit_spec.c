/* RegisterUnitRequest to fsdp_unit_spec_t. The enums keep the protocol's values, so a value
 * converts as it is; the adapter has checked that it is one of the protocol's. */
#include "daemon/services/unit_spec.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define SAME(ours, theirs) ((int)(ours) == (int)(theirs))
_Static_assert(SAME(FSDP_UNIT_DTYPE_UNSPECIFIED, FSDP__V1__DTYPE__DTYPE_UNSPECIFIED) &&
                   SAME(FSDP_UNIT_DTYPE_FP32, FSDP__V1__DTYPE__DTYPE_FP32) &&
                   SAME(FSDP_UNIT_DTYPE_BF16, FSDP__V1__DTYPE__DTYPE_BF16) &&
                   SAME(FSDP_UNIT_DTYPE_FP16, FSDP__V1__DTYPE__DTYPE_FP16),
               "fsdp_unit_dtype_t has fsdp.v1.DType's values");
_Static_assert(
    SAME(FSDP_UNIT_STRATEGY_UNSPECIFIED, FSDP__V1__SHARDING_STRATEGY__STRATEGY_UNSPECIFIED) &&
        SAME(FSDP_UNIT_FULL_SHARD, FSDP__V1__SHARDING_STRATEGY__FULL_SHARD) &&
        SAME(FSDP_UNIT_SHARD_GRAD_OP, FSDP__V1__SHARDING_STRATEGY__SHARD_GRAD_OP) &&
        SAME(FSDP_UNIT_HYBRID_SHARD, FSDP__V1__SHARDING_STRATEGY__HYBRID_SHARD) &&
        SAME(FSDP_UNIT_NO_SHARD, FSDP__V1__SHARDING_STRATEGY__NO_SHARD),
    "fsdp_unit_strategy_t has fsdp.v1.ShardingStrategy's values");
_Static_assert(SAME(FSDP_UNIT_LAYOUT_FLAT, FSDP__V1__UNIT_LAYOUT__LAYOUT_FLAT) &&
                   SAME(FSDP_UNIT_LAYOUT_PER_PARAM, FSDP__V1__UNIT_LAYOUT__LAYOUT_PER_PARAM),
               "fsdp_unit_layout_kind_t has fsdp.v1.UnitLayout's values");
#undef SAME

int fsdp_unit_spec_init_from_proto(fsdp_unit_spec_t *spec,
                                   const Fsdp__V1__RegisterUnitRequest *rq) {
  memset(spec, 0, sizeof *spec);
  fsdp_param_spec_t *params = calloc(rq->n_params ? rq->n_params : 1, sizeof *params);
  if (!params)
    return -ENOMEM;
  for (size_t i = 0; i < rq->n_params; i++) {
    const Fsdp__V1__ParamSpec *p = rq->params[i];
    params[i] = (fsdp_param_spec_t){.name = p->name, .shape = p->shape, .n_shape = p->n_shape,
                                    .dtype = (fsdp_unit_dtype_t)p->dtype,
                                    .requires_grad = p->requires_grad};
  }
  *spec = (fsdp_unit_spec_t){
      .unit = rq->unit,
      .params = params,
      .n_params = rq->n_params,
      .strategy = (fsdp_unit_strategy_t)rq->strategy,
      .param_dtype = (fsdp_unit_dtype_t)rq->param_dtype,
      .reduce_dtype = (fsdp_unit_dtype_t)rq->reduce_dtype,
      .gradient_predivide_factor = rq->gradient_predivide_factor,
      .gradient_postdivide_factor = rq->gradient_postdivide_factor,
      .scratch = rq->scratch,
      .layout = (fsdp_unit_layout_kind_t)rq->layout,
  };
  return 0;
}

void fsdp_unit_spec_cleanup(fsdp_unit_spec_t *spec) {
  if (!spec)
    return;
  free(spec->params);
  spec->params = NULL;
  spec->n_params = 0;
}
