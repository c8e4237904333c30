/* Safetensors (a little-endian u64 header length, a JSON header naming each tensor's dtype,
 * shape and [begin, end) in the data that follows, then the data) from a checkpoint. */
#include "fsdpctl/export.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <json-c/json.h>

#include "checkpoint/checkpoint.h"
#include "common/io.h"
#include "fsdpctl/out_file.h"
#include "kernels/kernels.h"

static const char *const safetensors_dtype[FSDP_DTYPE_COUNT] = {"F32", "BF16", "F16"};

/* Elements a parameter's data is read and written by, whatever its size. */
#define CHUNK_ELEMS ((size_t)1 << 20)

/* A parameter's elements (the product of its shape) and its bytes in dtype: DATA_LOSS where
 * either overflows (the reader bounds them; the header must say what is written). */
static int param_size(const fsdp_checkpoint_unit_t *u, const fsdp_checkpoint_param_t *p,
                      size_t elem_size, uint64_t *ret_numel, uint64_t *ret_bytes,
                      fsdp_status_t *st) {
  uint64_t n = 1;
  for (size_t d = 0; d < p->ndim; d++)
    if (__builtin_mul_overflow(n, p->shape[d], &n))
      return fsdp_status_set(st, FSDP_E_DATA_LOSS,
                             "export: parameter '%s' of unit '%s': its shape's product overflows",
                             p->name, u->name);
  if (__builtin_mul_overflow(n, (uint64_t)elem_size, ret_bytes))
    return fsdp_status_set(st, FSDP_E_DATA_LOSS,
                           "export: parameter '%s' of unit '%s': its %" PRIu64 " elements "
                           "overflow a byte count", p->name, u->name, n);
  *ret_numel = n;
  return 0;
}

/* The header: every parameter's entry, with offsets into the data in file order, and the
 * checkpoint's job and step as metadata. Padded with spaces to a multiple of 8 bytes, so that
 * the data that follows is aligned. Each entry's shape is the one whose product write_data
 * writes, its range that many elements' bytes; a name twice (or "__metadata__") is refused,
 * since the header would then name fewer tensors than the data holds. */
static char *header(fsdp_checkpoint_reader_t *r, fsdp_dtype_t dtype, size_t *ret_len,
                    fsdp_status_t *st) {
  json_object *h = json_object_new_object(), *meta = json_object_new_object();
  if (!h || !meta) {
    json_object_put(h);
    json_object_put(meta);
    fsdp_status_set(st, -ENOMEM, "export: out of memory");
    return NULL;
  }
  char step[32];
  snprintf(step, sizeof step, "%" PRIu64, fsdp_checkpoint_step(r));
  json_object_object_add(meta, "format", json_object_new_string("pt"));
  json_object_object_add(meta, "job", json_object_new_string(fsdp_checkpoint_job(r)));
  json_object_object_add(meta, "step", json_object_new_string(step));
  json_object_object_add(h, "__metadata__", meta);
  size_t n_units;
  const fsdp_checkpoint_unit_t *units = fsdp_checkpoint_units(r, &n_units);
  uint64_t offset = 0;
  int code = 0;
  for (size_t i = 0; code == 0 && i < n_units; i++) {
    for (size_t k = 0; code == 0 && k < units[i].n_params; k++) {
      const fsdp_checkpoint_param_t *p = &units[i].params[k];
      uint64_t numel = 0, bytes = 0, end = 0;
      if ((code = param_size(&units[i], p, fsdp_dtype_size(dtype), &numel, &bytes, st)) < 0)
        break;
      if (json_object_object_get_ex(h, p->name, NULL)) {
        code = fsdp_status_set(st, FSDP_E_DATA_LOSS,
                               "export: parameter '%s' of unit '%s': the checkpoint names "
                               "another tensor so", p->name, units[i].name);
        break;
      }
      if (__builtin_add_overflow(offset, bytes, &end)) {
        code = fsdp_status_set(st, FSDP_E_DATA_LOSS,
                               "export: parameter '%s' of unit '%s': the data's end overflows",
                               p->name, units[i].name);
        break;
      }
      json_object *t = json_object_new_object(), *shape = json_object_new_array();
      json_object *range = json_object_new_array();
      for (size_t d = 0; d < p->ndim; d++)
        json_object_array_add(shape, json_object_new_uint64(p->shape[d]));
      json_object_array_add(range, json_object_new_uint64(offset));
      json_object_array_add(range, json_object_new_uint64(end));
      json_object_object_add(t, "dtype", json_object_new_string(safetensors_dtype[dtype]));
      json_object_object_add(t, "shape", shape);
      json_object_object_add(t, "data_offsets", range);
      json_object_object_add(h, p->name, t);
      offset = end;
    }
  }
  char *out = NULL;
  if (code == 0) {
    const char *text = json_object_to_json_string_ext(h, JSON_C_TO_STRING_PLAIN);
    size_t len = text ? strlen(text) : 0, padded = (len + 7) / 8 * 8;
    if (text && (out = malloc(padded))) {
      memcpy(out, text, len);
      memset(out + len, ' ', padded - len);
      *ret_len = padded;
    } else {
      fsdp_status_set(st, -ENOMEM, "export: out of memory");
    }
  }
  json_object_put(h);
  return out;
}

