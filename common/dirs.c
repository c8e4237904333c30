/* Paths through descriptors that follow no link (common/dirs.h). */
#include "common/dirs.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *fsdp_dirs_strerror(int err) {
  if (err == FSDP_ENOTREG)
    return "not a regular file or directory where one was expected";
  if (err == ELOOP)
    return "a symbolic link, which is not followed";
  return strerror(err);
}

/* Why name under dirfd could not be opened as asked (err, from openat): a link says -ELOOP
 * and anything else of the wrong type -FSDP_ENOTREG, whichever of the two the kernel said. */
static int open_failure(int dirfd, const char *name, int err) {
  struct stat s;
  if ((err == ELOOP || err == ENOTDIR) &&
      fstatat(dirfd, name, &s, AT_SYMLINK_NOFOLLOW) == 0)
    return S_ISLNK(s.st_mode) ? -ELOOP : -FSDP_ENOTREG;
  return -err;
}

int fsdp_dir_open_at(int dirfd, const char *name, bool create, mode_t mode, bool *ret_made) {
  const int flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
  bool made = false;
  int fd = openat(dirfd, name, flags);
  if (fd < 0 && errno == ENOENT && create) {
    made = mkdirat(dirfd, name, mode) == 0;
    if (!made && errno != EEXIST) /* EEXIST: another made it meanwhile */
      return -errno;
    fd = openat(dirfd, name, flags);
  }
  if (fd < 0)
    return open_failure(dirfd, name, errno);
  if (ret_made)
    *ret_made = made;
  return fd;
}

int fsdp_dir_open(const char *path, bool create, mode_t mode) {
  if (path[0] != '/')
    return -EINVAL;
  size_t len = strlen(path);
  if (len >= PATH_MAX)
    return -ENAMETOOLONG;
  char copy[PATH_MAX];
  memcpy(copy, path, len + 1);
  int fd = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  char *save = NULL;
  for (char *name = strtok_r(copy, "/", &save); name; name = strtok_r(NULL, "/", &save)) {
    if (strcmp(name, ".") == 0)
      continue;
    int next = strcmp(name, "..") == 0 ? -EINVAL : fsdp_dir_open_at(fd, name, create, mode, NULL);
    close(fd);
    if (next < 0)
      return next;
    fd = next;
  }
  return fd;
}

int fsdp_file_open_at(int dirfd, const char *name, int flags, mode_t mode) {
  int fd = openat(dirfd, name, flags | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, mode);
  if (fd < 0)
    return open_failure(dirfd, name, errno);
  struct stat s;
  int r = fstat(fd, &s) < 0 ? -errno : !S_ISREG(s.st_mode) ? -FSDP_ENOTREG : 0;
  int now = r == 0 ? fcntl(fd, F_GETFL) : 0;
  if (r == 0 && !(flags & O_NONBLOCK) && (now < 0 || fcntl(fd, F_SETFL, now & ~O_NONBLOCK) < 0))
    r = -errno;
  if (r < 0) {
    close(fd);
    return r;
  }
  return fd;
}

int fsdp_file_read_at(int dirfd, const char *name, size_t max, char **ret_buf,
                      size_t *ret_len) {
  int fd = fsdp_file_open_at(dirfd, name, O_RDONLY, 0);
  if (fd < 0)
    return fd;
  struct stat s;
  int r = fstat(fd, &s) < 0 ? -errno : (uint64_t)s.st_size > max ? -EFBIG : 0;
  char *buf = r == 0 ? malloc((size_t)s.st_size + 1) : NULL;
  if (r == 0 && !buf)
    r = -ENOMEM;
  /* The size as fstat saw it, no more: a file that grows meanwhile is read to that length,
   * and a file that shrinks ends early (what it holds is checked by who reads it). */
  size_t len = 0;
  while (r == 0 && len < (size_t)s.st_size) {
    ssize_t n = read(fd, buf + len, (size_t)s.st_size - len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      r = -errno;
    else if (n == 0)
      break;
    else
      len += (size_t)n;
  }
  close(fd);
  if (r < 0) {
    free(buf);
    return r;
  }
  buf[len] = '\0';
  *ret_buf = buf;
  *ret_len = len;
  return 0;
}

DIR *fsdp_dir_list(int dirfd) {
  int fd = dup(dirfd);
  DIR *d = fd < 0 ? NULL : fdopendir(fd);
  if (!d) {
    int err = errno;
    if (fd >= 0)
      close(fd);
    errno = err;
    return NULL;
  }
  rewinddir(d); /* the copy shares the offset of dirfd, which another listing may have moved */
  return d;
}

int fsdp_dir_remove_at(int dirfd, const char *name) {
  int fd = fsdp_dir_open_at(dirfd, name, false, 0, NULL);
  if (fd < 0)
    return fd;
  DIR *d = fsdp_dir_list(fd);
  int r = d ? 0 : -errno;
  for (struct dirent *e; d && (e = readdir(d));) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
      continue;
    /* A file or a link goes as itself; an empty directory goes too; a full one stays (and
     * so does name): nothing in a checkpoint's directory has one. */
    if (unlinkat(fd, e->d_name, 0) < 0 && (errno != EISDIR ||
                                           unlinkat(fd, e->d_name, AT_REMOVEDIR) < 0) &&
        r == 0)
      r = -errno;
  }
  if (d)
    closedir(d);
  close(fd);
  if (unlinkat(dirfd, name, AT_REMOVEDIR) < 0 && r == 0)
    r = -errno;
  return r;
}
