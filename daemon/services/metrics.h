/* What the daemon tells Prometheus (the metrics endpoint, daemon/metrics/http.h): the
 * daemon's build and sessions, the gRPC calls by method and status code, each job's memory
 * and pools, and each unit's gathers, reduces, the bytes they made, the daemon's own work on them as
 * histograms, and its optimizer steps. Names and labels by Prometheus's conventions (base
 * units, _total for counters); the labels are bounded: endpoints, methods and codes are
 * fixed, jobs and units are the daemon's (no step, rank or time is a label). A training
 * job is the label fsdp_job: `job` is Prometheus's own, the scrape job's.
 *
 * Loop thread only: it reads the daemon's state as the handlers do. */
#ifndef FSDP_SERVICES_METRICS_H
#define FSDP_SERVICES_METRICS_H

#include "daemon/metrics/exposition.h"
#include "daemon/services/context.h"

/* fsdp_metrics_render_fn over a context (data: the fsdp_services_context_t). */
void fsdp_services_render_metrics(void *data, fsdp_exposition_t *e);

#endif
