/* A RegisterUnit request as the store's own unit spec (daemon/store/unit_layout.h), made in
 * the service layer so that the store knows no protocol.
 *
 * The spec borrows the request's strings and shapes: it is valid while the request is, and
 * the store copies what it keeps. Pure functions; any thread. */
#ifndef FSDP_UNIT_SPEC_H
#define FSDP_UNIT_SPEC_H

#include "fsdp/v1/trainer.pb-c.h"

#include "daemon/store/unit_layout.h"

/* -ENOMEM when the parameters' array cannot be had; spec is then empty. */
int fsdp_unit_spec_init_from_proto(fsdp_unit_spec_t *spec,
                                   const Fsdp__V1__RegisterUnitRequest *rq);
/* Frees what the spec holds of its own (NULL-safe, and after a failed init). */
void fsdp_unit_spec_cleanup(fsdp_unit_spec_t *spec);

#endif
