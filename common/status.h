/* fsdp_status_t: an error code together with the message that explains it.
 *
 * Functions that can fail for a reason a user must read (a request field, a config line)
 * fill a caller-owned status; the message names the thing, the value and the expectation.
 * Plain data, no allocation: safe to embed and to use from any thread that owns it. */
#ifndef FSDP_STATUS_H
#define FSDP_STATUS_H

#include <stdarg.h>
#include <stdbool.h>

#include <fsdp/fsdp_error.h>

#ifdef __cplusplus /* the CUDA backend's kernels are compiled as C++ */
extern "C" {
#endif

#define FSDP_STATUS_MESSAGE_MAX 512

typedef struct fsdp_status {
  int code;  /* 0 or a negative fsdp_error / -errno */
  char message[FSDP_STATUS_MESSAGE_MAX];
} fsdp_status_t;

#define FSDP_STATUS_INIT {0, {0}}

/* Records code and a formatted message (truncated to fit) and returns code, so that a
 * failing path can end in `return fsdp_status_set(st, FSDP_E_..., "...")`. st may be NULL.
 * The arguments may include st->message itself, to prefix what it says. */
__attribute__((format(printf, 3, 4))) int fsdp_status_set(fsdp_status_t *st, int code,
                                                          const char *fmt, ...);
__attribute__((format(printf, 3, 0))) int fsdp_status_setv(fsdp_status_t *st, int code,
                                                         const char *fmt, va_list ap);

/* Resets st to success with an empty message. */
void fsdp_status_clear(fsdp_status_t *st);

static inline bool fsdp_status_ok(const fsdp_status_t *st) {
  return st->code >= 0;
}

#ifdef __cplusplus
}
#endif

#endif
