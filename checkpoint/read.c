/* Reading checkpoints (checkpoint/checkpoint.h): the metadata by json-c, every value checked
 * for its type and every size against the layout it describes before anything is sized by
 * it, each block checked against its XXH64 the first time a read touches it. Files are
 * opened through the step directory's descriptor, never following a link and never
 * anything but a regular file (common/dirs.h): a checkpoint someone else wrote is data to
 * check, and what it holds is refused with DATA_LOSS naming the file and the key. */
#include "checkpoint/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <json-c/json.h>
#include <xxhash.h>

#include "checkpoint/files.h"
#include "common/dirs.h"

/* What a save can have written: the daemon's limits on a unit it registers (proto/limits.h,
 * which this layer does not include). Nothing a file says makes a reader allocate or count
 * past them. */
#define NAME_MAX_BYTES 256
#define UNIT_PARAMS_MAX 65536
#define PARAM_DIMS_MAX 64
#define UNIT_NUMEL_MAX ((uint64_t)1 << 40)

typedef struct block_meta {
  uint64_t offset, bytes, xxh64;
} block_meta_t;

/* What one host's file says of one unit: the elements [first, end) of the unit's flat
 * buffer that its blocks hold, and where each block lies in its .bin. */
typedef struct piece {
  size_t unit; /* the reader's index */
  unsigned host;
  uint64_t first, end;
  block_meta_t blocks[1 + FSDP_CHECKPOINT_ARRAYS_MAX];
  bool checked[1 + FSDP_CHECKPOINT_ARRAYS_MAX]; /* against its checksum, once */
} piece_t;

struct fsdp_checkpoint_reader {
  char path[PATH_MAX]; /* the step directory, for messages and callers */
  int step_fd;
  manifest_t manifest;
  unsigned hosts;
  int *bin_fds;         /* host h's .bin */
  uint64_t *bin_bytes;  /* its size when opened */
  json_object *host0;   /* the units' and parameters' names point into it */
  json_object *by_name; /* each unit's index, by its name */
  fsdp_checkpoint_unit_t *units; /* host 0's, which name the units and their parameters */
  uint64_t *optimizer_steps;
  size_t n_units;
  fsdp_checkpoint_param_t *params;
  uint64_t *shapes;
  /* Every host's pieces, by unit and then first element once all are read: unit i's are
   * [unit_pieces[i], unit_pieces[i + 1]). Proportional to what the files list, whatever the
   * number of hosts. */
  piece_t *pieces;
  size_t n_pieces, pieces_cap;
  size_t *unit_pieces;
  const atomic_int *stopping; /* a load's job's: a stop abandons the reads */
  void *buf;                  /* IO_CHUNK, for checking a block */
};

/* A host file of the reader's, and the unit being read from it, for messages. */
typedef struct meta_file {
  fsdp_checkpoint_reader_t *r;
  unsigned host;
  char name[32];  /* "host-<h>.json" */
  char unit[NAME_MAX_BYTES + 32]; /* "unit 'name': ", "units[3]: " or "" */
  fsdp_status_t *st;
} meta_file_t;

