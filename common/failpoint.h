/* Failpoints: places where a test makes the process die, to show that what it writes
 * survives a crash there, or stall, to show what goes on meanwhile. A build with
 * FSDP_FAILPOINTS (CMake option, on by default, off for packages) kills itself with SIGKILL
 * at fsdp_failpoint(name) when the environment names it: FSDPD_FAILPOINT=name dies at its
 * first pass, name:N at its Nth, and name:N:sleep-MS sleeps MS milliseconds there instead.
 * Without the option a failpoint is nothing; with it, a getenv per pass (they are on rare
 * paths). */
#ifndef FSDP_COMMON_FAILPOINT_H
#define FSDP_COMMON_FAILPOINT_H

#ifdef FSDP_FAILPOINTS
void fsdp_failpoint(const char *name);
#else
static inline void fsdp_failpoint(const char *name) {
  (void)name;
}
#endif

#endif
