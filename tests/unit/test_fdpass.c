/* fdpass: descriptors and payloads over unix stream sockets, within a process and across
 * fork(); deadlines, EINTR, peer loss, truncated or surplus descriptors (no leaks: the
 * process's descriptor count is compared before and after), split payloads, credentials. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/clock.h"
#include "common/fdpass.h"
#include "tests/unit/fd_count.h"

typedef struct header {
  uint32_t magic;
  uint32_t kind;
  uint64_t size;
  char text[240];
} header_t;

#define MAGIC 0x46534450u

/* In a forked child cmocka's asserts must not run; a failed check names its line. */
#define CHILD_CHECK(cond)                                                              \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      fprintf(stderr, "child: check failed at %s:%d: %s (errno %d)\n", __FILE__,     \
              __LINE__, #cond, errno);                                                 \
      _exit(1);                                                                        \
    }                                                                                  \
  } while (0)

static void make_pair(int sv[2]) {
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
}

static int make_memfd(size_t size, unsigned char fill) {
  int fd = memfd_create("test-fdpass", MFD_CLOEXEC);
  assert_true(fd >= 0);
  assert_int_equal(ftruncate(fd, (off_t)size), 0);
  unsigned char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  assert_true(p != MAP_FAILED);
  memset(p, fill, size);
  munmap(p, size);
  return fd;
}

static bool same_file(int a, int b) {
  struct stat sa, sb;
  return fstat(a, &sa) == 0 && fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

static int wait_child(pid_t pid) {
  int status;
  while (waitpid(pid, &status, 0) < 0)
    assert_int_equal(errno, EINTR);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* The parent sends a memfd it filled; the child maps it, checks the bytes, writes its own
 * into the second half and answers; the parent sees them through its own mapping. */
static void test_memfd_across_fork(void **state) {
  (void)state;
  const size_t size = 1 << 20;
  int before = count_fds();
  int sv[2];
  make_pair(sv);
  int mfd = make_memfd(size, 0xab);

  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(sv[0]);
    header_t h;
    int fd = -1;
    size_t n = 0;
    CHILD_CHECK(fsdp_fd_recv(sv[1], &h, sizeof h, 1, 5000, &fd, &n) == 0);
    CHILD_CHECK(n == 1 && h.magic == MAGIC && h.size == size);
    CHILD_CHECK(strcmp(h.text, "weights") == 0);
    CHILD_CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC);
    unsigned char *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    CHILD_CHECK(p != MAP_FAILED);
    for (size_t i = 0; i < size / 2; i++)
      CHILD_CHECK(p[i] == 0xab);
    memset(p + size / 2, 0xcd, size / 2);
    header_t ack = {.magic = MAGIC, .kind = 2};
    CHILD_CHECK(fsdp_fd_send(sv[1], NULL, 0, &ack, sizeof ack, 5000) == 0);
    _exit(0);
  }
  close(sv[1]);
  header_t h = {.magic = MAGIC, .kind = 1, .size = size};
  snprintf(h.text, sizeof h.text, "weights");
  assert_int_equal(fsdp_fd_send(sv[0], &mfd, 1, &h, sizeof h, 5000), 0);
  header_t ack;
  size_t n = 99;
  assert_int_equal(fsdp_fd_recv(sv[0], &ack, sizeof ack, 0, 5000, NULL, &n), 0);
  assert_int_equal(n, 0);
  assert_int_equal(ack.kind, 2);
  assert_int_equal(wait_child(pid), 0);

  unsigned char *p = mmap(NULL, size, PROT_READ, MAP_SHARED, mfd, 0);
  assert_true(p != MAP_FAILED);
  assert_int_equal(p[0], 0xab);
  assert_int_equal(p[size / 2], 0xcd);
  assert_int_equal(p[size - 1], 0xcd);
  munmap(p, size);
  close(mfd);
  close(sv[0]);
  assert_int_equal(count_fds(), before);
}