/* DATA_LOSS naming the file, the unit and what is wrong. */
__attribute__((format(printf, 2, 3))) static int bad(const meta_file_t *f, const char *fmt,
                                                     ...) {
  char what[FSDP_STATUS_MESSAGE_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  return fsdp_status_set(f->st, FSDP_E_DATA_LOSS, "checkpoint %s/%s: %s%s", f->r->path, f->name,
                         f->unit, what);
}

static int bad_key(const meta_file_t *f, const char *key, const char *expected) {
  return bad(f, "key '%s' is missing or not %s", key, expected);
}

/* A name (of a unit, a parameter): a string of 1 to NAME_MAX_BYTES bytes with no NUL. */
static const char *name_at(json_object *o, const char *key) {
  const char *s = json_string_at(o, key);
  json_object *v;
  if (!s || !json_object_object_get_ex(o, key, &v))
    return NULL;
  size_t len = strlen(s);
  return len > 0 && len <= NAME_MAX_BYTES && (int)len == json_object_get_string_len(v) ? s
                                                                                       : NULL;
}

static bool u64_at_most(json_object *o, const char *key, uint64_t max, uint64_t *ret) {
  uint64_t v;
  if (!json_u64_at(o, key, &v) || v > max)
    return false;
  *ret = v;
  return true;
}

/* A non-negative integer up to INT64_MAX as an array's member (a dimension). */
static bool dim_at(json_object *a, size_t i, uint64_t *ret) {
  json_object *v = json_object_array_get_idx(a, i);
  if (!json_object_is_type(v, json_type_int) || json_object_get_int64(v) < 0)
    return false;
  uint64_t d = json_object_get_uint64(v);
  if (d > INT64_MAX)
    return false;
  *ret = d;
  return true;
}

/* ---- Opening ---- */

/* The directory that dir names: dir itself when it holds a manifest, else the newest
 * complete checkpoint of job's (NULL: of any job) under it, open at r->step_fd. */
static int open_step_dir(fsdp_checkpoint_reader_t *r, const char *dir, const char *job,
                         fsdp_status_t *st) {
  int fd = fsdp_dir_open(dir, false, 0);
  if (fd == -ENOENT)
    return fsdp_status_set(st, FSDP_E_NOT_FOUND, "checkpoint: no directory %s", dir);
  if (fd == -EINVAL)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "checkpoint: %s is not an absolute path without '..'", dir);
  if (fd < 0)
    return io_failed(st, "opening", dir, -fd);
  struct stat s;
  if (fstatat(fd, MANIFEST, &s, AT_SYMLINK_NOFOLLOW) == 0) { /* read_manifest checks it */
    r->step_fd = fd;
    return join(r->path, sizeof r->path, dir, "", "") ? 0
                                                      : io_failed(st, "naming", dir,
                                                                  ENAMETOOLONG);
  }
  uint64_t step = 0;
  bool found = newest_step(fd, job, &step);
  char name[32];
  snprintf(name, sizeof name, "step-%" PRIu64, step);
  r->step_fd = found ? fsdp_dir_open_at(fd, name, false, 0, NULL) : -1;
  close(fd);
  if (!found)
    return fsdp_status_set(st, FSDP_E_NOT_FOUND,
                           "checkpoint: no complete checkpoint%s%s%s (step-N/ with a manifest) "
                           "in %s",
                           job ? " of job '" : "", job ? job : "", job ? "'" : "", dir);
  if (!join(r->path, sizeof r->path, dir, "/", name))
    return io_failed(st, "naming", dir, ENAMETOOLONG);
  return r->step_fd < 0 ? io_failed(st, "opening", r->path, -r->step_fd) : 0;
}

void fsdp_checkpoint_close(fsdp_checkpoint_reader_t *r) {
  if (!r)
    return;
  for (unsigned h = 0; r->bin_fds && h < r->hosts; h++)
    if (r->bin_fds[h] >= 0)
      close(r->bin_fds[h]);
  if (r->step_fd >= 0)
    close(r->step_fd);
  free(r->bin_fds);
  free(r->bin_bytes);
  json_object_put(r->host0);
  json_object_put(r->by_name);
  free(r->units);
  free(r->optimizer_steps);
  free(r->params);
  free(r->shapes);
  free(r->pieces);
  free(r->unit_pieces);
  free(r->buf);
  free(r);
}

/* Host h's .bin as messages name it: "<step directory>/host-<h>.bin". */
static void bin_path(const fsdp_checkpoint_reader_t *r, unsigned h, char *buf, size_t size) {
  snprintf(buf, size, "%s/host-%u.bin", r->path, h);
}

/* Host h's .bin, open, and its size. */
static int open_bin(fsdp_checkpoint_reader_t *r, unsigned h, fsdp_status_t *st) {
  char name[32], path[PATH_MAX + 32];
  host_file(name, sizeof name, h, "bin");
  bin_path(r, h, path, sizeof path);
  int fd = fsdp_file_open_at(r->step_fd, name, O_RDONLY, 0);
  if (fd == -ENOENT || fd == -ELOOP || fd == -FSDP_ENOTREG)
    return fsdp_status_set(st, FSDP_E_DATA_LOSS, "checkpoint %s is %s", path,
                           fd == -ENOENT ? "missing" : fsdp_dirs_strerror(-fd));
  if (fd < 0)
    return io_failed(st, "opening", path, -fd);
  r->bin_fds[h] = fd;
  struct stat s;
  if (fstat(fd, &s) < 0)
    return io_failed(st, "reading", path, errno);
  r->bin_bytes[h] = (uint64_t)s.st_size;
  return 0;
}

/* The parameters of host 0's unit m (u: its layout), each checked: count and dimensions
 * within the daemon's limits, every value of its type, its elements within the unit's. Their
 * numbers of parameters and dimensions are added to *n_params and *n_dims. */
