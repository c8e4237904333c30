/* Leveled logging to stderr, journald-aware. */
#include "common/log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

static _Atomic int log_level = FSDP_LOG_INFO;
static bool log_to_journal;
static fsdp_log_journal_sink_t journal_sink; /* set once, before any thread logs */

static const char *const level_words[] = {"error", "warning", "info", "debug"};
/* syslog priorities: LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG */
static const int level_priorities[] = {3, 4, 6, 7};

/* JOURNAL_STREAM is "DEV:INO" of the stream systemd connected; it only counts if stderr is
 * still that stream (a child with redirected stderr inherits the variable). */
static bool stderr_is_journal(void) {
  const char *e = getenv("JOURNAL_STREAM");
  unsigned long long dev, ino;
  struct stat sb;
  if (!e || sscanf(e, "%llu:%llu", &dev, &ino) != 2 || fstat(2, &sb) < 0)
    return false;
  return sb.st_dev == dev && sb.st_ino == ino;
}

void fsdp_log_init(void) {
  log_to_journal = stderr_is_journal();
}

void fsdp_log_set_level(fsdp_log_level_t level) {
  atomic_store(&log_level, level);
}

fsdp_log_level_t fsdp_log_get_level(void) {
  return (fsdp_log_level_t)atomic_load(&log_level);
}

void fsdp_log_set_journal_sink(fsdp_log_journal_sink_t sink) {
  journal_sink = sink;
}

static void vlog(fsdp_log_level_t level, const fsdp_log_field_t *fields, size_t n,
                 const char *fmt, va_list ap) {
  if ((int)level > atomic_load(&log_level))
    return;
  char line[1024];
  vsnprintf(line, sizeof line, fmt, ap);
  if (log_to_journal && journal_sink && n) {
    journal_sink(level_priorities[level], line, fields, n);
    return;
  }
  /* One fprintf per line keeps lines from different threads whole. */
  if (log_to_journal)
    fprintf(stderr, "<%d>%s\n", level_priorities[level], line);
  else
    fprintf(stderr, "fsdpd: %s: %s\n", level_words[level], line);
}

void fsdp_log(fsdp_log_level_t level, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vlog(level, NULL, 0, fmt, ap);
  va_end(ap);
}

void fsdp_log_fields(fsdp_log_level_t level, const fsdp_log_field_t *fields, size_t n,
                     const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vlog(level, fields, n, fmt, ap);
  va_end(ap);
}
