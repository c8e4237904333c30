/* What the checkpoint fuzz harnesses share: a fuzz input as a checkpoint's files. The input
 * is split at SEPARATOR into manifest.json, host-0.json and host-0.bin (a part missing: no
 * such file), written into step-1/ of a directory of the process's own, made on first use
 * and removed at exit. Header-only: each harness is one file and the replay driver. */
#ifndef FSDP_FUZZ_CHECKPOINT_FILES_H
#define FSDP_FUZZ_CHECKPOINT_FILES_H

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SEPARATOR "\n----\n"

static const char *const fuzz_files[] = {"manifest.json", "host-0.json", "host-0.bin"};
static char fuzz_root[64], fuzz_step_dir[96];

static void fuzz_write(const char *dir, const char *name, const uint8_t *data, size_t size) {
  char path[256];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    abort();
  for (size_t done = 0; done < size;) {
    ssize_t n = write(fd, data + done, size - done);
    if (n <= 0)
      abort();
    done += (size_t)n;
  }
  close(fd);
}

/* Removes every file the harness may have left in dir. */
static void fuzz_clear(const char *dir) {
  char path[256];
  for (size_t i = 0; i < sizeof fuzz_files / sizeof *fuzz_files; i++) {
    snprintf(path, sizeof path, "%s/%s", dir, fuzz_files[i]);
    unlink(path);
  }
}

static void fuzz_remove_root(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", fuzz_root);
  if (system(cmd) != 0)
    fprintf(stderr, "fuzz: could not remove %s\n", fuzz_root);
}

/* The step directory holding the input's files (absolute, as the reader wants it). */
static const char *fuzz_checkpoint(const uint8_t *data, size_t size) {
  if (!fuzz_root[0]) {
    snprintf(fuzz_root, sizeof fuzz_root, "/tmp/fsdp-fuzz-XXXXXX");
    if (!mkdtemp(fuzz_root))
      abort();
    snprintf(fuzz_step_dir, sizeof fuzz_step_dir, "%s/step-1", fuzz_root);
    if (mkdir(fuzz_step_dir, 0755) < 0)
      abort();
    atexit(fuzz_remove_root);
  }
  fuzz_clear(fuzz_step_dir);
  const uint8_t *p = data, *end = data + size;
  size_t sep = strlen(SEPARATOR);
  for (size_t i = 0; i < sizeof fuzz_files / sizeof *fuzz_files && p <= end; i++) {
    const uint8_t *next = memmem(p, (size_t)(end - p), SEPARATOR, sep);
    if (!next || i == 2)
      next = end;
    fuzz_write(fuzz_step_dir, fuzz_files[i], p, (size_t)(next - p));
    if (next == end)
      break;
    p = next + sep;
  }
  return fuzz_step_dir;
}

#endif