static int check_params(const meta_file_t *f, json_object *m, const fsdp_checkpoint_unit_t *u,
                        size_t *n_params, size_t *n_dims) {
  json_object *params = json_array_at(m, "params");
  if (!params)
    return bad_key(f, "params", "an array");
  size_t n = json_object_array_length(params);
  if (n > UNIT_PARAMS_MAX)
    return bad(f, "'params' lists %zu parameters, more than the %d a unit may have", n,
               UNIT_PARAMS_MAX);
  for (size_t k = 0; k < n; k++) {
    json_object *p = json_object_array_get_idx(params, k);
    const char *name = name_at(p, "name");
    if (!json_object_is_type(p, json_type_object))
      return bad(f, "params[%zu] is not an object", k);
    if (!name)
      return bad(f, "params[%zu]: key 'name' is missing or not a name of 1 to %d bytes", k,
                 NAME_MAX_BYTES);
    json_object *shape = json_array_at(p, "shape");
    size_t ndim = shape ? json_object_array_length(shape) : 0;
    uint64_t offset, nonzero = 1;
    bool empty = false;
    if (!shape || ndim > PARAM_DIMS_MAX)
      return bad(f, "parameter '%s': key 'shape' is missing or not an array of at most %d "
                 "dimensions", name, PARAM_DIMS_MAX);
    /* As the daemon registers them: the nonzero dimensions' product within a unit's limit,
     * so that a zero hides no dimension no tensor could have ([2^63, 0]). */
    for (size_t d = 0; d < ndim; d++) {
      uint64_t dim;
      if (!dim_at(shape, d, &dim))
        return bad(f, "parameter '%s': 'shape'[%zu] is not an integer in [0, 2^63)", name, d);
      empty |= dim == 0;
      if (dim && (__builtin_mul_overflow(nonzero, dim, &nonzero) || nonzero > UNIT_NUMEL_MAX))
        return bad(f, "parameter '%s': the product of the nonzero dimensions of 'shape' is "
                   "past the %" PRIu64 " elements a unit may have", name, UNIT_NUMEL_MAX);
    }
    uint64_t numel = empty ? 0 : nonzero;
    if (!json_u64_at(p, "offset", &offset))
      return bad(f, "parameter '%s': key 'offset' is missing or not a non-negative integer",
                 name);
    if (!json_string_at(p, "dtype"))
      return bad(f, "parameter '%s': key 'dtype' is missing or not a string", name);
    if (offset > u->numel || numel > u->numel - offset)
      return bad(f, "parameter '%s': its elements [%" PRIu64 ", %" PRIu64 " + %" PRIu64 ") "
                 "('offset', the product of 'shape') lie past the unit's %" PRIu64 " ('numel')",
                 name, offset, offset, numel, u->numel);
    *n_dims += ndim;
  }
  *n_params += n;
  return 0;
}

/* Points host 0's units at their parameters (all checked by check_params). */
static int fill_params(fsdp_checkpoint_reader_t *r, json_object *units, size_t n_params,
                       size_t n_dims, fsdp_status_t *st) {
  r->params = calloc(n_params + 1, sizeof *r->params);
  r->shapes = calloc(n_dims + 1, sizeof *r->shapes);
  if (!r->params || !r->shapes)
    return fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  fsdp_checkpoint_param_t *p = r->params;
  uint64_t *dims = r->shapes;
  for (size_t i = 0; i < r->n_units; i++) {
    json_object *params = json_array_at(json_object_array_get_idx(units, i), "params");
    fsdp_checkpoint_unit_t *u = &r->units[i];
    u->params = p;
    u->n_params = json_object_array_length(params);
    for (size_t k = 0; k < u->n_params; k++, p++) {
      json_object *pm = json_object_array_get_idx(params, k);
      json_object *shape = json_array_at(pm, "shape");
      *p = (fsdp_checkpoint_param_t){.name = json_string_at(pm, "name"),
                                     .shape = dims,
                                     .ndim = json_object_array_length(shape),
                                     .dtype = json_string_at(pm, "dtype")};
      json_u64_at(pm, "offset", &p->offset);
      for (size_t d = 0; d < p->ndim; d++)
        dim_at(shape, d, dims++);
    }
  }
  return 0;
}

/* Unit m (f->unit names it) of host f->host's file, of the .bin of bin_bytes: its layout in
 * *u (and, host 0's, its optimizer step count) and its blocks in *piece, every value of its
 * type and every size within the layout and the file. */
