/* The Operator handlers that the Operator service's table names but other files of this
 * folder hold: the reports, which only read the daemon (Status in operator_status.c;
 * ListUnits and DescribeUnit in operator_units.c; Trace in operator_trace.c). Loop thread only; each takes its
 * fsdp_services_context_t as data. */
#ifndef FSDP_OPERATOR_INTERNAL_H
#define FSDP_OPERATOR_INTERNAL_H

#include "daemon/rpc/rpc_server.h"

void fsdp_operator_status(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data);
void fsdp_operator_list_units(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                              void *data);
void fsdp_operator_describe_unit(fsdp_rpc_call_t *call, const ProtobufCMessage *request,
                                 void *data);
void fsdp_operator_trace(fsdp_rpc_call_t *call, const ProtobufCMessage *request, void *data);

#endif
