/* File descriptors and a small payload over a connected AF_UNIX stream socket.
 *
 * The daemon hands memory to a trainer as a memfd over the trainer's unix socket with
 * SCM_RIGHTS, never by a name in /dev/shm. One message is a fixed-length payload (a header
 * struct the caller defines; the receiver knows its length) with 0..FSDP_FD_MAX descriptors
 * attached to its first byte. fsdp_fd_recv() reads exactly one such message and either
 * returns all of its descriptors or none: on any failure every descriptor that arrived is
 * closed, so a hostile or buggy peer cannot make the receiver leak descriptors.
 *
 * Both calls wait at most timeout_ms (monotonic clock) and work on blocking and
 * non-blocking sockets alike; EINTR is retried within the same deadline. A call that fails
 * after part of a message went through leaves the stream out of step: close the socket.
 * Received descriptors carry O_CLOEXEC. Stateless and thread-safe; the caller must not read
 * (or write) the same socket from two threads at once. No logging: negative errno returns.
 *
 * fsdp_peer_credentials() reads the peer's pid, uid and gid (SO_PEERCRED), as recorded by
 * the kernel when the peer connected; the daemon checks them before it passes memory. */
#ifndef FSDP_FDPASS_H
#define FSDP_FDPASS_H

#include <stddef.h>
#include <sys/types.h>

/* Descriptors in one message; well below the kernel's SCM_MAX_FD (253). */
#define FSDP_FD_MAX 32

/* Sends payload[0, len) with fds[0, n_fds) attached (the descriptors are duplicated into
 * the peer; the caller keeps its own). len >= 1: a stream socket carries descriptors only
 * along with data. n_fds <= FSDP_FD_MAX; fds may be NULL when n_fds is 0.
 * Returns 0, or: -EINVAL (bad argument), -ETIMEDOUT (the peer did not take the message
 * within timeout_ms; timeout_ms >= 0, 0 tries once without waiting), -ECONNRESET (the
 * peer is gone: EPIPE is reported as ECONNRESET; no SIGPIPE is raised), or another -errno
 * from sendmsg/poll (-EBADF for a descriptor that is not open). */
int fsdp_fd_send(int sock, const int *fds, size_t n_fds, const void *payload, size_t len,
                 int timeout_ms);

/* Receives one message of exactly len bytes (len >= 1) into payload and up to max_fds
 * descriptors into ret_fds (O_CLOEXEC set), their count into *ret_n_fds; ret_fds and
 * ret_n_fds are written only on success (ret_fds may be NULL when max_fds is 0;
 * ret_n_fds may be NULL when the caller does not care). payload's contents are
 * unspecified on failure.
 * Returns 0, or: -EINVAL (bad argument), -ETIMEDOUT (the whole message did not arrive
 * within timeout_ms), -ECONNRESET (the peer closed the connection before the message was
 * complete, or reset it), -EMSGSIZE (more descriptors than max_fds arrived, or more than
 * the kernel could deliver (MSG_CTRUNC): all of them were closed and the payload was read
 * to its end, so the stream stays in step), or another -errno from recvmsg/poll. */
int fsdp_fd_recv(int sock, void *payload, size_t len, size_t max_fds, int timeout_ms,
                 int *ret_fds, size_t *ret_n_fds);

/* The peer's credentials from SO_PEERCRED; each ret_* may be NULL. Returns 0 or -errno
 * (-ENOTSOCK, -EBADF, -ENOTCONN...). */
int fsdp_peer_credentials(int sock, pid_t *ret_pid, uid_t *ret_uid, gid_t *ret_gid);

#endif
