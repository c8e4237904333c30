/* Safetensors (a little-endian u64 header length, a JSON header naming each tensor's dtype,
 * shape and [begin, end) in the data that follows, then the data) from a checkpoint. */
#include "fsdpctl/export.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <json-c/json.h>

#include "checkpoint/checkpoint.h"
#include "common/io.h"
#include "kernels/kernels.h"

static const char *const safetensors_dtype[FSDP_DTYPE_COUNT] = {"F32", "BF16", "F16"};

static uint64_t param_numel(const fsdp_checkpoint_param_t *p) {
  uint64_t n = 1;
  for (size_t d = 0; d < p->ndim; d++)
    n *= p->shape[d];
  return n;
}

/* The header: every parameter's entry, with offsets into the data in file order, and the
 * checkpoint's job and step as metadata. Padded with spaces to a multiple of 8 bytes, so that
 * the data that follows is aligned. */
static char *header(fsdp_checkpoint_reader_t *r, fsdp_dtype_t dtype, size_t *ret_len,
                    fsdp_status_t *st) {
  json_object *h = json_object_new_object(), *meta = json_object_new_object();
  char step[32];
  snprintf(step, sizeof step, "%" PRIu64, fsdp_checkpoint_step(r));
  json_object_object_add(meta, "format", json_object_new_string("pt"));
  json_object_object_add(meta, "job", json_object_new_string(fsdp_checkpoint_job(r)));
  json_object_object_add(meta, "step", json_object_new_string(step));
  json_object_object_add(h, "__metadata__", meta);
  size_t n_units;
  const fsdp_checkpoint_unit_t *units = fsdp_checkpoint_units(r, &n_units);
  uint64_t offset = 0, size = fsdp_dtype_size(dtype);
  for (size_t i = 0; i < n_units; i++) {
    for (size_t k = 0; k < units[i].n_params; k++) {
      const fsdp_checkpoint_param_t *p = &units[i].params[k];
      json_object *t = json_object_new_object(), *shape = json_object_new_array();
      json_object *range = json_object_new_array();
      for (size_t d = 0; d < p->ndim; d++)
        json_object_array_add(shape, json_object_new_uint64(p->shape[d]));
      uint64_t bytes = param_numel(p) * size;
      json_object_array_add(range, json_object_new_uint64(offset));
      json_object_array_add(range, json_object_new_uint64(offset + bytes));
      json_object_object_add(t, "dtype", json_object_new_string(safetensors_dtype[dtype]));
      json_object_object_add(t, "shape", shape);
      json_object_object_add(t, "data_offsets", range);
      json_object_object_add(h, p->name, t);
      offset += bytes;
    }
  }
  const char *text = json_object_to_json_string_ext(h, JSON_C_TO_STRING_PLAIN);
  size_t len = strlen(text), padded = (len + 7) / 8 * 8;
  char *out = malloc(padded);
  if (out) {
    memcpy(out, text, len);
    memset(out + len, ' ', padded - len);
    *ret_len = padded;
  } else {
    fsdp_status_set(st, -ENOMEM, "export: out of memory");
  }
  json_object_put(h);
  return out;
}

/* Each unit's parameters in dtype, written after the header. */
static int write_data(fsdp_checkpoint_reader_t *r, int fd, fsdp_dtype_t dtype, const char *out,
                      fsdp_status_t *st) {
  size_t n_units;
  const fsdp_checkpoint_unit_t *units = fsdp_checkpoint_units(r, &n_units);
  size_t size = fsdp_dtype_size(dtype);
  for (size_t i = 0; i < n_units; i++) {
    const fsdp_checkpoint_unit_t *u = &units[i];
    size_t n = (size_t)u->numel;
    float *masters = malloc((n ? n : 1) * sizeof *masters);
    void *converted = malloc((n ? n : 1) * size);
    int code = masters && converted ? 0 : fsdp_status_set(st, -ENOMEM, "export: out of memory");
    if (code == 0) /* the unit's elements, from whichever hosts hold them */
      code = fsdp_checkpoint_read_elements(r, i, 0, 0, n, masters, st);
    for (size_t k = 0; code == 0 && k < u->n_params; k++) {
      const fsdp_checkpoint_param_t *p = &u->params[k];
      uint64_t numel = param_numel(p);
      if (p->offset > n || numel > n - p->offset) {
        code = fsdp_status_set(st, FSDP_E_DATA_LOSS,
                               "export: parameter '%s' of unit '%s' lies past its %zu elements",
                               p->name, u->name, n);
        break;
      }
      fsdp_cast(converted, dtype, masters + p->offset, FSDP_DTYPE_FP32, (size_t)numel);
      int w = fsdp_write_all(fd, converted, (size_t)numel * size);
      if (w < 0)
        code = fsdp_status_set(st, w == -ENOSPC ? FSDP_E_RESOURCE_EXHAUSTED : w,
                               "export: writing %s: %s", out, strerror(-w));
    }
    free(masters);
    free(converted);
    if (code < 0)
      return code;
  }
  return 0;
}

int fsdp_export_safetensors(const char *dir, const char *out, fsdp_dtype_t dtype,
                            fsdp_status_t *st) {
  fsdp_checkpoint_reader_t *r;
  int code = fsdp_checkpoint_open(dir, &r, st);
  if (code < 0)
    return code;
  char tmp[PATH_MAX];
  size_t len = 0;
  char *h = NULL;
  int fd = -1;
  if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp", out) >= sizeof tmp)
    code = fsdp_status_set(st, -ENAMETOOLONG, "export: %s: name too long", out);
  if (code == 0 && !(h = header(r, dtype, &len, st)))
    code = st->code;
  if (code == 0 && (fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0)
    code = fsdp_status_set(st, -errno, "export: creating %s: %s", tmp, strerror(errno));
  uint8_t prefix[8];
  for (int b = 0; b < 8; b++)
    prefix[b] = (uint8_t)((uint64_t)len >> (8 * b));
  int w;
  if (code == 0 && ((w = fsdp_write_all(fd, prefix, 8)) < 0 || (w = fsdp_write_all(fd, h, len)) < 0))
    code = fsdp_status_set(st, w == -ENOSPC ? FSDP_E_RESOURCE_EXHAUSTED : w,
                           "export: writing %s: %s", tmp, strerror(-w));
  if (code == 0)
    code = write_data(r, fd, dtype, tmp, st);
  if (code == 0 && fsync(fd) < 0)
    code = fsdp_status_set(st, -errno, "export: syncing %s: %s", tmp, strerror(errno));
  if (fd >= 0)
    close(fd);
  if (code == 0 && rename(tmp, out) < 0)
    code = fsdp_status_set(st, -errno, "export: renaming %s to %s: %s", tmp, out,
                           strerror(errno));
  if (code < 0 && fd >= 0)
    unlink(tmp);
  free(h);
  fsdp_checkpoint_close(r);
  return code;
}
