/* The checkpoint library's shared pieces (checkpoint/files.h). */
#include "checkpoint/files.h"

#include <dirent.h>
#include <inttypes.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <json-c/json.h>

#include "common/dirs.h"

void host_file(char *buf, size_t size, unsigned host, const char *ext) {
  snprintf(buf, size, "host-%u.%s", host, ext);
}

int io_failed(fsdp_status_t *st, const char *what, const char *path, int err) {
  if (err == ECANCELED)
    return fsdp_status_set(st, FSDP_E_ABORTED, "checkpoint: %s %s: abandoned by the daemon's stop",
                           what, path);
  if (err == EACCES || err == EPERM)
    return fsdp_status_set(st, FSDP_E_PERMISSION_DENIED,
                           "checkpoint: %s %s: %s (with the rights of the caller)", what, path,
                           strerror(err));
  if (err == ELOOP || err == FSDP_ENOTREG || err == ENOTDIR)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "checkpoint: %s %s: a component is %s", what, path,
                           err == ENOTDIR ? "not a directory" : fsdp_dirs_strerror(err));
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

json_object *read_json_at(int dirfd, const char *dir_path, const char *name, size_t max,
                          fsdp_status_t *st, int *ret_code) {
  char *text;
  size_t len;
  int r = fsdp_file_read_at(dirfd, name, max, &text, &len);
  if (r < 0) {
    *ret_code = r == -ENOENT ? fsdp_status_set(st, FSDP_E_NOT_FOUND, "checkpoint: no %s/%s",
                                               dir_path, name)
                : r == -EFBIG ? fsdp_status_set(st, FSDP_E_DATA_LOSS,
                                                "checkpoint: %s/%s holds more than the %zu "
                                                "bytes such a file may", dir_path, name, max)
                : r == -ELOOP || r == -FSDP_ENOTREG
                    ? fsdp_status_set(st, FSDP_E_DATA_LOSS, "checkpoint: %s/%s is %s",
                                      dir_path, name, fsdp_dirs_strerror(-r))
                    : io_failed(st, "reading", name, -r);
    return NULL;
  }
  json_tokener *tok = json_tokener_new_ex(JSON_DEPTH_MAX);
  json_object *o = tok ? json_tokener_parse_ex(tok, text, (int)len) : NULL;
  bool whole = tok && o && json_tokener_get_error(tok) == json_tokener_success &&
               tok->char_offset == (int)len && len <= INT_MAX;
  if (!whole) {
    *ret_code = fsdp_status_set(st, FSDP_E_DATA_LOSS, "checkpoint: %s/%s is not JSON: %s",
                                dir_path, name,
                                tok ? json_tokener_error_desc(json_tokener_get_error(tok))
                                    : "out of memory");
    json_object_put(o);
    o = NULL;
  }
  json_tokener_free(tok);
  free(text);
  return o;
}

json_object *json_array_at(json_object *o, const char *key) {
  json_object *v = NULL;
  return o && json_object_object_get_ex(o, key, &v) && json_object_is_type(v, json_type_array)
             ? v
             : NULL;
}

const char *json_string_at(json_object *o, const char *key) {
  json_object *v = NULL;
  return o && json_object_object_get_ex(o, key, &v) && json_object_is_type(v, json_type_string)
             ? json_object_get_string(v)
             : NULL;
}

bool json_u64_at(json_object *o, const char *key, uint64_t *ret) {
  json_object *v = NULL;
  if (!o || !json_object_object_get_ex(o, key, &v) || !json_object_is_type(v, json_type_int))
    return false;
  /* json-c keeps a value past INT64_MAX as unsigned, read back here as INT64_MAX; it reads
   * any integer past 2^64 - 1 as 2^64 - 1, which so cannot be told from them and is
   * refused too. */
  if (json_object_get_int64(v) < 0 || json_object_get_uint64(v) == UINT64_MAX)
    return false;
  *ret = json_object_get_uint64(v);
  return true;
}

int read_manifest(int step_fd, const char *step_path, manifest_t *ret, fsdp_status_t *st) {
  int code = 0;
  json_object *m = read_json_at(step_fd, step_path, MANIFEST, MANIFEST_MAX, st, &code);
  if (!m)
    return code;
  manifest_t out = {0};
  const char *job = json_string_at(m, "job"), *bad = NULL;
  if (!json_u64_at(m, "format", &out.format))
    bad = "format";
  else if (!job || strlen(job) > FSDP_CHECKPOINT_JOB_MAX)
    bad = "job";
  else if (!json_u64_at(m, "step", &out.step))
    bad = "step";
  else if (!json_u64_at(m, "hosts", &out.hosts))
    bad = "hosts";
  else if (json_object_object_get_ex(m, "uid", NULL) &&
           !(out.has_uid = json_u64_at(m, "uid", &out.uid)))
    bad = "uid";
  if (!bad)
    snprintf(out.job, sizeof out.job, "%s", job);
  json_object_put(m);
  if (bad)
    return fsdp_status_set(st, FSDP_E_DATA_LOSS,
                           "checkpoint: %s/" MANIFEST ": key '%s' is missing or not %s",
                           step_path, bad,
                           strcmp(bad, "job") == 0 ? "a job's name" : "a non-negative integer");
  *ret = out;
  return 0;
}

bool parse_step_name(const char *name, const char *suffix, uint64_t *ret_step) {
  if (strncmp(name, "step-", 5) != 0)
    return false;
  uint64_t step = 0;
  const char *p = name + 5;
  for (; *p >= '0' && *p <= '9'; p++) {
    if (step > (UINT64_MAX - (uint64_t)(*p - '0')) / 10)
      return false;
    step = step * 10 + (uint64_t)(*p - '0');
  }
  if (p == name + 5 || strcmp(p, suffix) != 0)
    return false;
  *ret_step = step;
  return true;
}

