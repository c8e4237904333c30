/* Failpoints: places where a test makes the process die, to show that what it writes
 * survives a crash there, stall, to show what goes on meanwhile, or take the path of a
 * failure it cannot cause or of hardware it does not have. A build with FSDP_FAILPOINTS
 * (CMake option, on by default, off for packages) kills itself with SIGKILL at
 * fsdp_failpoint(name) when the environment names it: FSDPD_FAILPOINT=name dies at its
 * first pass, name:N at its Nth; name:N:sleep-MS sleeps MS milliseconds there instead, and
 * name:N:fail returns true there (the caller goes on as if the call it guards failed, or
 * as the hardware it stands for requires; false at every other pass).
 * Without the option a failpoint is nothing; with it, a getenv per pass (they are on rare
 * paths). */
#ifndef FSDP_COMMON_FAILPOINT_H
#define FSDP_COMMON_FAILPOINT_H

#include <stdbool.h>

#ifdef FSDP_FAILPOINTS
bool fsdp_failpoint(const char *name);
#else
static inline bool fsdp_failpoint(const char *name) {
  (void)name;
  return false;
}
#endif

#endif
