/* Reading checkpoints (checkpoint/checkpoint.h): the metadata by json-c, each block checked
 * against its XXH64 the first time a read touches it. */
#include "checkpoint/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <json-c/json.h>
#include <xxhash.h>

#include "checkpoint/files.h"

/* One host's files: its units' layouts (in the reader's unit order; a unit it does not list
 * has host_shards 0) and blocks, each block's checksum checked on first use. */
typedef struct host_part {
  char bin[PATH_MAX];
  int fd;
  json_object *meta;
  fsdp_checkpoint_unit_t *units;
  json_object **unit_meta;
  bool (*checked)[1 + FSDP_CHECKPOINT_ARRAYS_MAX];
} host_part_t;

struct fsdp_checkpoint_reader {
  char path[PATH_MAX]; /* the step directory */
  json_object *manifest;
  unsigned hosts;
  host_part_t *parts;
  fsdp_checkpoint_unit_t *units; /* host 0's, which name the units and their parameters */
  size_t n_units;
  fsdp_checkpoint_param_t *params;
  uint64_t *shapes;
  void *buf; /* IO_CHUNK, for checking a block */
};

static json_object *read_json(const char *dir, const char *name, fsdp_status_t *st,
                              int *ret_code) {
  char path[PATH_MAX];
  if (!join(path, sizeof path, dir, "/", name)) {
    *ret_code = io_failed(st, "naming", dir, ENAMETOOLONG);
    return NULL;
  }
  json_object *o = json_object_from_file(path);
  if (!o)
    *ret_code = fsdp_status_set(st, FSDP_E_DATA_LOSS, "checkpoint: %s cannot be read as JSON: %s",
                                path, json_util_get_last_err());
  return o;
}

static json_object *get(json_object *o, const char *key) {
  json_object *v = NULL;
  return o && json_object_object_get_ex(o, key, &v) ? v : NULL;
}

static uint64_t get_u64(json_object *o, const char *key) {
  json_object *v = get(o, key);
  return v ? json_object_get_uint64(v) : UINT64_MAX;
}

static const char *get_str(json_object *o, const char *key) {
  json_object *v = get(o, key);
  return v ? json_object_get_string(v) : "";
}

/* dir itself when it is a checkpoint, else the complete step-* under it of the highest step. */
static int find_checkpoint(const char *dir, char *ret, size_t size, fsdp_status_t *st) {
  char path[PATH_MAX];
  if (!join(path, sizeof path, dir, "/", MANIFEST))
    return io_failed(st, "naming", dir, ENAMETOOLONG);
  if (access(path, F_OK) == 0)
    return join(ret, size, dir, "", "") ? 0 : io_failed(st, "naming", dir, ENAMETOOLONG);
  if (access(dir, F_OK) != 0)
    return errno == ENOENT ? fsdp_status_set(st, FSDP_E_NOT_FOUND,
                                             "checkpoint: no directory %s", dir)
                           : io_failed(st, "reading", dir, errno);
  size_t n = complete_steps(dir, NULL, 0);
  uint64_t *steps = n ? malloc(n * sizeof *steps) : NULL;
  if (n && !steps)
    return fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  n = complete_steps(dir, steps, n);
  if (n == 0) {
    free(steps);
    return fsdp_status_set(st, FSDP_E_NOT_FOUND,
                           "checkpoint: no complete checkpoint (step-N/ with a manifest) in %s",
                           dir);
  }
  qsort(steps, n, sizeof *steps, steps_descending);
  char name[32];
  snprintf(name, sizeof name, "step-%" PRIu64, steps[0]);
  free(steps);
  return join(ret, size, dir, "/", name) ? 0 : io_failed(st, "naming", dir, ENAMETOOLONG);
}

