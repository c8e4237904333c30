/* Failpoints (common/failpoint.h). Any thread; the count of passes is atomic. */
#include "common/failpoint.h"

#ifdef FSDP_FAILPOINTS

#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static atomic_uint passes;

void fsdp_failpoint(const char *name) {
  const char *want = getenv("FSDPD_FAILPOINT");
  size_t len = strlen(name);
  if (!want || strncmp(want, name, len) != 0 || (want[len] != '\0' && want[len] != ':'))
    return;
  unsigned nth = want[len] == ':' ? (unsigned)strtoul(want + len + 1, NULL, 10) : 1;
  if (atomic_fetch_add(&passes, 1) + 1 == nth)
    kill(getpid(), SIGKILL);
}

#endif
