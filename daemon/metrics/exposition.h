/* Prometheus's text exposition format (version 0.0.4), built into one growing buffer: a
 * family's HELP and TYPE lines, then its samples, each with its labels escaped as the
 * format says. Counters and gauges take a value; a histogram (fsdp_histogram_t) gives its
 * cumulative buckets, +Inf included, its sum and its count.
 *
 * Out of memory marks the buffer failed and later calls do nothing; the caller checks once
 * at the end. Pure; any thread. */
#ifndef FSDP_METRICS_EXPOSITION_H
#define FSDP_METRICS_EXPOSITION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct fsdp_exposition {
  char *text; /* NUL-terminated; owned, freed by fsdp_exposition_cleanup */
  size_t len, cap;
  bool failed;
} fsdp_exposition_t;

/* A label: its name (of [a-zA-Z_][a-zA-Z0-9_]*, the caller's constant) and value (any
 * UTF-8; escaped here). */
typedef struct fsdp_label {
  const char *name, *value;
} fsdp_label_t;

void fsdp_exposition_init(fsdp_exposition_t *e);
void fsdp_exposition_cleanup(fsdp_exposition_t *e); /* NULL-safe */

/* A family's HELP and TYPE lines ("counter", "gauge" or "histogram"): once, before its
 * samples. */
void fsdp_exposition_family(fsdp_exposition_t *e, const char *name, const char *type,
                            const char *help);

/* One sample of the family `name` with n labels: an integer (a counter, a gauge that counts),
 * or a double (seconds, a ratio; NaN and infinities as the format spells them). */
void fsdp_exposition_count(fsdp_exposition_t *e, const char *name, const fsdp_label_t *labels,
                           size_t n, uint64_t value);
void fsdp_exposition_value(fsdp_exposition_t *e, const char *name, const fsdp_label_t *labels,
                           size_t n, double value);

/* A histogram of durations in seconds, with fixed upper bounds from 50 µs to 10 s, about
 * three a decade: what a gather or a reduce of any size takes. */
#define FSDP_HISTOGRAM_BOUNDS 17
typedef struct fsdp_histogram {
  uint64_t buckets[FSDP_HISTOGRAM_BOUNDS]; /* observations <= each bound, not cumulative */
  uint64_t count;
  double sum;
} fsdp_histogram_t;

extern const double fsdp_histogram_bounds[FSDP_HISTOGRAM_BOUNDS];

void fsdp_histogram_observe(fsdp_histogram_t *h, double seconds);

/* The histogram's samples: name_bucket{...,le="B"} cumulative for every bound and +Inf,
 * name_sum and name_count. */
void fsdp_exposition_histogram(fsdp_exposition_t *e, const char *name,
                               const fsdp_label_t *labels, size_t n,
                               const fsdp_histogram_t *h);

#endif
