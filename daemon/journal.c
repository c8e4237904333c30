/* The daemon's journal sink (journal.h). */
#include "daemon/journal.h"

#include <stdio.h>
#include <string.h>
#include <sys/uio.h>

#include <systemd/sd-journal.h>

/* The fields an entry carries at most besides MESSAGE, PRIORITY and the identifier. */
#define FIELDS_MAX 8

void fsdp_daemon_journal_sink(int priority, const char *message, const fsdp_log_field_t *fields,
                              size_t n) {
  char text[3 + FIELDS_MAX][1100];
  struct iovec iov[3 + FIELDS_MAX];
  size_t k = 0;
  snprintf(text[k], sizeof text[k], "MESSAGE=%s", message);
  k++;
  snprintf(text[k], sizeof text[k], "PRIORITY=%d", priority);
  k++;
  snprintf(text[k], sizeof text[k], "SYSLOG_IDENTIFIER=fsdpd");
  k++;
  for (size_t i = 0; i < n && i < FIELDS_MAX; i++) {
    if (!fields[i].value || !*fields[i].value)
      continue;
    snprintf(text[k], sizeof text[k], "%s=%s", fields[i].name, fields[i].value);
    k++;
  }
  for (size_t i = 0; i < k; i++)
    iov[i] = (struct iovec){.iov_base = text[i], .iov_len = strlen(text[i])};
  if (sd_journal_sendv(iov, (int)k) < 0) /* the journal is gone: the stream may not be */
    fprintf(stderr, "<%d>%s\n", priority, message);
}
