/* The daemon's journal sink (common/log.h's fsdp_log_set_journal_sink): under journald, a
 * line logged with fields becomes one entry carrying them (JOB, UNIT, STEP, RANK, HOST,
 * CODE) beside MESSAGE and PRIORITY, so that `journalctl JOB=llama` finds a job's lines.
 * Through libsystemd's sd_journal_sendv, which only the daemon links. */
#ifndef FSDP_DAEMON_JOURNAL_H
#define FSDP_DAEMON_JOURNAL_H

#include "common/log.h"

void fsdp_daemon_journal_sink(int priority, const char *message, const fsdp_log_field_t *fields,
                              size_t n);

#endif