static int parse_unit(const meta_file_t *f, json_object *m, uint64_t bin_bytes,
                      fsdp_checkpoint_unit_t *u, uint64_t *ret_steps, piece_t *piece) {
  static const char *const u64_keys[] = {"numel", "padded_numel", "shard_numel", "shards",
                                         "host_first_shard", "host_shards", "optimizer_steps"};
  uint64_t v[7];
  for (size_t i = 0; i < 7; i++) {
    uint64_t max = i >= 3 && i <= 5 ? UINT32_MAX : i == 0 ? UNIT_NUMEL_MAX : UINT64_MAX;
    if (!u64_at_most(m, u64_keys[i], max, &v[i]))
      return bad(f, "key '%s' is missing or not an integer in [0, %" PRIu64 "]", u64_keys[i],
                 max);
  }
  const char *strategy = json_string_at(m, "strategy");
  json_object *blocks = json_array_at(m, "blocks");
  size_t n_blocks_meta = blocks ? json_object_array_length(blocks) : 0;
  if (!strategy)
    return bad_key(f, "strategy", "a string");
  if (n_blocks_meta < 1 || n_blocks_meta > 1 + FSDP_CHECKPOINT_ARRAYS_MAX)
    return bad(f, "key 'blocks' is missing or not an array of 1 to %d blocks",
               1 + FSDP_CHECKPOINT_ARRAYS_MAX);
  *u = (fsdp_checkpoint_unit_t){.name = name_at(m, "name"),
                                .strategy = strategy,
                                .numel = v[0],
                                .padded_numel = v[1],
                                .shard_numel = v[2],
                                .shards = (uint32_t)v[3],
                                .host_first_shard = (uint32_t)v[4],
                                .host_shards = (uint32_t)v[5],
                                .arrays = (unsigned)n_blocks_meta - 1};
  *ret_steps = v[6];
  uint64_t padded, held, bytes;
  if (__builtin_mul_overflow(v[3], v[2], &padded) || padded != u->padded_numel ||
      u->numel > u->padded_numel)
    return bad(f, "'shards' x 'shard_numel' (%" PRIu64 " x %" PRIu64 ") is not 'padded_numel' "
               "(%" PRIu64 "), or that is less than 'numel' (%" PRIu64 ")",
               v[3], v[2], u->padded_numel, u->numel);
  if (v[4] + v[5] > v[3])
    return bad(f, "'host_first_shard' + 'host_shards' (%" PRIu64 " + %" PRIu64 ") is past "
               "'shards' (%" PRIu64 ")", v[4], v[5], v[3]);
  held = v[5] * v[2]; /* at most padded_numel */
  if (__builtin_mul_overflow(held, (uint64_t)sizeof(float), &bytes))
    return bad(f, "its %" PRIu64 " elements overflow a byte count", held);
  piece->first = v[4] * v[2];
  piece->end = piece->first + held;
  for (unsigned b = 0; b < n_blocks_meta; b++) {
    json_object *o = json_object_array_get_idx(blocks, b);
    block_meta_t *k = &piece->blocks[b];
    uint64_t end;
    if (!json_object_is_type(o, json_type_object) || !json_u64_at(o, "offset", &k->offset) ||
        !json_u64_at(o, "bytes", &k->bytes) || !json_u64_at(o, "xxh64", &k->xxh64))
      return bad(f, "blocks[%u] is not an object of non-negative integers 'offset', 'bytes' "
                 "and 'xxh64'", b);
    if (k->bytes != bytes)
      return bad(f, "blocks[%u] (%s): 'bytes' is %" PRIu64 ", expected %" PRIu64 " (%" PRIu64
                 " elements)", b, block_name(b), k->bytes, bytes, held);
    if (__builtin_add_overflow(k->offset, k->bytes, &end) || end > bin_bytes)
      return bad(f, "blocks[%u] (%s): 'offset' + 'bytes' (%" PRIu64 " + %" PRIu64 ") is past "
                 "the end of host-%u.bin (%" PRIu64 " bytes)", b, block_name(b), k->offset,
                 k->bytes, f->host, bin_bytes);
  }
  return 0;
}

static int add_piece(fsdp_checkpoint_reader_t *r, const piece_t *p, fsdp_status_t *st) {
  if (r->n_pieces == r->pieces_cap) {
    size_t cap = r->pieces_cap ? 2 * r->pieces_cap : 16;
    piece_t *grown = realloc(r->pieces, cap * sizeof *grown);
    if (!grown)
      return fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
    r->pieces = grown;
    r->pieces_cap = cap;
  }
  r->pieces[r->n_pieces++] = *p;
  return 0;
}

/* Host 0's units: the reader's, indexed by name. */
static int start_units(fsdp_checkpoint_reader_t *r, size_t n, fsdp_status_t *st) {
  r->n_units = n;
  r->units = calloc(n + 1, sizeof *r->units);
  r->optimizer_steps = calloc(n + 1, sizeof *r->optimizer_steps);
  r->by_name = json_object_new_object();
  if (!r->units || !r->optimizer_steps || !r->by_name)
    return fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  return 0;
}

/* Host h's file: its units' layouts and blocks, host 0's with their parameters. Every host
 * lists a unit at most once, of the numel and optimizer arrays host 0 gives it; a unit host
 * 0 does not list is not the checkpoint's. */