void fsdp_checkpoint_close(fsdp_checkpoint_reader_t *r) {
  if (!r)
    return;
  for (unsigned h = 0; r->parts && h < r->hosts; h++) {
    host_part_t *p = &r->parts[h];
    if (p->fd >= 0)
      close(p->fd);
    json_object_put(p->meta);
    free(p->units);
    free(p->unit_meta);
    free(p->checked);
  }
  free(r->parts);
  json_object_put(r->manifest);
  free(r->params);
  free(r->shapes);
  free(r->buf);
  free(r);
}

static json_object *units_of(json_object *host_meta) {
  json_object *units = get(host_meta, "units");
  return units && json_object_is_type(units, json_type_array) ? units : NULL;
}

/* The units of host 0's metadata, with their parameters, as the reader's units. */
static int parse_units(fsdp_checkpoint_reader_t *r, fsdp_status_t *st) {
  json_object *units = units_of(r->parts[0].meta);
  if (!units)
    return fsdp_status_set(st, FSDP_E_DATA_LOSS, "checkpoint %s/host-0.json lists no units",
                           r->path);
  r->n_units = json_object_array_length(units);
  size_t n_params = 0, n_dims = 0;
  for (size_t i = 0; i < r->n_units; i++) {
    json_object *params = get(json_object_array_get_idx(units, i), "params");
    for (size_t k = 0; params && k < json_object_array_length(params); k++) {
      n_params++;
      json_object *shape = get(json_object_array_get_idx(params, k), "shape");
      n_dims += shape ? json_object_array_length(shape) : 0;
    }
  }
  r->params = calloc(n_params + 1, sizeof *r->params);
  r->shapes = calloc(n_dims + 1, sizeof *r->shapes);
  if (!r->params || !r->shapes)
    return fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  fsdp_checkpoint_param_t *p = r->params;
  uint64_t *dims = r->shapes;
  for (size_t i = 0; i < r->n_units; i++) {
    json_object *params = get(json_object_array_get_idx(units, i), "params");
    fsdp_checkpoint_unit_t *u = &r->parts[0].units[i];
    u->params = p;
    u->n_params = params ? json_object_array_length(params) : 0;
    for (size_t k = 0; k < u->n_params; k++, p++) {
      json_object *pm = json_object_array_get_idx(params, k), *shape = get(pm, "shape");
      *p = (fsdp_checkpoint_param_t){.name = get_str(pm, "name"),
                                     .shape = dims,
                                     .ndim = shape ? json_object_array_length(shape) : 0,
                                     .offset = get_u64(pm, "offset"),
                                     .dtype = get_str(pm, "dtype")};
      for (size_t d = 0; d < p->ndim; d++)
        *dims++ = json_object_get_uint64(json_object_array_get_idx(shape, d));
    }
  }
  r->units = r->parts[0].units;
  return 0;
}

/* Host h's metadata and layouts of the reader's units (after host 0's, which name them):
 * each unit of the same numel and optimizer state on every host, its shards within its
 * layout. */