/* Each unit's parameters in dtype, written after the header, CHUNK_ELEMS at a time. */
static int write_data(fsdp_checkpoint_reader_t *r, const fsdpctl_out_file_t *f,
                      fsdp_dtype_t dtype, fsdp_status_t *st) {
  size_t n_units;
  const fsdp_checkpoint_unit_t *units = fsdp_checkpoint_units(r, &n_units);
  size_t size = fsdp_dtype_size(dtype);
  float *masters = malloc(CHUNK_ELEMS * sizeof *masters);
  void *converted = malloc(CHUNK_ELEMS * size);
  int code = masters && converted ? 0 : fsdp_status_set(st, -ENOMEM, "export: out of memory");
  for (size_t i = 0; code == 0 && i < n_units; i++) {
    const fsdp_checkpoint_unit_t *u = &units[i];
    for (size_t k = 0; code == 0 && k < u->n_params; k++) {
      const fsdp_checkpoint_param_t *p = &u->params[k];
      uint64_t numel = 0, bytes = 0;
      if ((code = param_size(u, p, size, &numel, &bytes, st)) < 0)
        break;
      if (p->offset > u->numel || numel > u->numel - p->offset) {
        code = fsdp_status_set(st, FSDP_E_DATA_LOSS,
                               "export: parameter '%s' of unit '%s' lies past its %" PRIu64
                               " elements", p->name, u->name, u->numel);
        break;
      }
      /* The unit's elements, from whichever hosts hold them. */
      for (uint64_t done = 0; code == 0 && done < numel;) {
        size_t n = numel - done < CHUNK_ELEMS ? (size_t)(numel - done) : CHUNK_ELEMS;
        code = fsdp_checkpoint_read_elements(r, i, 0, p->offset + done, n, masters, st);
        if (code == 0) {
          fsdp_cast(converted, dtype, masters, FSDP_DTYPE_FP32, n);
          int w = fsdp_write_all(f->fd, converted, n * size);
          if (w < 0)
            code = fsdpctl_out_file_write_failed(f, -w, st);
        }
        done += n;
      }
    }
  }
  free(masters);
  free(converted);
  return code;
}

int fsdp_export_safetensors(const char *dir, const char *out, fsdp_dtype_t dtype,
                            fsdp_status_t *st) {
  /* The reader follows no link, the operator's own path to the checkpoint aside. */
  char real[PATH_MAX];
  if (!realpath(dir, real))
    return fsdp_status_set(st, errno == ENOENT ? FSDP_E_NOT_FOUND : -errno,
                           "export: %s: %s", dir, strerror(errno));
  fsdp_checkpoint_reader_t *r;
  int code = fsdp_checkpoint_open(real, NULL, &r, st);
  if (code < 0)
    return code;
  size_t len = 0;
  char *h = header(r, dtype, &len, st);
  fsdpctl_out_file_t f;
  if (!h || fsdpctl_out_file_open(&f, out, "export", st) < 0) {
    free(h);
    fsdp_checkpoint_close(r);
    return st->code;
  }
  uint8_t prefix[8];
  for (int b = 0; b < 8; b++)
    prefix[b] = (uint8_t)((uint64_t)len >> (8 * b));
  int w;
  if ((w = fsdp_write_all(f.fd, prefix, 8)) < 0 || (w = fsdp_write_all(f.fd, h, len)) < 0)
    code = fsdpctl_out_file_write_failed(&f, -w, st);
  if (code == 0)
    code = write_data(r, &f, dtype, st);
  code = fsdpctl_out_file_end(&f, code, st);
  free(h);
  fsdp_checkpoint_close(r);
  return code;
}