static void test_several_fds(void **state) {
  (void)state;
  int before = count_fds();
  int sv[2];
  make_pair(sv);
  int pipefd[2];
  assert_int_equal(pipe2(pipefd, O_CLOEXEC), 0);
  int sent[4] = {make_memfd(4096, 1), make_memfd(8192, 2), make_memfd(4096, 3), pipefd[1]};
  header_t h = {.magic = MAGIC, .kind = 4};
  assert_int_equal(fsdp_fd_send(sv[0], sent, 4, &h, sizeof h, 1000), 0);

  int got[8];
  size_t n = 0;
  header_t r;
  assert_int_equal(fsdp_fd_recv(sv[1], &r, sizeof r, 8, 1000, got, &n), 0);
  assert_int_equal(n, 4);
  assert_int_equal(r.kind, 4);
  for (size_t i = 0; i < n; i++) {
    assert_true(got[i] != sent[i]);
    assert_true(same_file(got[i], sent[i])); /* in order */
    assert_true(fcntl(got[i], F_GETFD) & FD_CLOEXEC);
  }
  /* The received write end of the pipe is the same pipe. */
  assert_int_equal(write(got[3], "x", 1), 1);
  char c = 0;
  assert_int_equal(read(pipefd[0], &c, 1), 1);
  assert_int_equal(c, 'x');

  for (size_t i = 0; i < n; i++) {
    close(got[i]);
    close(sent[i]);
  }
  close(pipefd[0]);
  close(sv[0]);
  close(sv[1]);
  assert_int_equal(count_fds(), before);
}

static void test_timeout_when_nothing_is_sent(void **state) {
  (void)state;
  int sv[2];
  make_pair(sv);
  header_t h;
  int fd = -1;
  int64_t t0 = fsdp_clock_now_ms();
  assert_int_equal(fsdp_fd_recv(sv[1], &h, sizeof h, 1, 150, &fd, NULL), -ETIMEDOUT);
  int64_t waited = fsdp_clock_now_ms() - t0;
  assert_true(waited >= 150);
  assert_true(waited < 2000);
  assert_int_equal(fd, -1); /* written only on success */
  assert_int_equal(fsdp_fd_recv(sv[1], &h, sizeof h, 1, 0, &fd, NULL), -ETIMEDOUT);
  close(sv[0]);
  close(sv[1]);
}

static void on_alarm(int sig) {
  (void)sig;
}

/* Signals without SA_RESTART interrupt poll(); the call goes on until its own deadline. */
static void test_eintr_keeps_the_deadline(void **state) {
  (void)state;
  struct sigaction sa = {.sa_handler = on_alarm}, old;
  sigemptyset(&sa.sa_mask);
  assert_int_equal(sigaction(SIGALRM, &sa, &old), 0);
  struct itimerval it = {.it_interval = {0, 20000}, .it_value = {0, 20000}};
  assert_int_equal(setitimer(ITIMER_REAL, &it, NULL), 0);

  int sv[2];
  make_pair(sv);
  header_t h;
  int64_t t0 = fsdp_clock_now_ms();
  assert_int_equal(fsdp_fd_recv(sv[1], &h, sizeof h, 0, 200, NULL, NULL), -ETIMEDOUT);
  assert_true(fsdp_clock_now_ms() - t0 >= 200);

  struct itimerval off = {{0, 0}, {0, 0}};
  setitimer(ITIMER_REAL, &off, NULL);
  sigaction(SIGALRM, &old, NULL);
  close(sv[0]);
  close(sv[1]);
}

static void test_peer_closed(void **state) {
  (void)state;
  int before = count_fds();
  int sv[2];
  make_pair(sv);
  header_t h = {.magic = MAGIC};
  close(sv[0]);
  assert_int_equal(fsdp_fd_recv(sv[1], &h, sizeof h, 0, 1000, NULL, NULL), -ECONNRESET);
  /* No SIGPIPE kills the test: MSG_NOSIGNAL. */
  assert_int_equal(fsdp_fd_send(sv[1], NULL, 0, &h, sizeof h, 1000), -ECONNRESET);
  close(sv[1]);

  /* The peer dies halfway through a message that carried a descriptor: the descriptor that
   * arrived is closed, not leaked. */
  make_pair(sv);
  int mfd = make_memfd(4096, 7);
  int mid = count_fds();
  char half[sizeof h / 2];
  memset(half, 0, sizeof half);
  struct iovec iov = {.iov_base = half, .iov_len = sizeof half};
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int))];
  } control;
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                       .msg_controllen = sizeof control.buf};
  struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cmsg), &mfd, sizeof mfd);
  assert_int_equal(sendmsg(sv[0], &msg, 0), (ssize_t)sizeof half);
  close(sv[0]);
  int fd = -1;
  assert_int_equal(fsdp_fd_recv(sv[1], &h, sizeof h, 1, 1000, &fd, NULL), -ECONNRESET);
  assert_int_equal(fd, -1);
  assert_int_equal(count_fds(), mid - 1); /* sv[0] closed, nothing else changed */
  close(sv[1]);
  close(mfd);
  assert_int_equal(count_fds(), before);
}