/* Calls each(step, ctx) for every complete checkpoint under dirfd of job's (NULL: any job's),
 * of uid's where uid is not NULL: step-<S>/, a directory and no link, whose manifest is of
 * step S. Returns how many there were. */
static size_t steps_where(int dirfd, const char *job, const uint64_t *uid,
                          void (*each)(uint64_t step, void *ctx), void *ctx) {
  DIR *d = fsdp_dir_list(dirfd);
  if (!d)
    return 0;
  size_t n = 0;
  for (struct dirent *e; (e = readdir(d));) {
    uint64_t step;
    if (!parse_step_name(e->d_name, "", &step))
      continue;
    int step_fd = fsdp_dir_open_at(dirfd, e->d_name, false, 0, NULL);
    manifest_t m;
    fsdp_status_t st;
    bool complete = step_fd >= 0 && read_manifest(step_fd, e->d_name, &m, &st) == 0 &&
                    m.step == step && (!job || strcmp(m.job, job) == 0) &&
                    (!uid || (m.has_uid && m.uid == *uid));
    if (step_fd >= 0)
      close(step_fd);
    if (complete) {
      each(step, ctx);
      n++;
    }
  }
  closedir(d);
  return n;
}

/* A growing list of steps; on want of memory it stops growing (ok false). */
typedef struct step_list {
  uint64_t *steps;
  size_t n, cap;
  bool ok;
} step_list_t;

static void add_step(uint64_t step, void *ctx) {
  step_list_t *l = ctx;
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 16;
    uint64_t *grown = l->ok ? realloc(l->steps, cap * sizeof *grown) : NULL;
    if (!grown) {
      l->ok = false;
      return;
    }
    l->steps = grown;
    l->cap = cap;
  }
  l->steps[l->n++] = step;
}

size_t complete_steps_of(int dirfd, const char *job, uint64_t uid, uint64_t **ret) {
  step_list_t l = {.ok = true};
  steps_where(dirfd, job, &uid, add_step, &l);
  if (!l.ok) {
    free(l.steps);
    return 0;
  }
  *ret = l.steps;
  return l.n;
}

static void take_highest(uint64_t step, void *ctx) {
  uint64_t *highest = ctx;
  *highest = step > *highest ? step : *highest;
}

/* newest_step, of uid's only where uid is not NULL: one pass, the highest kept. */
static bool newest_where(int dirfd, const char *job, const uint64_t *uid, uint64_t *ret) {
  uint64_t highest = 0;
  if (steps_where(dirfd, job, uid, take_highest, &highest) == 0)
    return false;
  *ret = highest;
  return true;
}

bool newest_step(int dirfd, const char *job, uint64_t *ret) {
  return newest_where(dirfd, job, NULL, ret);
}

/* A step directory under dirfd above `above` (all of them, with none found) whose manifest
 * cannot be read: DATA_LOSS naming it, so that a damaged newest checkpoint is not passed
 * over for an older one without a word. 0 when there is none. */
static int damaged_above(int dirfd, const char *dir, bool none, uint64_t above,
                         char *ret_name, size_t size, fsdp_status_t *st) {
  DIR *d = fsdp_dir_list(dirfd);
  int code = 0;
  for (struct dirent *e; code == 0 && d && (e = readdir(d));) {
    uint64_t step;
    if (!parse_step_name(e->d_name, "", &step) || (!none && step <= above))
      continue;
    int step_fd = fsdp_dir_open_at(dirfd, e->d_name, false, 0, NULL);
    manifest_t m;
    fsdp_status_t why;
    if (step_fd < 0)
      code = fsdp_status_set(st, FSDP_E_DATA_LOSS, "checkpoint: %s/%s is %s", dir, e->d_name,
                             fsdp_dirs_strerror(-step_fd));
    else if (read_manifest(step_fd, e->d_name, &m, &why) < 0 && why.code != FSDP_E_NOT_FOUND)
      code = fsdp_status_set(st, FSDP_E_DATA_LOSS, "%s (in %s)", why.message, dir);
    if (step_fd >= 0)
      close(step_fd);
    if (code < 0)
      snprintf(ret_name, size, "%s", e->d_name);
  }
  if (d)
    closedir(d);
  return code;
}

int fsdp_checkpoint_find(const char *dir, const char *job, const uint64_t *uid, char *ret_path,
                         size_t size, uint64_t *ret_step, fsdp_status_t *st) {
  int fd = fsdp_dir_open(dir, false, 0);
  if (fd == -ENOENT)
    return fsdp_status_set(st, FSDP_E_NOT_FOUND, "checkpoint: no directory %s", dir);
  if (fd < 0)
    return io_failed(st, "opening", dir, -fd);
  uint64_t step = 0;
  bool found = newest_where(fd, job, uid, &step);
  char name[NAME_MAX + 1];
  int damaged = damaged_above(fd, dir, !found, step, name, sizeof name, st);
  close(fd);
  if (damaged < 0) {
    join(ret_path, size, dir, "/", name);
    return damaged;
  }
  if (!found)
    return fsdp_status_set(st, FSDP_E_NOT_FOUND,
                           "checkpoint: no complete checkpoint of job '%s'%s in %s", job,
                           uid ? " of its uid" : "", dir);
  snprintf(name, sizeof name, "step-%" PRIu64, step);
  if (!join(ret_path, size, dir, "/", name))
    return io_failed(st, "naming", dir, ENAMETOOLONG);
  *ret_step = step;
  return 0;
}

int steps_descending(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}
