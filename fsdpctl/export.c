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
#include <sys/random.h>
#include <unistd.h>

#include <json-c/json.h>

#include "checkpoint/checkpoint.h"
#include "common/io.h"
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

static int write_failed(fsdp_status_t *st, const char *out, int err) {
  return fsdp_status_set(st, err == ENOSPC || err == EDQUOT ? FSDP_E_RESOURCE_EXHAUSTED : -err,
                         "export: writing %s: %s", out, strerror(err));
}

/* Each unit's parameters in dtype, written after the header, CHUNK_ELEMS at a time. */
static int write_data(fsdp_checkpoint_reader_t *r, int fd, fsdp_dtype_t dtype, const char *out,
                      fsdp_status_t *st) {
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
          int w = fsdp_write_all(fd, converted, n * size);
          if (w < 0)
            code = write_failed(st, out, -w);
        }
        done += n;
      }
    }
  }
  free(masters);
  free(converted);
  return code;
}

/* A new file in dirfd under an unpredictable name derived from name (*ret_tmp, size bytes),
 * made with O_EXCL|O_NOFOLLOW: nothing someone planted under a name the file could have
 * is written through. Returns the descriptor or -errno. */
static int create_temp(int dirfd, const char *name, char *ret_tmp, size_t size) {
  for (int tries = 0; tries < 16; tries++) {
    uint64_t nonce;
    if (getrandom(&nonce, sizeof nonce, 0) != (ssize_t)sizeof nonce)
      return -errno;
    snprintf(ret_tmp, size, ".%.200s.%016" PRIx64 ".tmp", name, nonce);
    int fd = openat(dirfd, ret_tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0 || errno != EEXIST)
      return fd >= 0 ? fd : -errno;
  }
  return -EEXIST;
}

/* The directory out lies in, open, and out's last component in *ret_name (in out). */
static int open_parent(const char *out, const char **ret_name, fsdp_status_t *st) {
  const char *slash = strrchr(out, '/'), *name = slash ? slash + 1 : out;
  char dir[PATH_MAX];
  if (!*name || strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "export: %s names no file", out);
  if (!slash)
    snprintf(dir, sizeof dir, ".");
  else if ((size_t)(slash - out) >= sizeof dir)
    return fsdp_status_set(st, -ENAMETOOLONG, "export: %s: name too long", out);
  else
    snprintf(dir, sizeof dir, "%.*s", slash == out ? 1 : (int)(slash - out), out);
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return fsdp_status_set(st, -errno, "export: opening %s: %s", dir, strerror(errno));
  *ret_name = name;
  return fd;
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
  const char *name = NULL;
  char tmp[NAME_MAX + 1];
  int dirfd = h ? open_parent(out, &name, st) : st->code, fd = -1;
  if (!h || dirfd < 0)
    code = st->code;
  else if ((fd = create_temp(dirfd, name, tmp, sizeof tmp)) < 0)
    code = fsdp_status_set(st, fd, "export: creating a file beside %s: %s", out, strerror(-fd));
  uint8_t prefix[8];
  for (int b = 0; b < 8; b++)
    prefix[b] = (uint8_t)((uint64_t)len >> (8 * b));
  int w;
  if (code == 0 &&
      ((w = fsdp_write_all(fd, prefix, 8)) < 0 || (w = fsdp_write_all(fd, h, len)) < 0))
    code = write_failed(st, out, -w);
  if (code == 0)
    code = write_data(r, fd, dtype, out, st);
  if (code == 0 && fsync(fd) < 0)
    code = write_failed(st, out, errno);
  if (fd >= 0)
    close(fd);
  /* A link or file at out is replaced, never written through. */
  if (code == 0 && renameat(dirfd, tmp, dirfd, name) < 0)
    code = fsdp_status_set(st, -errno, "export: renaming to %s: %s", out, strerror(errno));
  if (code == 0)
    fsync(dirfd); /* best effort: the file is complete either way */
  if (code < 0 && fd >= 0)
    unlinkat(dirfd, tmp, 0);
  if (dirfd >= 0)
    close(dirfd);
  free(h);
  fsdp_checkpoint_close(r);
  return code;
}