/* Sends n copies of fd with one sendmsg, bypassing fsdp_fd_send's limit. */
static void raw_send_fds(int sock, int fd, size_t n, const void *payload, size_t len) {
  int fds[64];
  assert_true(n <= 64);
  for (size_t i = 0; i < n; i++)
    fds[i] = fd;
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * 64)];
  } control;
  struct iovec iov = {.iov_base = (void *)payload, .iov_len = len};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                       .msg_controllen = CMSG_SPACE(sizeof(int) * n)};
  struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int) * n);
  memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * n);
  assert_int_equal(sendmsg(sock, &msg, 0), (ssize_t)len);
}

static void test_surplus_and_truncated_fds_are_closed(void **state) {
  (void)state;
  int sv[2];
  make_pair(sv);
  int fds[4] = {make_memfd(4096, 1), make_memfd(4096, 2), make_memfd(4096, 3),
                make_memfd(4096, 4)};
  int before = count_fds();

  /* More than the receiver takes: all closed, the payload consumed, the stream in step. */
  header_t h = {.magic = MAGIC, .kind = 1};
  assert_int_equal(fsdp_fd_send(sv[0], fds, 4, &h, sizeof h, 1000), 0);
  h.kind = 2;
  assert_int_equal(fsdp_fd_send(sv[0], fds, 1, &h, sizeof h, 1000), 0);
  int got[2] = {-1, -1};
  size_t n = 99;
  header_t r;
  assert_int_equal(fsdp_fd_recv(sv[1], &r, sizeof r, 2, 1000, got, &n), -EMSGSIZE);
  assert_int_equal(n, 99);
  assert_int_equal(count_fds(), before);
  assert_int_equal(fsdp_fd_recv(sv[1], &r, sizeof r, 2, 1000, got, &n), 0);
  assert_int_equal(r.kind, 2);
  assert_int_equal(n, 1);
  assert_true(same_file(got[0], fds[0]));
  close(got[0]);

  /* More than fit in the control buffer: the kernel truncates (MSG_CTRUNC) and drops the
   * rest; the ones that arrived are closed. */
  h.kind = 3;
  raw_send_fds(sv[0], fds[1], FSDP_FD_MAX + 8, &h, sizeof h);
  assert_int_equal(fsdp_fd_recv(sv[1], &r, sizeof r, 2, 1000, got, &n), -EMSGSIZE);
  assert_int_equal(count_fds(), before);

  /* A receiver expecting none closes what it did not ask for. */
  h.kind = 4;
  assert_int_equal(fsdp_fd_send(sv[0], fds, 2, &h, sizeof h, 1000), 0);
  assert_int_equal(fsdp_fd_recv(sv[1], &r, sizeof r, 0, 1000, NULL, &n), -EMSGSIZE);
  assert_int_equal(count_fds(), before);

  for (int i = 0; i < 4; i++)
    close(fds[i]);
  close(sv[0]);
  close(sv[1]);
}

/* A sender that writes its message in pieces, some time apart, with the descriptors on
 * the second piece: the receiver assembles the payload and gets the descriptors. */
static void test_payload_split_across_reads(void **state) {
  (void)state;
  int before = count_fds();
  int sv[2];
  make_pair(sv);
  int mfd = make_memfd(4096, 9);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(sv[1]);
    header_t h = {.magic = MAGIC, .kind = 7, .size = 12345};
    snprintf(h.text, sizeof h.text, "split across reads");
    const char *p = (const char *)&h;
    CHILD_CHECK(write(sv[0], p, 3) == 3);
    usleep(30000);
    struct iovec iov = {.iov_base = (void *)(p + 3), .iov_len = 50};
    union {
      struct cmsghdr align;
      char buf[CMSG_SPACE(sizeof(int))];
    } control;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cmsg), &mfd, sizeof mfd);
    CHILD_CHECK(sendmsg(sv[0], &msg, 0) == 50);
    usleep(30000);
    CHILD_CHECK(write(sv[0], p + 53, sizeof h - 53) == (ssize_t)(sizeof h - 53));
    _exit(0);
  }
  close(sv[0]);
  header_t r;
  int fd = -1;
  size_t n = 0;
  assert_int_equal(fsdp_fd_recv(sv[1], &r, sizeof r, 1, 5000, &fd, &n), 0);
  assert_int_equal(n, 1);
  assert_int_equal(r.magic, MAGIC);
  assert_int_equal(r.size, 12345);
  assert_string_equal(r.text, "split across reads");
  assert_true(same_file(fd, mfd));
  assert_int_equal(wait_child(pid), 0);
  close(fd);
  close(mfd);
  close(sv[1]);
  assert_int_equal(count_fds(), before);
}

