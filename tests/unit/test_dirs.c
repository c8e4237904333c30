/* Paths through descriptors that follow no link (common/dirs.h), and a thread's file-system
 * identity (common/identity.h): links, FIFOs and ".." refused, never followed or blocked
 * on; a removal that takes links as themselves; another uid's rights on one thread only. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/dirs.h"
#include "common/identity.h"

static char root[64];

static void at(char *buf, size_t size, const char *name) {
  snprintf(buf, size, "%s/%s", root, name);
}

static void touch(const char *name, const char *text) {
  char path[256];
  at(path, sizeof path, name);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

static bool exists(const char *name) {
  char path[256];
  struct stat s;
  at(path, sizeof path, name);
  return lstat(path, &s) == 0;
}

static int setup(void **state) {
  (void)state;
  snprintf(root, sizeof root, "/tmp/fsdp-test-dirs-XXXXXX");
  assert_non_null(mkdtemp(root));
  char path[256];
  at(path, sizeof path, "outside");
  assert_int_equal(mkdir(path, 0700), 0);
  touch("outside/precious", "keep");
  at(path, sizeof path, "real");
  assert_int_equal(mkdir(path, 0755), 0);
  char link[256];
  at(link, sizeof link, "link");
  at(path, sizeof path, "outside");
  assert_int_equal(symlink(path, link), 0);
  at(path, sizeof path, "real/fifo");
  assert_int_equal(mkfifo(path, 0600), 0);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", root);
  return system(cmd) == 0 ? 0 : -1;
}

static void test_a_link_on_the_way_is_refused(void **state) {
  (void)state;
  char path[256];
  at(path, sizeof path, "link");
  assert_int_equal(fsdp_dir_open(path, false, 0), -ELOOP);
  at(path, sizeof path, "link/deeper");
  assert_int_equal(fsdp_dir_open(path, true, 0755), -ELOOP);
  assert_false(exists("outside/deeper"));
  at(path, sizeof path, "real/../outside");
  assert_int_equal(fsdp_dir_open(path, false, 0), -EINVAL);
  assert_int_equal(fsdp_dir_open("relative/path", false, 0), -EINVAL);
  at(path, sizeof path, "real/./made/too");
  int fd = fsdp_dir_open(path, true, 0755);
  assert_true(fd >= 0);
  close(fd);
  assert_true(exists("real/made/too"));
}

static void test_only_a_regular_file_opens_and_a_fifo_never_blocks(void **state) {
  (void)state;
  char path[256];
  at(path, sizeof path, "real");
  int dir = fsdp_dir_open(path, false, 0);
  assert_true(dir >= 0);
  assert_int_equal(fsdp_file_open_at(dir, "fifo", O_RDONLY, 0), -FSDP_ENOTREG);
  assert_int_equal(fsdp_file_open_at(dir, "fifo", O_WRONLY, 0), -ENXIO); /* no reader */
  assert_int_equal(symlinkat("fifo", dir, "to-fifo"), 0);
  assert_int_equal(fsdp_file_open_at(dir, "to-fifo", O_RDONLY, 0), -ELOOP);
  assert_int_equal(fsdp_file_open_at(dir, "made", O_RDONLY, 0), -FSDP_ENOTREG); /* a dir */
  touch("real/small", "0123456789");
  char *text;
  size_t len;
  assert_int_equal(fsdp_file_read_at(dir, "small", 9, &text, &len), -EFBIG);
  assert_int_equal(fsdp_file_read_at(dir, "small", 10, &text, &len), 0);
  assert_string_equal(text, "0123456789");
  assert_int_equal(len, 10);
  free(text);
  int fd = fsdp_file_open_at(dir, "small", O_RDONLY, 0);
  assert_true(fd >= 0);
  assert_false(fcntl(fd, F_GETFL) & O_NONBLOCK); /* blocking I/O once open */
  close(fd);
  close(dir);
}

static void test_a_removal_takes_links_as_themselves(void **state) {
  (void)state;
  char path[256], target[256];
  at(path, sizeof path, "doomed");
  assert_int_equal(mkdir(path, 0755), 0);
  at(target, sizeof target, "outside");
  at(path, sizeof path, "doomed/inner-link");
  assert_int_equal(symlink(target, path), 0);
  touch("doomed/file", "x");
  int dir = open(root, O_RDONLY | O_DIRECTORY);
  assert_int_equal(fsdp_dir_remove_at(dir, "link"), -ELOOP); /* a link in the dir's place */
  assert_true(exists("link"));
  assert_int_equal(fsdp_dir_remove_at(dir, "doomed"), 0);
  assert_false(exists("doomed"));
  assert_int_equal(fsdp_dir_remove_at(dir, "doomed"), -ENOENT);
  assert_true(exists("outside/precious"));
  close(dir);
}

/* Whether this thread may open the root-only directory "outside" (once arg, a barrier or
 * NULL, lets it go). */
static void *opens_outside(void *arg) {
  if (arg)
    pthread_barrier_wait(arg);
  char path[256];
  at(path, sizeof path, "outside");
  int fd = open(path, O_RDONLY | O_DIRECTORY);
  if (fd >= 0)
    close(fd);
  return (void *)(intptr_t)(fd >= 0);
}

static void test_another_uids_rights_on_this_thread_alone(void **state) {
  (void)state;
  if (geteuid() != 0)
    skip(); /* taking another uid's rights needs root */
  /* A thread that runs meanwhile, made before (a new one would inherit the identity). */
  pthread_barrier_t entered;
  pthread_barrier_init(&entered, NULL, 2);
  pthread_t other;
  assert_int_equal(pthread_create(&other, NULL, opens_outside, &entered), 0);
  fsdp_identity_t nobody = {.uid = 65534, .gid = 65534}, saved, self;
  fsdp_identity_self(&self);
  assert_int_equal(fsdp_identity_enter(&nobody, &saved), 0);
  assert_true(fsdp_identity_equal(&saved, &self));
  assert_false(opens_outside(NULL)); /* mode 0700, root's */
  pthread_barrier_wait(&entered);
  void *other_opens;
  pthread_join(other, &other_opens);
  pthread_barrier_destroy(&entered);
  assert_true(other_opens); /* the daemon's other threads keep its rights */
  char path[256];
  at(path, sizeof path, "real/by-nobody"); /* real is 0755 root's: nobody may not write */
  assert_int_equal(fsdp_dir_open(path, true, 0755), -EACCES);
  fsdp_identity_leave(&saved);
  assert_true(opens_outside(NULL));
  fsdp_identity_t now;
  fsdp_identity_self(&now);
  assert_true(fsdp_identity_equal(&now, &self));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_a_link_on_the_way_is_refused),
      cmocka_unit_test(test_only_a_regular_file_opens_and_a_fifo_never_blocks),
      cmocka_unit_test(test_a_removal_takes_links_as_themselves),
      cmocka_unit_test(test_another_uids_rights_on_this_thread_alone),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
