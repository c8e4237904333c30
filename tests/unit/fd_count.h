/* Counts this process's open descriptors, so that a unit test can compare the count before
 * and after the code under test and find a leak. For tests only; it asserts through cmocka, so
 * call it from a test body, never from a forked child. */
#ifndef FSDP_TESTS_FD_COUNT_H
#define FSDP_TESTS_FD_COUNT_H

/* The entries of /proc/self/fd, the descriptor opendir() holds while reading them included;
 * the same extra one on every call, so counts compare. */
int count_fds(void);

#endif