static int read_host(fsdp_checkpoint_reader_t *r, unsigned h, fsdp_status_t *st) {
  host_part_t *part = &r->parts[h];
  char name[32];
  host_file(name, sizeof name, h, "json");
  int code = 0;
  if (!(part->meta = read_json(r->path, name, st, &code)))
    return code;
  json_object *units = units_of(part->meta);
  size_t n = units ? json_object_array_length(units) : 0;
  if (h == 0)
    r->n_units = n;
  if (get_u64(part->meta, "host") != h || get_u64(part->meta, "hosts") != r->hosts)
    return fsdp_status_set(st, FSDP_E_DATA_LOSS,
                           "checkpoint %s/%s is host %" PRIu64 " of %" PRIu64 ", expected %u "
                           "of %u",
                           r->path, name, get_u64(part->meta, "host"),
                           get_u64(part->meta, "hosts"), h, r->hosts);
  part->units = calloc(r->n_units + 1, sizeof *part->units);
  part->unit_meta = calloc(r->n_units + 1, sizeof *part->unit_meta);
  part->checked = calloc(r->n_units + 1, sizeof *part->checked);
  if (!part->units || !part->unit_meta || !part->checked)
    return fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  for (size_t k = 0; k < n; k++) {
    json_object *m = json_object_array_get_idx(units, k);
    size_t i = k;
    if (h > 0) /* the same unit as host 0's of its name */
      for (i = 0; i < r->n_units && strcmp(r->units[i].name, get_str(m, "name")) != 0;)
        i++;
    if (i == r->n_units)
      continue;
    json_object *blocks = get(m, "blocks");
    size_t n_blocks_meta = blocks ? json_object_array_length(blocks) : 0;
    fsdp_checkpoint_unit_t *u = &part->units[i];
    *u = (fsdp_checkpoint_unit_t){
        .name = get_str(m, "name"),
        .strategy = get_str(m, "strategy"),
        .numel = get_u64(m, "numel"),
        .padded_numel = get_u64(m, "padded_numel"),
        .shard_numel = get_u64(m, "shard_numel"),
        .shards = (uint32_t)get_u64(m, "shards"),
        .host_first_shard = (uint32_t)get_u64(m, "host_first_shard"),
        .host_shards = (uint32_t)get_u64(m, "host_shards"),
        .arrays = (unsigned)n_blocks_meta - 1,
    };
    part->unit_meta[i] = m;
    bool sane = n_blocks_meta >= 1 && n_blocks_meta <= 1 + FSDP_CHECKPOINT_ARRAYS_MAX &&
                u->numel <= u->padded_numel &&
                (uint64_t)u->shards * u->shard_numel == u->padded_numel &&
                (uint64_t)u->host_first_shard + u->host_shards <= u->shards &&
                (h == 0 || (u->numel == r->units[i].numel && u->arrays == r->units[i].arrays));
    if (!sane)
      return fsdp_status_set(st, FSDP_E_DATA_LOSS,
                             "checkpoint %s/%s: unit '%s' has a layout that does not hold "
                             "together (numel %" PRIu64 ", %u shards of %" PRIu64 ", shards "
                             "%u to %u here, %u optimizer arrays)",
                             r->path, name, u->name, u->numel, u->shards, u->shard_numel,
                             u->host_first_shard, u->host_first_shard + u->host_shards,
                             u->arrays);
  }
  host_file(name, sizeof name, h, "bin");
  if (!join(part->bin, sizeof part->bin, r->path, "/", name))
    return io_failed(st, "naming", r->path, ENAMETOOLONG);
  if ((part->fd = open(part->bin, O_RDONLY | O_CLOEXEC)) < 0)
    return io_failed(st, "opening", part->bin, errno);
  if (h == 0)
    return parse_units(r, st);
  return 0;
}

int fsdp_checkpoint_open(const char *dir, fsdp_checkpoint_reader_t **ret, fsdp_status_t *st) {
  fsdp_checkpoint_reader_t *r = calloc(1, sizeof *r);
  if (!r)
    return fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  int code = find_checkpoint(dir, r->path, sizeof r->path, st);
  if (code == 0 && !(r->manifest = read_json(r->path, MANIFEST, st, &code)))
    goto out;
  uint64_t format = code == 0 ? get_u64(r->manifest, "format") : 0;
  uint64_t hosts = code == 0 ? get_u64(r->manifest, "hosts") : 0;
  if (code == 0 && format != FSDP_CHECKPOINT_FORMAT)
    code = fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "checkpoint %s is of format %" PRIu64 ", this fsdpd reads %d",
                           r->path, format, FSDP_CHECKPOINT_FORMAT);
  else if (code == 0 && (hosts == 0 || hosts > FSDP_CHECKPOINT_HOSTS_MAX))
    code = fsdp_status_set(st, FSDP_E_DATA_LOSS, "checkpoint %s/" MANIFEST " names %" PRIu64
                           " hosts", r->path, hosts);
  if (code == 0) {
    r->hosts = (unsigned)hosts;
    if (!(r->parts = calloc(r->hosts, sizeof *r->parts)) || !(r->buf = malloc(IO_CHUNK)))
      code = fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
    for (unsigned h = 0; r->parts && h < r->hosts; h++)
      r->parts[h].fd = -1;
  }
  for (unsigned h = 0; code == 0 && h < r->hosts; h++)
    code = read_host(r, h, st);
