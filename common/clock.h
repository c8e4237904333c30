/* The monotonic clock, in the units the project counts in, and the deadline arithmetic that
 * goes with it: one home for what each module would otherwise wrap around clock_gettime
 * itself. CLOCK_MONOTONIC is one clock for every process on the host, so two processes may
 * compare its readings. Stateless and thread-safe.
 *
 * The daemon's loop keeps a time of its own (libuv's uv_now, cached once per loop turn):
 * what the loop decides by stays there; these read the clock now. */
#ifndef FSDP_CLOCK_H
#define FSDP_CLOCK_H

#include <limits.h>
#include <stdint.h>
#include <time.h>

/* CLOCK_MONOTONIC in nanoseconds. */
static inline uint64_t fsdp_clock_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* CLOCK_MONOTONIC in whole milliseconds: the unit of deadlines. */
static inline int64_t fsdp_clock_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* CLOCK_MONOTONIC in seconds, with the fraction: for measuring and reporting durations. */
static inline double fsdp_clock_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The deadline timeout_ms from now, in fsdp_clock_now_ms() time. */
static inline int64_t fsdp_clock_deadline_ms(int64_t timeout_ms) {
  return fsdp_clock_now_ms() + timeout_ms;
}

/* Milliseconds left until deadline_ms (fsdp_clock_now_ms() time): 0 once it has passed, at
 * most INT_MAX, so that it is a poll() timeout as it stands. */
static inline int fsdp_clock_left_ms(int64_t deadline_ms) {
  int64_t left = deadline_ms - fsdp_clock_now_ms();
  return left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
}

#endif
