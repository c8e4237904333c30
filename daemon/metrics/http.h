/* The metrics endpoint: an HTTP server (libmicrohttpd) on a TCP port that answers GET
 * /metrics with what `render` writes, in Prometheus's text format, GET / with the HTML page
 * `page` writes, and anything else with 404 or 405. It runs on the daemon's loop:
 * libmicrohttpd's epoll descriptor is polled there and its work done there (no thread of its
 * own), so `render` and `page` read the daemon's state as every handler does, without locks.
 * A request costs the loop one rendering.
 *
 * Connections are bounded (a slow or idle client is dropped after a timeout), requests are
 * small (no body is read). Loop thread only. */
#ifndef FSDP_METRICS_HTTP_H
#define FSDP_METRICS_HTTP_H

#include <stddef.h>
#include <stdio.h>

#include <uv.h>

#include "common/status.h"
#include "daemon/metrics/exposition.h"

typedef struct fsdp_metrics_http fsdp_metrics_http_t;

/* Writes the exposition into e (fsdp_exposition_init'ed); data is the server's. */
typedef void (*fsdp_metrics_render_fn)(void *data, fsdp_exposition_t *e);

/* Writes the status page's HTML into out (a memory stream); data is the server's. */
typedef void (*fsdp_metrics_page_fn)(void *data, FILE *out);

/* Listens on `address` ("HOST:PORT", port 0 picks one) and serves on loop. *ret_address
 * (size bytes): the bound address. st names the address on failure. */
int fsdp_metrics_http_start(uv_loop_t *loop, const char *address, fsdp_metrics_render_fn render,
                            fsdp_metrics_page_fn page, void *data, fsdp_metrics_http_t **ret_http,
                            char *ret_address, size_t size, fsdp_status_t *st);

/* Stops serving: the port and every connection are closed now, the rest freed by the loop
 * as its handles close. NULL-safe. */
void fsdp_metrics_http_stop(fsdp_metrics_http_t *http);

/* Scrapes answered, for the status. */
unsigned long fsdp_metrics_http_scrapes(const fsdp_metrics_http_t *http);

#endif