out:
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
  return get_str(r->manifest, "job");
}

uint64_t fsdp_checkpoint_step(const fsdp_checkpoint_reader_t *r) {
  return get_u64(r->manifest, "step");
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
  return get_u64(r->parts[0].unit_meta[unit], "optimizer_steps");
}

/* Reads n bytes at offset of host h's file into dst. */
static int read_at(fsdp_checkpoint_reader_t *r, unsigned h, uint64_t offset, void *dst,
                   size_t n, fsdp_status_t *st) {
  const host_part_t *p = &r->parts[h];
  for (size_t done = 0; done < n;) {
    ssize_t got = pread(p->fd, (char *)dst + done, n - done, (off_t)(offset + done));
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0)
      return got < 0 ? io_failed(st, "reading", p->bin, errno)
                     : fsdp_status_set(st, FSDP_E_DATA_LOSS,
                                       "checkpoint: %s ends at byte %" PRIu64 ", before %" PRIu64,
                                       p->bin, offset + done, offset + n);
    done += (size_t)got;
  }
  return 0;
}

/* Host h's block b of unit: where it starts in the file, after checking (once per reader)
 * that its length is its layout's and its bytes match their checksum. */
static int checked_block(fsdp_checkpoint_reader_t *r, unsigned h, size_t unit, unsigned b,
                         uint64_t *ret_offset, fsdp_status_t *st) {
  host_part_t *p = &r->parts[h];
  const fsdp_checkpoint_unit_t *u = &p->units[unit];
  json_object *m = json_object_array_get_idx(get(p->unit_meta[unit], "blocks"), b);
  uint64_t offset = get_u64(m, "offset"), bytes = get_u64(m, "bytes");
  *ret_offset = offset;
  if (p->checked[unit][b])
    return 0;
  if (bytes != host_numel(u) * sizeof(float))
    return fsdp_status_set(st, FSDP_E_DATA_LOSS,
                           "checkpoint %s: unit '%s''s %s is %" PRIu64 " bytes, expected %zu",
                           p->bin, u->name, block_name(b), bytes, host_numel(u) * sizeof(float));
  XXH64_state_t *hash = XXH64_createState();
  if (!hash)
    return fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  XXH64_reset(hash, 0);
  int code = 0;
  for (uint64_t done = 0; code == 0 && done < bytes;) {
    size_t n = bytes - done < IO_CHUNK ? (size_t)(bytes - done) : IO_CHUNK;
    code = read_at(r, h, offset + done, r->buf, n, st);
    XXH64_update(hash, r->buf, n);
    done += n;
  }
  if (code == 0 && XXH64_digest(hash) != get_u64(m, "xxh64"))
    code = fsdp_status_set(st, FSDP_E_DATA_LOSS,
                           "checkpoint: %s bytes [%" PRIu64 ", %" PRIu64 ") (unit '%s''s %s) do "
                           "not match their checksum",
                           p->bin, offset, offset + bytes, u->name, block_name(b));
  XXH64_freeState(hash);
  p->checked[unit][b] = code == 0;
  return code;
}

