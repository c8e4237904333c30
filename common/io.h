/* Whole-buffer writes: write(2) until every byte is out, through short writes and EINTR. */
#ifndef FSDP_COMMON_IO_H
#define FSDP_COMMON_IO_H

#include <stddef.h>

/* Returns 0, or -errno of the write that failed (-EIO for a write that wrote nothing). */
int fsdp_write_all(int fd, const void *buf, size_t len);

#endif
