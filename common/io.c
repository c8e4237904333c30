#include "common/io.h"

#include <errno.h>
#include <unistd.h>

int fsdp_write_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0)
      return n < 0 ? -errno : -EIO;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}
