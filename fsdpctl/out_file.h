/* A file fsdpctl writes for its caller (--out): it appears complete or not at all. It is
 * written to a new file of an unpredictable name beside it (O_EXCL|O_NOFOLLOW: never through
 * a link planted there), fsynced and renamed over the name (a link there is replaced, not
 * followed). */
#ifndef FSDPCTL_OUT_FILE_H
#define FSDPCTL_OUT_FILE_H

#include <limits.h>

#include "common/status.h"

typedef struct fsdpctl_out_file {
  const char *out;  /* as the caller named it */
  const char *what; /* the command, in messages ("export") */
  const char *name; /* out's last component */
  int dirfd, fd;    /* its directory, and the new file (write to fd) */
  char tmp[NAME_MAX + 1];
} fsdpctl_out_file_t;

/* Opens out's directory and a new file beside out. st names out on failure (nothing is
 * left then). */
int fsdpctl_out_file_open(fsdpctl_out_file_t *f, const char *out, const char *what,
                          fsdp_status_t *st);

/* A failed write of errno err, as st (RESOURCE_EXHAUSTED for a full disk). */
int fsdpctl_out_file_write_failed(const fsdpctl_out_file_t *f, int err, fsdp_status_t *st);

/* Ends the file: with code 0 it is fsynced and renamed over out (the returned code says if
 * that failed, st why); otherwise the new file is removed and code returned. Closes both
 * descriptors either way. */
int fsdpctl_out_file_end(fsdpctl_out_file_t *f, int code, fsdp_status_t *st);

#endif
