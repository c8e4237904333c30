/* The Operator handlers that the Operator service's table names but other files of this
 * folder hold: the reports, which only read the daemon (Status in operator_status.c;
 * ListUnits and DescribeUnit in operator_units.c; Trace in operator_trace.c; Why in
 * operator_why.c). Loop thread only; each takes its fsdp_services_context_t as data. */
#ifndef FSDP_OPERATOR_INTERNAL_H
#define FSDP_OPERATOR_INTERNAL_H

#include "daemon/dataplane/dataplane.h"
#include "daemon/rpc/rpc_server.h"
#include "fsdp/v1/operator.pb-c.h"

void fsdp_operator_status(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data);
void fsdp_operator_list_units(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                              void *data);
void fsdp_operator_describe_unit(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                                 void *data);
void fsdp_operator_trace(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data);
void fsdp_operator_why(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data);

/* The job a report names (field 'job'), or NULL after failing the call NOT_FOUND. */
const fsdp_job_t *fsdp_operator_job(fsdp_rpc_call_t *call, const fsdp_store_t *store,
                                    const char *name);

/* A flight record as the protocol says it (its strings borrowed: unit's, and static ones). */
void fsdp_operator_op_record(const fsdp_op_record_t *record, const char *unit,
                             Fsdp__V1__OpRecord *out);

#endif
