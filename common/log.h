/* Daemon logging: one line per event on stderr, where systemd's journal or a terminal reads
 * it. Under journald (JOURNAL_STREAM names our stderr) lines carry "<N>" priority prefixes
 * instead of a level word. Only the daemon logs; libraries return codes.
 *
 * The level is process-wide (the one piece of global state in the daemon): the loop thread
 * sets it at start and on reload, and any thread may log. */
#ifndef FSDP_LOG_H
#define FSDP_LOG_H

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

#define log_error(...) fsdp_log(FSDP_LOG_ERROR, __VA_ARGS__)
#define log_warning(...) fsdp_log(FSDP_LOG_WARNING, __VA_ARGS__)
#define log_info(...) fsdp_log(FSDP_LOG_INFO, __VA_ARGS__)
#define log_debug(...) fsdp_log(FSDP_LOG_DEBUG, __VA_ARGS__)

#endif
