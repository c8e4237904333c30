/* The status page at / on the metrics port, for a person at a browser: the daemon (version,
 * backend, topology, uptime), its peers, and each job (its ranks attached, its memory and
 * pools, a stall and why) with its units and a timeline of its last steps drawn from the
 * flight recorder, a row a local rank and one for the daemon's work. HTML and SVG made on
 * the server, no script, refreshed every 5 s.
 *
 * Loop thread only: it reads the daemon's state as the handlers do. */
#ifndef FSDP_SERVICES_STATUS_PAGE_H
#define FSDP_SERVICES_STATUS_PAGE_H

#include <stdio.h>

#include "daemon/services/context.h"

/* fsdp_metrics_page_fn over a context (data: the fsdp_services_context_t). */
void fsdp_services_render_page(void *data, FILE *out);

#endif
