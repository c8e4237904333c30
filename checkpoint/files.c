/* The checkpoint library's shared pieces (checkpoint/files.h). */
#include "checkpoint/files.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void host_file(char *buf, size_t size, unsigned host, const char *ext) {
  snprintf(buf, size, "host-%u.%s", host, ext);
}

int io_failed(fsdp_status_t *st, const char *what, const char *path, int err) {
  if (err == ECANCELED)
    return fsdp_status_set(st, FSDP_E_ABORTED, "checkpoint: %s %s: abandoned by the daemon's stop",
                           what, path);
  return fsdp_status_set(st,
                         err == ENOSPC || err == EDQUOT ? FSDP_E_RESOURCE_EXHAUSTED
                                                        : FSDP_E_UNAVAILABLE,
                         "checkpoint: %s %s: %s", what, path, strerror(err));
}

bool join(char *buf, size_t size, const char *a, const char *sep, const char *b) {
  return (size_t)snprintf(buf, size, "%s%s%s", a, sep, b) < size;
}

static const char *const state_names[FSDP_CHECKPOINT_ARRAYS_MAX] = {"state0", "state1",
                                                                   "state2"};

const char *block_name(unsigned b) {
  return b == 0 ? "masters" : state_names[b - 1];
}

size_t complete_steps(const char *dir, uint64_t *ret, size_t max) {
  DIR *d = opendir(dir);
  if (!d)
    return 0;
  size_t n = 0;
  char step_dir[PATH_MAX], path[PATH_MAX];
  for (struct dirent *e; (e = readdir(d));) {
    char *end;
    if (strncmp(e->d_name, "step-", 5) != 0)
      continue;
    uint64_t step = strtoull(e->d_name + 5, &end, 10);
    if (*end || end == e->d_name + 5 || !join(step_dir, sizeof step_dir, dir, "/", e->d_name) ||
        !join(path, sizeof path, step_dir, "/", MANIFEST) || access(path, F_OK) != 0)
      continue;
    if (n < max)
      ret[n] = step;
    n++;
  }
  closedir(d);
  return n;
}

int steps_descending(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}