/* A peer that stops reading: the send gives up at its deadline instead of blocking. */
static void test_send_timeout_when_peer_does_not_read(void **state) {
  (void)state;
  int sv[2];
  make_pair(sv);
  int fl = fcntl(sv[0], F_GETFL);
  assert_int_equal(fcntl(sv[0], F_SETFL, fl | O_NONBLOCK), 0);
  char junk[4096];
  memset(junk, 0, sizeof junk);
  while (write(sv[0], junk, sizeof junk) > 0) {
  }
  assert_true(errno == EAGAIN || errno == EWOULDBLOCK);
  assert_int_equal(fcntl(sv[0], F_SETFL, fl), 0); /* blocking again: still no hang */
  header_t h = {.magic = MAGIC};
  int64_t t0 = fsdp_clock_now_ms();
  assert_int_equal(fsdp_fd_send(sv[0], NULL, 0, &h, sizeof h, 100), -ETIMEDOUT);
  assert_true(fsdp_clock_now_ms() - t0 >= 100);
  close(sv[0]);
  close(sv[1]);
}

static void test_invalid_arguments(void **state) {
  (void)state;
  int sv[2];
  make_pair(sv);
  header_t h = {0};
  int fds[FSDP_FD_MAX + 1];
  for (int i = 0; i < FSDP_FD_MAX + 1; i++)
    fds[i] = sv[0];
  assert_int_equal(fsdp_fd_send(sv[0], NULL, 0, &h, 0, 100), -EINVAL);
  assert_int_equal(fsdp_fd_send(sv[0], fds, FSDP_FD_MAX + 1, &h, sizeof h, 100), -EINVAL);
  assert_int_equal(fsdp_fd_send(sv[0], NULL, 1, &h, sizeof h, 100), -EINVAL);
  assert_int_equal(fsdp_fd_send(sv[0], NULL, 0, &h, sizeof h, -1), -EINVAL);
  int bad = -1;
  assert_int_equal(fsdp_fd_send(sv[0], &bad, 1, &h, sizeof h, 100), -EINVAL);
  assert_int_equal(fsdp_fd_recv(sv[1], &h, sizeof h, 1, 100, NULL, NULL), -EINVAL);
  assert_int_equal(fsdp_fd_recv(sv[1], &h, sizeof h, FSDP_FD_MAX + 1, 100, fds, NULL), -EINVAL);
  assert_int_equal(fsdp_fd_recv(sv[1], &h, 0, 0, 100, NULL, NULL), -EINVAL);
  /* A descriptor that is not open is the kernel's to refuse. */
  int closed = dup(sv[0]);
  close(closed);
  assert_int_equal(fsdp_fd_send(sv[0], &closed, 1, &h, sizeof h, 100), -EBADF);
  close(sv[0]);
  close(sv[1]);
}

static void test_peer_credentials(void **state) {
  (void)state;
  int sv[2];
  make_pair(sv);
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  assert_int_equal(fsdp_peer_credentials(sv[0], &pid, &uid, &gid), 0);
  assert_int_equal(pid, getpid());
  assert_int_equal(uid, getuid());
  assert_int_equal(gid, getgid());
  assert_int_equal(fsdp_peer_credentials(sv[0], NULL, NULL, NULL), 0);
  int pipefd[2];
  assert_int_equal(pipe(pipefd), 0);
  assert_int_equal(fsdp_peer_credentials(pipefd[0], &pid, &uid, &gid), -ENOTSOCK);
  close(pipefd[0]);
  close(pipefd[1]);
  close(sv[0]);
  close(sv[1]);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_memfd_across_fork),
      cmocka_unit_test(test_several_fds),
      cmocka_unit_test(test_timeout_when_nothing_is_sent),
      cmocka_unit_test(test_eintr_keeps_the_deadline),
      cmocka_unit_test(test_peer_closed),
      cmocka_unit_test(test_surplus_and_truncated_fds_are_closed),
      cmocka_unit_test(test_payload_split_across_reads),
      cmocka_unit_test(test_send_timeout_when_peer_does_not_read),
      cmocka_unit_test(test_invalid_arguments),
      cmocka_unit_test(test_peer_credentials),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
