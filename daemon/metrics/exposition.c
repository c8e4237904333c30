/* Prometheus's text exposition format (exposition.h). */
#include "daemon/metrics/exposition.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double fsdp_histogram_bounds[FSDP_HISTOGRAM_BOUNDS] = {
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
    50e-3, 100e-3, 250e-3, 500e-3, 1.0,  2.5,    5.0,  10.0};

void fsdp_exposition_init(fsdp_exposition_t *e) {
  *e = (fsdp_exposition_t){0};
}

void fsdp_exposition_cleanup(fsdp_exposition_t *e) {
  if (!e)
    return;
  free(e->text);
  *e = (fsdp_exposition_t){0};
}

static bool reserve(fsdp_exposition_t *e, size_t more) {
  if (e->failed)
    return false;
  if (e->len + more + 1 <= e->cap)
    return true;
  size_t cap = e->cap ? e->cap : 4096;
  while (cap < e->len + more + 1)
    cap *= 2;
  char *text = realloc(e->text, cap);
  if (!text) {
    e->failed = true;
    return false;
  }
  e->text = text;
  e->cap = cap;
  return true;
}

__attribute__((format(printf, 2, 3))) static void append(fsdp_exposition_t *e, const char *fmt,
                                                          ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0 || !reserve(e, (size_t)n))
    return;
  va_start(ap, fmt);
  vsnprintf(e->text + e->len, e->cap - e->len, fmt, ap);
  va_end(ap);
  e->len += (size_t)n;
}

static void append_bytes(fsdp_exposition_t *e, const char *s, size_t n) {
  if (!reserve(e, n))
    return;
  memcpy(e->text + e->len, s, n);
  e->len += n;
  e->text[e->len] = '\0';
}

/* A label value with \, " and newline escaped; HELP text escapes \ and newline only. The
 * runs between escapes are copied whole. */
static void append_escaped(fsdp_exposition_t *e, const char *s, bool quotes) {
  const char *special = quotes ? "\\\n\"" : "\\\n";
  for (;;) {
    size_t run = strcspn(s, special);
    append_bytes(e, s, run);
    s += run;
    if (!*s)
      return;
    append_bytes(e, *s == '\n' ? "\\n" : *s == '"' ? "\\\"" : "\\\\", 2);
    s++;
  }
}

void fsdp_exposition_family(fsdp_exposition_t *e, const char *name, const char *type,
                            const char *help) {
  append(e, "# HELP %s ", name);
  append_escaped(e, help, false);
  append(e, "\n# TYPE %s %s\n", name, type);
}

/* name{labels} or name{labels,le="bound"}, without the value. */
static void append_series(fsdp_exposition_t *e, const char *name, const char *suffix,
                          const fsdp_label_t *labels, size_t n, const char *le) {
  append(e, "%s%s", name, suffix);
  if (n == 0 && !le)
    return;
  append(e, "{");
  for (size_t i = 0; i < n; i++) {
    append(e, "%s%s=\"", i ? "," : "", labels[i].name);
    append_escaped(e, labels[i].value, true);
    append(e, "\"");
  }
  if (le)
    append(e, "%sle=\"%s\"", n ? "," : "", le);
  append(e, "}");
}

static void append_double(fsdp_exposition_t *e, double value) {
  if (isnan(value))
    append(e, "NaN");
  else if (isinf(value))
    append(e, value > 0 ? "+Inf" : "-Inf");
  else
    append(e, "%.17g", value);
}

void fsdp_exposition_count(fsdp_exposition_t *e, const char *name, const fsdp_label_t *labels,
                           size_t n, uint64_t value) {
  append_series(e, name, "", labels, n, NULL);
  append(e, " %llu\n", (unsigned long long)value);
}

void fsdp_exposition_value(fsdp_exposition_t *e, const char *name, const fsdp_label_t *labels,
                           size_t n, double value) {
  append_series(e, name, "", labels, n, NULL);
  append(e, " ");
  append_double(e, value);
  append(e, "\n");
}

void fsdp_histogram_observe(fsdp_histogram_t *h, double seconds) {
  h->count++;
  h->sum += seconds;
  for (size_t i = 0; i < FSDP_HISTOGRAM_BOUNDS; i++)
    if (seconds <= fsdp_histogram_bounds[i]) {
      h->buckets[i]++;
      return;
    }
}

void fsdp_exposition_histogram(fsdp_exposition_t *e, const char *name,
                               const fsdp_label_t *labels, size_t n,
                               const fsdp_histogram_t *h) {
  uint64_t cumulative = 0;
  for (size_t i = 0; i < FSDP_HISTOGRAM_BOUNDS; i++) {
    char le[32];
    snprintf(le, sizeof le, "%g", fsdp_histogram_bounds[i]);
    cumulative += h->buckets[i];
    append_series(e, name, "_bucket", labels, n, le);
    append(e, " %llu\n", (unsigned long long)cumulative);
  }
  append_series(e, name, "_bucket", labels, n, "+Inf");
  append(e, " %llu\n", (unsigned long long)h->count);
  append_series(e, name, "_sum", labels, n, NULL);
  append(e, " ");
  append_double(e, h->sum);
  append(e, "\n");
  append_series(e, name, "_count", labels, n, NULL);
  append(e, " %llu\n", (unsigned long long)h->count);
}
