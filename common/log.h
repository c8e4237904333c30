/* Daemon logging: one line per event on stderr, where systemd's journal or a terminal reads
 * it. Under journald (JOURNAL_STREAM names our stderr) lines carry "<N>" priority prefixes
 * instead of a level word, and a line with fields (fsdp_log_fields: the job, unit, step,
 * rank, host and code it is about) goes to the journal as an entry with those fields, through
 * the sink the daemon sets (fsdp_log_set_journal_sink: sd_journal_sendv, which this library
 * does not link). Only the daemon logs; libraries return codes.
 *
 * The level is process-wide (the one piece of global state in the daemon): the loop thread
 * sets it at start and on reload, and any thread may log. */
#ifndef FSDP_LOG_H
#define FSDP_LOG_H

#include <stddef.h>

typedef enum fsdp_log_level {
  FSDP_LOG_ERROR = 0, /* the order matches the daemon.log_level choices */
  FSDP_LOG_WARNING,
  FSDP_LOG_INFO,
  FSDP_LOG_DEBUG,
} fsdp_log_level_t;

/* Reads JOURNAL_STREAM. Call once at start. (gRPC's own lines: fsdp_rpc_route_log.) */
void fsdp_log_init(void);
void fsdp_log_set_level(fsdp_log_level_t level);
fsdp_log_level_t fsdp_log_get_level(void);

__attribute__((format(printf, 2, 3))) void fsdp_log(fsdp_log_level_t level, const char *fmt, ...);

/* A journal field of a line: NAME (JOB, UNIT, STEP, RANK, HOST, CODE) and its value. */
typedef struct fsdp_log_field {
  const char *name, *value;
} fsdp_log_field_t;

/* Writes one journal entry: the message, its syslog priority and its fields. */
typedef void (*fsdp_log_journal_sink_t)(int priority, const char *message,
                                        const fsdp_log_field_t *fields, size_t n);
void fsdp_log_set_journal_sink(fsdp_log_journal_sink_t sink);

/* fsdp_log with fields: under journald with a sink, an entry with them; else the same line
 * as fsdp_log (the message says what the fields say). */
__attribute__((format(printf, 4, 5))) void fsdp_log_fields(fsdp_log_level_t level,
                                                           const fsdp_log_field_t *fields,
                                                           size_t n, const char *fmt, ...);

#define log_error(...) fsdp_log(FSDP_LOG_ERROR, __VA_ARGS__)
#define log_warning(...) fsdp_log(FSDP_LOG_WARNING, __VA_ARGS__)
#define log_info(...) fsdp_log(FSDP_LOG_INFO, __VA_ARGS__)
#define log_debug(...) fsdp_log(FSDP_LOG_DEBUG, __VA_ARGS__)

#endif
