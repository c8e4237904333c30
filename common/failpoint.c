/* Failpoints (common/failpoint.h). Any thread; the count of passes is atomic. */
#include "common/failpoint.h"

#ifdef FSDP_FAILPOINTS

#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static atomic_uint passes;

bool fsdp_failpoint(const char *name) {
  const char *want = getenv("FSDPD_FAILPOINT");
  size_t len = strlen(name);
  if (!want || strncmp(want, name, len) != 0 || (want[len] != '\0' && want[len] != ':'))
    return false;
  char *end = (char *)want + len;
  unsigned nth = *end == ':' ? (unsigned)strtoul(end + 1, &end, 10) : 1;
  if (atomic_fetch_add(&passes, 1) + 1 != nth)
    return false;
  if (strcmp(end, ":fail") == 0)
    return true;
  if (strncmp(end, ":sleep-", 7) == 0) {
    unsigned long ms = strtoul(end + 7, NULL, 10);
    struct timespec t = {.tv_sec = (time_t)(ms / 1000), .tv_nsec = (long)(ms % 1000) * 1000000};
    while (nanosleep(&t, &t) < 0)
      ;
    return false;
  }
  kill(getpid(), SIGKILL);
  return false;
}

#endif
