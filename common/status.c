/* Error code plus message, filled where a failure is detected. */
#include "common/status.h"

#include <stdio.h>
#include <string.h>

int fsdp_status_setv(fsdp_status_t *st, int code, const char *fmt, va_list ap) {
  if (st) {
    /* Through a copy: a caller may prefix the message it already holds (its arguments may
     * point into st->message), and vsnprintf's source and destination must not overlap. */
    char message[sizeof st->message];
    vsnprintf(message, sizeof message, fmt, ap);
    st->code = code;
    memcpy(st->message, message, sizeof message);
  }
  return code;
}

int fsdp_status_set(fsdp_status_t *st, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fsdp_status_setv(st, code, fmt, ap);
  va_end(ap);
  return code;
}

void fsdp_status_clear(fsdp_status_t *st) {
  st->code = 0;
  st->message[0] = '\0';
}