int fsdp_checkpoint_read_elements(fsdp_checkpoint_reader_t *r, size_t unit, unsigned b,
                                  uint64_t first, uint64_t n, float *dst, fsdp_status_t *st) {
  const fsdp_checkpoint_unit_t *c = &r->units[unit];
  for (uint64_t e = first; e < first + n;) {
    unsigned h = 0;
    uint64_t begin = 0, end = 0;
    for (; h < r->hosts; h++) {
      const fsdp_checkpoint_unit_t *u = &r->parts[h].units[unit];
      begin = (uint64_t)u->host_first_shard * u->shard_numel;
      end = begin + host_numel(u);
      if (u->host_shards && b <= u->arrays && begin <= e && e < end)
        break;
    }
    if (h == r->hosts && e >= c->numel) { /* padding past the saved layout's */
      if (dst)
        memset(dst + (e - first), 0, (size_t)(first + n - e) * sizeof(float));
      return 0;
    }
    if (h == r->hosts)
      return fsdp_status_set(st, FSDP_E_DATA_LOSS,
                             "checkpoint %s: no host's file holds element %" PRIu64 " of unit "
                             "'%s''s %s",
                             r->path, e, c->name, block_name(b));
    uint64_t offset;
    int code = checked_block(r, h, unit, b, &offset, st);
    uint64_t stop = first + n < end ? first + n : end;
    if (code == 0 && dst)
      code = read_at(r, h, offset + (e - begin) * sizeof(float), dst + (e - first),
                     (size_t)(stop - e) * sizeof(float), st);
    if (code < 0)
      return code;
    e = stop;
  }
  return 0;
}

/* ---- Loading ---- */

/* The checkpoint's unit of u's name, of as many elements, with as much optimizer state as
 * u has room for. */
static int match_unit(const fsdp_checkpoint_reader_t *r, const fsdp_checkpoint_unit_t *u,
                      size_t *ret, fsdp_status_t *st) {
  size_t i = 0;
  while (i < r->n_units && strcmp(r->units[i].name, u->name) != 0)
    i++;
  if (i == r->n_units)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION, "checkpoint %s has no unit '%s'",
                           r->path, u->name);
  const fsdp_checkpoint_unit_t *c = &r->units[i];
  if (c->numel != u->numel)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "checkpoint %s: unit '%s' has numel %" PRIu64 ", the job's %" PRIu64,
                           r->path, u->name, c->numel, u->numel);
  if (c->arrays != u->arrays)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "checkpoint %s: unit '%s' holds %u arrays of optimizer state, the "
                           "job's optimizer %u (set the same optimizer before loading)",
                           r->path, u->name, c->arrays, u->arrays);
  *ret = i;
  return 0;
}

int fsdp_checkpoint_load(const char *dir, const fsdp_checkpoint_job_t *job, char *ret_path,
                         size_t size, uint64_t *ret_step, fsdp_status_t *st) {
  fsdp_checkpoint_reader_t *r;
  int code = fsdp_checkpoint_open(dir, &r, st);
  if (code < 0)
    return code;
  size_t *matched = calloc(job->n_units + 1, sizeof *matched);
  if (!matched)
    code = fsdp_status_set(st, -ENOMEM, "checkpoint: out of memory");
  else if (strcmp(fsdp_checkpoint_job(r), job->job) != 0)
    code = fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "checkpoint %s is of job '%s', not '%s'", r->path,
                           fsdp_checkpoint_job(r), job->job);
  for (size_t i = 0; code == 0 && i < job->n_units; i++)
    code = match_unit(r, &job->units[i], &matched[i], st);
  /* Each unit's elements this host holds now, from whichever hosts' files hold them. Every
   * block read is checked before anything is written: a refusal changes nothing. */
  for (int pass = 0; code == 0 && pass < 2; pass++) {
    for (size_t i = 0; code == 0 && i < job->n_units; i++) {
      const fsdp_checkpoint_unit_t *u = &job->units[i];
      uint64_t first = (uint64_t)u->host_first_shard * u->shard_numel;
      for (unsigned b = 0; code == 0 && b < n_blocks(u); b++)
        code = fsdp_checkpoint_read_elements(r, matched[i], b, first, host_numel(u),
                                             pass ? block(u, b) : NULL, st);
      if (code == 0 && pass && u->steps)
        *u->steps = fsdp_checkpoint_optimizer_steps(r, matched[i]);
    }
  }
  if (code == 0) {
    snprintf(ret_path, size, "%s", r->path);
    *ret_step = fsdp_checkpoint_step(r);
  }
  free(matched);
  fsdp_checkpoint_close(r);
  return code;
}
