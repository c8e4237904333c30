/* A file fsdpctl writes for its caller (out_file.h). */
#include "fsdpctl/out_file.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

/* A new file in dirfd under an unpredictable name derived from name (*ret_tmp, size bytes),
 * made with O_EXCL|O_NOFOLLOW: nothing someone planted under a name the file could have
 * is written through. Returns the descriptor or -errno. */
static int create_temp(int dirfd, const char *name, char *ret_tmp, size_t size) {
  for (int tries = 0; tries < 16; tries++) {
    uint64_t nonce;
    if (getrandom(&nonce, sizeof nonce, 0) != (ssize_t)sizeof nonce)
      return -errno;
    snprintf(ret_tmp, size, ".%.200s.%016" PRIx64 ".tmp", name, nonce);
    int fd = openat(dirfd, ret_tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST)
      return fd >= 0 ? fd : -errno;
  }
  return -EEXIST;
}

/* The directory out lies in, open, and out's last component in *ret_name (in out). */
static int open_parent(const char *out, const char *what, const char **ret_name,
                       fsdp_status_t *st) {
  const char *slash = strrchr(out, '/'), *name = slash ? slash + 1 : out;
  char dir[PATH_MAX];
  if (!*name || strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "%s: %s names no file", what, out);
  if (!slash)
    snprintf(dir, sizeof dir, ".");
  else if ((size_t)(slash - out) >= sizeof dir)
    return fsdp_status_set(st, -ENAMETOOLONG, "%s: %s: name too long", what, out);
  else
    snprintf(dir, sizeof dir, "%.*s", slash == out ? 1 : (int)(slash - out), out);
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return fsdp_status_set(st, -errno, "%s: opening %s: %s", what, dir, strerror(errno));
  *ret_name = name;
  return fd;
}

int fsdpctl_out_file_open(fsdpctl_out_file_t *f, const char *out, const char *what,
                          fsdp_status_t *st) {
  *f = (fsdpctl_out_file_t){.out = out, .what = what, .dirfd = -1, .fd = -1};
  if ((f->dirfd = open_parent(out, what, &f->name, st)) < 0)
    return f->dirfd;
  if ((f->fd = create_temp(f->dirfd, f->name, f->tmp, sizeof f->tmp)) < 0) {
    int err = f->fd;
    close(f->dirfd);
    f->dirfd = -1;
    return fsdp_status_set(st, err, "%s: creating a file beside %s: %s", what, out,
                           strerror(-err));
  }
  return 0;
}

int fsdpctl_out_file_write_failed(const fsdpctl_out_file_t *f, int err, fsdp_status_t *st) {
  return fsdp_status_set(st, err == ENOSPC || err == EDQUOT ? FSDP_E_RESOURCE_EXHAUSTED : -err,
                         "%s: writing %s: %s", f->what, f->out, strerror(err));
}

int fsdpctl_out_file_end(fsdpctl_out_file_t *f, int code, fsdp_status_t *st) {
  if (code == 0 && fsync(f->fd) < 0)
    code = fsdpctl_out_file_write_failed(f, errno, st);
  close(f->fd);
  /* A link or file at out is replaced, never written through. */
  if (code == 0 && renameat(f->dirfd, f->tmp, f->dirfd, f->name) < 0)
    code = fsdp_status_set(st, -errno, "%s: renaming to %s: %s", f->what, f->out,
                           strerror(errno));
  if (code == 0)
    fsync(f->dirfd); /* best effort: the file is complete either way */
  else
    unlinkat(f->dirfd, f->tmp, 0);
  close(f->dirfd);
  f->fd = f->dirfd = -1;
  return code;
}