static int read_host(fsdp_checkpoint_reader_t *r, unsigned h, fsdp_status_t *st) {
  meta_file_t f = {.r = r, .host = h, .st = st};
  host_file(f.name, sizeof f.name, h, "json");
  int code = 0;
  json_object *meta = read_json_at(r->step_fd, r->path, f.name, HOST_META_MAX, st, &code);
  if (!meta)
    return code == FSDP_E_NOT_FOUND
               ? fsdp_status_set(st, FSDP_E_DATA_LOSS, "checkpoint %s/%s is missing (the "
                                 "manifest names %u hosts)", r->path, f.name, r->hosts)
               : code;
  if (h == 0)
    r->host0 = meta;
  uint64_t host, hosts;
  json_object *units = json_array_at(meta, "units");
  size_t n = units ? json_object_array_length(units) : 0, n_params = 0, n_dims = 0;
  bool *seen = NULL;
  if (!json_u64_at(meta, "host", &host))
    code = bad_key(&f, "host", "a non-negative integer");
  else if (!json_u64_at(meta, "hosts", &hosts))
    code = bad_key(&f, "hosts", "a non-negative integer");
  else if (host != h || hosts != r->hosts)
    code = bad(&f, "it is host %" PRIu64 " of %" PRIu64 " ('host', 'hosts'), expected %u of %u",
               host, hosts, h, r->hosts);
  else if (!units)
    code = bad_key(&f, "units", "an array");
  else if (h == 0)
    code = start_units(r, n, st);
  if (code == 0 && (code = open_bin(r, h, st)) == 0 &&
      !(seen = calloc(r->n_units + 1, sizeof *seen)))
    code = fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  for (size_t k = 0; code == 0 && k < n; k++) {
    json_object *m = json_object_array_get_idx(units, k), *index;
    const char *name = name_at(m, "name");
    snprintf(f.unit, sizeof f.unit, "units[%zu]: ", k);
    if (!json_object_is_type(m, json_type_object)) {
      code = bad(&f, "not an object");
      break;
    }
    if (!name) {
      code = bad_key(&f, "name", "a name of 1 to 256 bytes");
      break;
    }
    snprintf(f.unit, sizeof f.unit, "unit '%s': ", name);
    size_t i = k;
    if (h == 0 && json_object_object_get_ex(r->by_name, name, NULL)) {
      code = bad(&f, "listed twice");
      break;
    }
    if (h == 0)
      json_object_object_add(r->by_name, name, json_object_new_int64((int64_t)k));
    else if (json_object_object_get_ex(r->by_name, name, &index))
      i = (size_t)json_object_get_int64(index);
    else
      i = SIZE_MAX; /* not a unit of the checkpoint's: checked, then left */
    fsdp_checkpoint_unit_t layout, *u = h == 0 ? &r->units[i] : &layout;
    uint64_t steps = 0;
    piece_t piece = {.unit = i, .host = h};
    if ((code = parse_unit(&f, m, r->bin_bytes[h], u, &steps, &piece)) < 0)
      break;
    if (i == SIZE_MAX)
      continue;
    if (seen[i]) {
      code = bad(&f, "listed twice");
      break;
    }
    seen[i] = true;
    if (h == 0) {
      r->optimizer_steps[i] = steps;
      code = check_params(&f, m, u, &n_params, &n_dims);
    } else if (u->numel != r->units[i].numel || u->arrays != r->units[i].arrays) {
      code = bad(&f, "it has %" PRIu64 " elements ('numel') and %u optimizer arrays "
                 "('blocks'), host-0.json %" PRIu64 " and %u", u->numel, u->arrays,
                 r->units[i].numel, r->units[i].arrays);
    }
    if (code == 0 && u->host_shards)
      code = add_piece(r, &piece, st);
  }
  free(seen);
  if (code == 0 && h == 0)
    code = fill_params(r, units, n_params, n_dims, st);
  if (h > 0)
    json_object_put(meta);
  return code;
}

static int by_unit_and_first(const void *a, const void *b) {
  const piece_t *x = a, *y = b;
  if (x->unit != y->unit)
    return x->unit < y->unit ? -1 : 1;
  return x->first < y->first ? -1 : x->first > y->first ? 1 : 0;
}

/* Sorts the pieces by unit and first element and checks that each unit's elements are all
 * in some host's file: what the units' numel claim is held, so no one sizes anything by a
 * numel the files do not back. */
static int index_pieces(fsdp_checkpoint_reader_t *r, fsdp_status_t *st) {
  if (r->n_pieces)
    qsort(r->pieces, r->n_pieces, sizeof *r->pieces, by_unit_and_first);
  if (!(r->unit_pieces = calloc(r->n_units + 1, sizeof *r->unit_pieces)))
    return fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  size_t k = 0;
  for (size_t i = 0; i < r->n_units; i++) {
    r->unit_pieces[i] = k;
    uint64_t held = 0; /* elements [0, held) are in some file */
    for (; k < r->n_pieces && r->pieces[k].unit == i; k++)
      if (r->pieces[k].first <= held && r->pieces[k].end > held)
        held = r->pieces[k].end;
    if (held < r->units[i].numel)
      return fsdp_status_set(st, FSDP_E_DATA_LOSS,
                             "checkpoint %s: no host's file holds element %" PRIu64 " of unit "
                             "'%s' (its 'numel' is %" PRIu64 ")",
                             r->path, held, r->units[i].name, r->units[i].numel);
  }
  r->unit_pieces[r->n_units] = k;
  return 0;
}

