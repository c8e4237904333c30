/* Paths that a caller names or that a file describes, used through descriptors that follow no
 * symbolic link: the daemon (root, or its own user) acts on what is at the path, never on
 * where a link planted in it points, and never opens a FIFO or a device as if it were a
 * file. Each component is looked up alone, relative to its parent's descriptor, with
 * O_NOFOLLOW: every directory on the way must be a directory, a file a regular file.
 *
 * Whose rights the lookups use is the calling thread's (common/identity.h). Blocking
 * (filesystem calls): from pool threads or tools. Stateless. */
#ifndef FSDP_COMMON_DIRS_H
#define FSDP_COMMON_DIRS_H

#include <dirent.h>
#include <stdbool.h>
#include <errno.h>
#include <stddef.h>
#include <sys/types.h>

/* The errors below besides the lookup's own: a component that is a symbolic link gives
 * -ELOOP, one that is not what is expected (a directory, or a regular file) gives
 * -FSDP_ENOTREG, an errno of Linux's that nothing here meets otherwise. */
#define FSDP_ENOTREG EMEDIUMTYPE

/* strerror(err), in words of their own for FSDP_ENOTREG and ELOOP as these functions mean
 * them. */
const char *fsdp_dirs_strerror(int err);

/* Opens the directory at path (absolute), one component at a time from "/"; with create,
 * the components missing are made with mode. "." and empty components are skipped; ".."
 * is refused (-EINVAL), as is a relative path. Returns the descriptor (O_DIRECTORY,
 * O_CLOEXEC) or -errno. */
int fsdp_dir_open(const char *path, bool create, mode_t mode);

/* Opens name (one component) under dirfd as a directory, following no link; with create,
 * makes it with mode when missing (*ret_made true then; ret_made may be NULL). Returns the
 * descriptor or -errno. */
int fsdp_dir_open_at(int dirfd, const char *name, bool create, mode_t mode, bool *ret_made);

/* Opens name under dirfd as a regular file with flags (O_RDONLY, or O_WRONLY with O_CREAT
 * and the like; O_NOFOLLOW, O_CLOEXEC and, for the open itself, O_NONBLOCK are added):
 * never a link, never anything but a regular file, and never blocking on a FIFO or a
 * device as it opens. Returns the descriptor (blocking I/O) or -errno. */
int fsdp_file_open_at(int dirfd, const char *name, int flags, mode_t mode);

/* Reads all of the regular file name under dirfd, NUL-terminated, into *ret_buf (free it),
 * its length in *ret_len: -EFBIG when it holds more than max bytes. Returns 0 or -errno. */
int fsdp_file_read_at(int dirfd, const char *name, size_t max, char **ret_buf,
                      size_t *ret_len);

/* A listing of the directory open at dirfd from its start, on a descriptor of its own (the
 * caller keeps dirfd; closedir the listing). NULL with errno set on failure. */
DIR *fsdp_dir_list(int dirfd);

/* Removes the directory name under dirfd with what lies in it (files and links, each link as
 * itself, never what it names; empty subdirectories), following no link: where name is a
 * link or not a directory nothing is removed (-ELOOP, -FSDP_ENOTREG). Returns 0, -ENOENT
 * when there is no such name, or the first other -errno (what could go, went). */
int fsdp_dir_remove_at(int dirfd, const char *name);

#endif
