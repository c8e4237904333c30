/* Fuzz harness of fsdpctl export's safetensors writer (fsdpctl/export.h) over the checkpoint
 * files of checkpoint_files.h, the dtype chosen by the input's length. Either the export
 * fails saying why and leaves nothing beside the checkpoint, or the file it writes holds
 * together as safetensors: an 8-byte header length, a JSON header padded to 8 bytes whose
 * every tensor has a shape whose product in its dtype is its byte range, the ranges one
 * after the other from 0 to the end of the file. */
#include <dirent.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <json-c/json.h>

#include "tests/fuzz/checkpoint_files.h"
#include "fsdpctl/export.h"
#include "kernels/kernels.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uint8_t *read_all(const char *path, size_t *ret_size) {
  FILE *f = fopen(path, "rb");
  if (!f)
    abort();
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  uint8_t *buf = malloc((size_t)n + 1);
  if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n)
    abort();
  fclose(f);
  *ret_size = (size_t)n;
  return buf;
}

typedef struct range {
  uint64_t begin, end;
} range_t;

static int by_begin(const void *a, const void *b) {
  const range_t *x = a, *y = b;
  return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* Aborts unless the file at path holds together as safetensors of elements elem bytes. */
static void check_safetensors(const char *path, const char *dtype, size_t elem) {
  size_t size;
  uint8_t *raw = read_all(path, &size);
  uint64_t len = 0;
  for (int b = 0; b < 8 && size >= 8; b++)
    len |= (uint64_t)raw[b] << (8 * b);
  if (size < 8 || len % 8 || len > size - 8)
    abort();
  json_tokener *tok = json_tokener_new();
  json_object *h = json_tokener_parse_ex(tok, (const char *)raw + 8, (int)len);
  if (!h || !json_object_is_type(h, json_type_object))
    abort();
  for (size_t i = (size_t)tok->char_offset; i < len; i++)
    if (raw[8 + i] != ' ')
      abort();
  size_t n = (size_t)json_object_object_length(h), k = 0;
  range_t *ranges = calloc(n + 1, sizeof *ranges);
  json_object_object_foreach(h, name, t) {
    if (strcmp(name, "__metadata__") == 0)
      continue;
    json_object *type, *shape, *offsets;
    if (!json_object_object_get_ex(t, "dtype", &type) ||
        strcmp(json_object_get_string(type), dtype) != 0 ||
        !json_object_object_get_ex(t, "shape", &shape) ||
        !json_object_is_type(shape, json_type_array) ||
        !json_object_object_get_ex(t, "data_offsets", &offsets) ||
        json_object_array_length(offsets) != 2)
      abort();
    uint64_t numel = elem;
    for (size_t d = 0; d < json_object_array_length(shape); d++) {
      json_object *dim = json_object_array_get_idx(shape, d);
      if (!json_object_is_type(dim, json_type_int) || json_object_get_int64(dim) < 0 ||
          __builtin_mul_overflow(numel, json_object_get_uint64(dim), &numel))
        abort();
    }
    range_t r = {json_object_get_uint64(json_object_array_get_idx(offsets, 0)),
                 json_object_get_uint64(json_object_array_get_idx(offsets, 1))};
    if (r.end < r.begin || r.end - r.begin != numel)
      abort(); /* the shape says other than the data */
    ranges[k++] = r;
  }
  qsort(ranges, k, sizeof *ranges, by_begin);
  uint64_t at = 0;
  for (size_t i = 0; i < k; i++) {
    if (ranges[i].begin != at)
      abort(); /* a gap or an overlap */
    at = ranges[i].end;
  }
  if (at != size - 8 - len)
    abort();
  free(ranges);
  json_tokener_free(tok);
  json_object_put(h);
  free(raw);
}

/* Whether dir holds anything but the step directory and out (a temporary file left). */
static int leftovers(const char *dir, const char *out_name) {
  DIR *d = opendir(dir);
  int n = 0;
  for (struct dirent *e; d && (e = readdir(d));)
    n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, "step-1") &&
         strcmp(e->d_name, out_name);
  if (d)
    closedir(d);
  return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static const char *const names[] = {"F32", "BF16", "F16"};
  const char *dir = fuzz_checkpoint(data, size);
  fsdp_dtype_t dtype = (fsdp_dtype_t)(size % 3);
  char out[160];
  snprintf(out, sizeof out, "%s/out.safetensors", fuzz_root);
  unlink(out);
  fsdp_status_t st = FSDP_STATUS_INIT;
  if (fsdp_export_safetensors(dir, out, dtype, &st) < 0) {
    if (st.code >= 0 || st.message[0] == '\0' || access(out, F_OK) == 0)
      abort(); /* a refusal says why and writes nothing */
  } else {
    check_safetensors(out, names[dtype], fsdp_dtype_size(dtype));
  }
  if (leftovers(fuzz_root, "out.safetensors"))
    abort();
  return 0;
}