int fsdp_checkpoint_open(const char *dir, const char *job, fsdp_checkpoint_reader_t **ret,
                         fsdp_status_t *st) {
  fsdp_checkpoint_reader_t *r = calloc(1, sizeof *r);
  if (!r)
    return fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  r->step_fd = -1;
  int code = open_step_dir(r, dir, job, st);
  if (code == 0)
    code = read_manifest(r->step_fd, r->path, &r->manifest, st);
  if (code == 0 && r->manifest.format != FSDP_CHECKPOINT_FORMAT)
    code = fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "checkpoint %s is of format %" PRIu64 ", this fsdpd reads %d",
                           r->path, r->manifest.format, FSDP_CHECKPOINT_FORMAT);
  else if (code == 0 && (r->manifest.hosts == 0 || r->manifest.hosts > FSDP_CHECKPOINT_HOSTS_MAX))
    code = fsdp_status_set(st, FSDP_E_DATA_LOSS,
                           "checkpoint %s/" MANIFEST ": key 'hosts' is %" PRIu64 ", not 1 to %d",
                           r->path, r->manifest.hosts, FSDP_CHECKPOINT_HOSTS_MAX);
  if (code == 0) {
    r->hosts = (unsigned)r->manifest.hosts;
    r->bin_fds = malloc(r->hosts * sizeof *r->bin_fds);
    r->bin_bytes = calloc(r->hosts, sizeof *r->bin_bytes);
    r->buf = malloc(IO_CHUNK);
    if (!r->bin_fds || !r->bin_bytes || !r->buf)
      code = fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
    for (unsigned h = 0; r->bin_fds && h < r->hosts; h++)
      r->bin_fds[h] = -1;
  }
  for (unsigned h = 0; code == 0 && h < r->hosts; h++)
    code = read_host(r, h, st);
  if (code == 0)
    code = index_pieces(r, st);
  if (code < 0) {
    fsdp_checkpoint_close(r);
    return code;
  }
  *ret = r;
  return 0;
}

const char *fsdp_checkpoint_path(const fsdp_checkpoint_reader_t *r) {
  return r->path;
}

const char *fsdp_checkpoint_job(const fsdp_checkpoint_reader_t *r) {
  return r->manifest.job;
}

uint64_t fsdp_checkpoint_step(const fsdp_checkpoint_reader_t *r) {
  return r->manifest.step;
}

bool fsdp_checkpoint_uid(const fsdp_checkpoint_reader_t *r, uint64_t *ret_uid) {
  if (!r->manifest.has_uid)
    return false;
  *ret_uid = r->manifest.uid;
  return true;
}

unsigned fsdp_checkpoint_hosts(const fsdp_checkpoint_reader_t *r) {
  return r->hosts;
}

const fsdp_checkpoint_unit_t *fsdp_checkpoint_units(const fsdp_checkpoint_reader_t *r,
                                                    size_t *ret_n) {
  *ret_n = r->n_units;
  return r->units;
}

uint64_t fsdp_checkpoint_optimizer_steps(const fsdp_checkpoint_reader_t *r, size_t unit) {
  return unit < r->n_units ? r->optimizer_steps[unit] : 0;
}

/* ---- Reading blocks ---- */

/* Reads n bytes at offset of host h's file into dst, a chunk at a time: a stop abandons
 * it between chunks. */
static int read_at(fsdp_checkpoint_reader_t *r, unsigned h, uint64_t offset, void *dst,
                   size_t n, fsdp_status_t *st) {
  char path[PATH_MAX + 32];
  bin_path(r, h, path, sizeof path);
  for (size_t done = 0; done < n;) {
    if (r->stopping && atomic_load(r->stopping) == FSDP_CHECKPOINT_ABANDON)
      return io_failed(st, "reading", path, ECANCELED);
    size_t want = n - done < IO_CHUNK ? n - done : IO_CHUNK;
    ssize_t got = pread(r->bin_fds[h], (char *)dst + done, want, (off_t)(offset + done));
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0)
      return got < 0 ? io_failed(st, "reading", path, errno)
                     : fsdp_status_set(st, FSDP_E_DATA_LOSS,
                                       "checkpoint %s ends at byte %" PRIu64 ", before %" PRIu64,
                                       path, offset + done, offset + n);
    done += (size_t)got;
  }
  return 0;
}

