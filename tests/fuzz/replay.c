/* Replays fuzz inputs through a libFuzzer-style harness without libFuzzer, so that the
 * default test suite (and its ASan+UBSan build) runs every seed in the corpus. Arguments are
 * files or directories of inputs; a crash or sanitizer report fails the test. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "replay: cannot open %s\n", path);
    return -1;
  }
  uint8_t *data = NULL;
  size_t size = 0, cap = 0;
  for (;;) {
    if (size == cap) {
      cap = cap ? cap * 2 : 4096;
      uint8_t *grown = realloc(data, cap);
      if (!grown) {
        free(data);
        fclose(f);
        return -1;
      }
      data = grown;
    }
    size_t n = fread(data + size, 1, cap - size, f);
    if (n == 0)
      break;
    size += n;
  }
  fclose(f);
  LLVMFuzzerTestOneInput(data, size);
  free(data);
  return 0;
}

static int replay(const char *path, unsigned *count) {
  struct stat sb;
  if (stat(path, &sb) < 0) {
    fprintf(stderr, "replay: %s does not exist\n", path);
    return -1;
  }
  if (!S_ISDIR(sb.st_mode)) {
    (*count)++;
    return replay_file(path);
  }
  DIR *dir = opendir(path);
  if (!dir)
    return -1;
  int r = 0;
  struct dirent *e;
  while (r == 0 && (e = readdir(dir))) {
    if (e->d_name[0] == '.')
      continue;
    char child[4096];
    snprintf(child, sizeof child, "%s/%s", path, e->d_name);
    r = replay(child, count);
  }
  closedir(dir);
  return r;
}

int main(int argc, char **argv) {
  unsigned count = 0;
  for (int i = 1; i < argc; i++)
    if (replay(argv[i], &count) < 0)
      return 1;
  if (count == 0) {
    fprintf(stderr, "replay: no inputs found\n");
    return 1;
  }
  printf("replayed %u inputs\n", count);
  return 0;
}