/* Piece p's block b, checked (once per reader) against its checksum. */
static int check_block(fsdp_checkpoint_reader_t *r, piece_t *p, unsigned b, fsdp_status_t *st) {
  if (p->checked[b])
    return 0;
  const block_meta_t *k = &p->blocks[b];
  XXH64_state_t *hash = XXH64_createState();
  if (!hash)
    return fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  XXH64_reset(hash, 0);
  int code = 0;
  for (uint64_t done = 0; code == 0 && done < k->bytes;) {
    size_t n = k->bytes - done < IO_CHUNK ? (size_t)(k->bytes - done) : IO_CHUNK;
    code = read_at(r, p->host, k->offset + done, r->buf, n, st);
    XXH64_update(hash, r->buf, n);
    done += n;
  }
  if (code == 0 && XXH64_digest(hash) != k->xxh64)
    code = fsdp_status_set(st, FSDP_E_DATA_LOSS,
                           "checkpoint: %s/host-%u.bin bytes [%" PRIu64 ", %" PRIu64 ") (unit "
                           "'%s''s %s) do not match their checksum",
                           r->path, p->host, k->offset, k->offset + k->bytes,
                           r->units[p->unit].name, block_name(b));
  XXH64_freeState(hash);
  p->checked[b] = code == 0;
  return code;
}

int fsdp_checkpoint_read_elements(fsdp_checkpoint_reader_t *r, size_t unit, unsigned b,
                                  uint64_t first, uint64_t n, float *dst, fsdp_status_t *st) {
  if (unit >= r->n_units || b > r->units[unit].arrays || n > UINT64_MAX - first ||
      (dst && n > SIZE_MAX / sizeof(float)))
    return fsdp_status_set(st, -EINVAL, "checkpoint %s: no block %u of unit %zu, or elements "
                           "[%" PRIu64 ", +%" PRIu64 ") past any",
                           r->path, b, unit, first, n);
  const fsdp_checkpoint_unit_t *c = &r->units[unit];
  piece_t *pieces = r->pieces + r->unit_pieces[unit];
  size_t n_pieces = r->unit_pieces[unit + 1] - r->unit_pieces[unit];
  for (uint64_t e = first; e < first + n;) {
    size_t k = 0;
    while (k < n_pieces && !(pieces[k].first <= e && e < pieces[k].end))
      k++;
    if (k == n_pieces) {
      if (e < c->numel)
        return fsdp_status_set(st, FSDP_E_DATA_LOSS,
                               "checkpoint %s: no host's file holds element %" PRIu64 " of "
                               "unit '%s''s %s", r->path, e, c->name, block_name(b));
      /* Padding no file holds, up to the next piece that does or the end: zeros. */
      uint64_t stop = first + n;
      for (size_t j = 0; j < n_pieces; j++)
        if (pieces[j].first > e && pieces[j].first < stop)
          stop = pieces[j].first;
      if (dst)
        memset(dst + (e - first), 0, (size_t)(stop - e) * sizeof(float));
      e = stop;
      continue;
    }
    piece_t *p = &pieces[k];
    int code = check_block(r, p, b, st);
    uint64_t stop = first + n < p->end ? first + n : p->end;
    if (code == 0 && dst)
      code = read_at(r, p->host, p->blocks[b].offset + (e - p->first) * sizeof(float),
                     dst + (e - first), (size_t)(stop - e) * sizeof(float), st);
    if (code < 0)
      return code;
    e = stop;
  }
  return 0;
}

/* ---- Loading ---- */

/* The checkpoint's unit of u's name, of as many elements, and of as many optimizer arrays
 * where both hold some: a checkpoint saved without the daemon's optimizer loads into a job
 * with it (its state then starts at zero), and one saved with it into a job without (its
 * state is left out), but another optimizer's arrays are not this one's. */
static int match_unit(const fsdp_checkpoint_reader_t *r, const fsdp_checkpoint_unit_t *u,
                      size_t *ret, fsdp_status_t *st) {
  json_object *index;
  if (!json_object_object_get_ex(r->by_name, u->name, &index))
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION, "checkpoint %s has no unit '%s'",
                           r->path, u->name);
  size_t i = (size_t)json_object_get_int64(index);
  const fsdp_checkpoint_unit_t *c = &r->units[i];
  if (c->numel != u->numel)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "checkpoint %s: unit '%s' has numel %" PRIu64 ", the job's %" PRIu64,
                           r->path, u->name, c->numel, u->numel);
  if (c->arrays && u->arrays && c->arrays != u->arrays)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "checkpoint %s: unit '%s' holds %u arrays of optimizer state, the "
                           "job's optimizer %u: it was saved with another optimizer (set the "
                           "same one before loading, or none to load the masters alone)",
                           r->path, u->name, c->arrays, u->arrays);
  *ret = i;
  return 0;
}

/* With job->same_uid_only, a checkpoint of the job's uid only. */
static int check_uid(const fsdp_checkpoint_reader_t *r, const fsdp_checkpoint_job_t *job,
                     fsdp_status_t *st) {
  uint64_t uid;
  if (!job->same_uid_only)
    return 0;
  if (!fsdp_checkpoint_uid(r, &uid))
    return fsdp_status_set(st, FSDP_E_PERMISSION_DENIED,
                           "checkpoint %s names no uid that saved it, and job '%s' (uid %" PRIu64
                           ") loads only its own uid's",
                           r->path, job->job, job->uid);
  if (uid != job->uid)
    return fsdp_status_set(st, FSDP_E_PERMISSION_DENIED,
                           "checkpoint %s was saved by uid %" PRIu64 ", not job '%s''s uid %" PRIu64,
                           r->path, uid, job->job, job->uid);
  return 0;
}

/* The checkpoint a load reads: dir's own, or its newest of the job's, or (for a caller's
 * load, which its own rights guard) its newest of any job's where the job has none there. */
static int open_to_load(const char *dir, const fsdp_checkpoint_job_t *job,
                        fsdp_checkpoint_reader_t **ret, fsdp_status_t *st) {
  int code = fsdp_checkpoint_open(dir, job->job, ret, st);
  if (code != FSDP_E_NOT_FOUND || job->own_job_only)
    return code;
  fsdp_status_t any;
  code = fsdp_checkpoint_open(dir, NULL, ret, &any);
  if (code == FSDP_E_NOT_FOUND)
    return st->code; /* st names the job's: there is nothing else either */
  if (code < 0)
    *st = any;
  return code;
}

int fsdp_checkpoint_load(const char *dir, const fsdp_checkpoint_job_t *job,
                         fsdp_checkpoint_loaded_t *ret, fsdp_status_t *st) {
  fsdp_checkpoint_reader_t *r;
  int code = open_to_load(dir, job, &r, st);
  if (code < 0)
    return code;
  r->stopping = job->stopping;
  size_t *matched = calloc(job->n_units + 1, sizeof *matched);
  if (!matched)
    code = fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  else if (job->own_job_only && strcmp(fsdp_checkpoint_job(r), job->job) != 0)
    code = fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "checkpoint %s is of job '%s', not '%s' (the daemon reads only the "
                           "job's own checkpoints in its checkpoint.dir/<job>/: load another "
                           "job's by its path as its owner)",
                           r->path, fsdp_checkpoint_job(r), job->job);
  else
    code = check_uid(r, job, st);
  for (size_t i = 0; code == 0 && i < job->n_units; i++)
    code = match_unit(r, &job->units[i], &matched[i], st);
  /* Each unit's elements this host holds now, from whichever hosts' files hold them. Every
   * block read is checked before anything is written: a refusal changes nothing. */
  size_t left_out = 0, zeroed = 0;
  for (int pass = 0; code == 0 && pass < 2; pass++) {
    for (size_t i = 0; code == 0 && i < job->n_units; i++) {
      const fsdp_checkpoint_unit_t *u = &job->units[i];
      unsigned saved = r->units[matched[i]].arrays;
      uint64_t first = (uint64_t)u->host_first_shard * u->shard_numel;
      /* The masters, and the optimizer's arrays where the checkpoint has them too. */
      unsigned blocks = saved ? n_blocks(u) : 1;
      for (unsigned b = 0; code == 0 && b < blocks; b++)
        code = fsdp_checkpoint_read_elements(r, matched[i], b, first, host_numel(u),
                                             pass ? block(u, b) : NULL, st);
      if (code < 0 || !pass)
        continue;
      left_out += saved && !u->arrays;
      if (u->arrays && !saved) {
        zeroed++;
        for (unsigned b = 1; b < n_blocks(u); b++)
          memset(block(u, b), 0, host_numel(u) * sizeof(float));
      }
      if (u->steps)
        *u->steps = saved ? fsdp_checkpoint_optimizer_steps(r, matched[i]) : 0;
    }
  }
  if (code == 0) {
    *ret = (fsdp_checkpoint_loaded_t){.step = fsdp_checkpoint_step(r),
                                      .state_left_out = left_out,
                                      .state_zeroed = zeroed};
    snprintf(ret->path, sizeof ret->path, "%s", r->path);
    snprintf(ret->job, sizeof ret->job, "%s", fsdp_checkpoint_job(r));
    for (size_t i = 0; i < r->n_units; i++)
      ret->optimizer_state |= r->units[i].arrays > 0;
  }
  free(matched);
  fsdp_checkpoint_close(r);
  return code;
}
