/* checkpoint/checkpoint.h's reader on damaged and hostile files (issue 29, item 2): every
 * value of the wrong type, every size past its layout or its file, a FIFO or a link to
 * /dev/zero where a file should be, and steps that are not non-negative integers are
 * refused with DATA_LOSS naming the file and the key, within a deadline (SIGALRM ends a
 * reader that hangs), never a crash. Also: the newest checkpoint is the job's own, a load
 * keeps to the job's uid when asked, and a stop abandons it. The files are written here,
 * as a save writes them, and then damaged one value at a time. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <json-c/json.h>
#include <xxhash.h>

#include "checkpoint/checkpoint.h"

/* How long one open or load may take here: a reader that blocks on a FIFO or reads
 * /dev/zero forever is killed by SIGALRM, failing the test. */
#define DEADLINE_S 20

/* The fixture: one host, unit 'u' of 6 elements in 2 shards of 3, no optimizer state,
 * parameters p0 [2, 2] at 0 and p1 [2] at 4; its masters 0, 1, ..., 5. */
static const float masters[6] = {0, 1, 2, 3, 4, 5};

static char root[64];

static void write_file(const char *dir, const char *name, const void *data, size_t len) {
  char path[256];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  unlink(path);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, data, len), (ssize_t)len);
  close(fd);
}

static json_object *manifest_json(const char *job, uint64_t step) {
  json_object *m = json_object_new_object();
  json_object_object_add(m, "format", json_object_new_int(1));
  json_object_object_add(m, "job", json_object_new_string(job));
  json_object_object_add(m, "step", json_object_new_uint64(step));
  json_object_object_add(m, "hosts", json_object_new_int(1));
  json_object_object_add(m, "uid", json_object_new_int(1000));
  return m;
}

static json_object *host_json(void) {
  const char *text =
      "{\"format\": 1, \"job\": \"j\", \"host\": 0, \"hosts\": 1, \"step\": 1,"
      " \"optimizer\": \"\", \"units\": [{\"name\": \"u\", \"strategy\": \"FULL_SHARD\","
      " \"params\": [{\"name\": \"p0\", \"shape\": [2, 2], \"offset\": 0, \"dtype\": \"DTYPE_FP32\"},"
      "  {\"name\": \"p1\", \"shape\": [2], \"offset\": 4, \"dtype\": \"DTYPE_FP32\"}],"
      " \"numel\": 6, \"padded_numel\": 6, \"shard_numel\": 3, \"shards\": 2,"
      " \"host_first_shard\": 0, \"host_shards\": 2, \"optimizer_steps\": 1,"
      " \"blocks\": [{\"what\": \"masters\", \"offset\": 0, \"bytes\": 24, \"xxh64\": 0}]}]}";
  json_object *h = json_tokener_parse(text);
  json_object *units, *unit, *blocks;
  json_object_object_get_ex(h, "units", &units);
  unit = json_object_array_get_idx(units, 0);
  json_object_object_get_ex(unit, "blocks", &blocks);
  json_object_object_add(json_object_array_get_idx(blocks, 0), "xxh64",
                         json_object_new_uint64(XXH64(masters, sizeof masters, 0)));
  return h;
}

/* The member at path ("units.0.blocks": keys, and indexes of arrays) set to the JSON text
 * value, or removed when value is NULL. */
static void set_path(json_object *o, const char *path, const char *value) {
  char copy[128];
  snprintf(copy, sizeof copy, "%s", path);
  char *last = strrchr(copy, '.');
  if (last) {
    *last++ = '\0';
    for (char *save = NULL, *k = strtok_r(copy, ".", &save); k; k = strtok_r(NULL, ".", &save))
      o = json_object_is_type(o, json_type_array) ? json_object_array_get_idx(o, atoi(k))
                                                  : json_object_object_get(o, k);
  } else {
    last = copy;
  }
  assert_non_null(o);
  json_object *v = value ? json_tokener_parse(value) : NULL;
  assert_true(!value || v || strcmp(value, "null") == 0);
  if (json_object_is_type(o, json_type_array))
    json_object_array_put_idx(o, (size_t)atoi(last), v);
  else if (value)
    json_object_object_add(o, last, v);
  else
    json_object_object_del(o, last);
}

static void write_json(const char *dir, const char *name, json_object *o) {
  const char *text = json_object_to_json_string(o);
  write_file(dir, name, text, strlen(text));
  json_object_put(o);
}

/* A whole checkpoint of job at step in dir (made if missing). */
static void write_checkpoint(const char *dir, const char *job, uint64_t step) {
  mkdir(dir, 0755);
  write_file(dir, "host-0.bin", masters, sizeof masters);
  write_json(dir, "host-0.json", host_json());
  write_json(dir, "manifest.json", manifest_json(job, step));
}

static void step_dir(char *buf, size_t size, const char *name) {
  snprintf(buf, size, "%s/%s", root, name);
}

static int set_up(void **state) {
  (void)state;
  snprintf(root, sizeof root, "/tmp/fsdp-ckpt-read-XXXXXX");
  assert_non_null(mkdtemp(root));
  return 0;
}

static int tear_down(void **state) {
  (void)state;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
  return system(cmd) == 0 ? 0 : -1;
}

/* Opens dir (of job's) with the deadline; returns the code, the reader closed. */
static int open_code(const char *dir, const char *job, fsdp_status_t *st) {
  fsdp_checkpoint_reader_t *r = NULL;
  alarm(DEADLINE_S);
  int code = fsdp_checkpoint_open(dir, job, &r, st);
  alarm(0);
  fsdp_checkpoint_close(r);
  return code;
}

static void assert_data_loss(const char *dir, const char *file, const char *words) {
  fsdp_status_t st = FSDP_STATUS_INIT;
  int code = open_code(dir, NULL, &st);
  if (code != FSDP_E_DATA_LOSS || !strstr(st.message, file) || !strstr(st.message, words))
    fail_msg("expected DATA_LOSS naming %s and \"%s\", got %d: %s", file, words, code,
             st.message);
}

static void test_a_whole_checkpoint_reads_back(void **state) {
  (void)state;
  char dir[128];
  step_dir(dir, sizeof dir, "step-1");
  write_checkpoint(dir, "j", 1);
  fsdp_checkpoint_reader_t *r;
  fsdp_status_t st = FSDP_STATUS_INIT;
  assert_int_equal(fsdp_checkpoint_open(root, "j", &r, &st), 0);
  uint64_t uid = 0;
  assert_true(fsdp_checkpoint_uid(r, &uid));
  assert_int_equal(uid, 1000);
  assert_string_equal(fsdp_checkpoint_job(r), "j");
  assert_int_equal(fsdp_checkpoint_step(r), 1);
  size_t n;
  const fsdp_checkpoint_unit_t *u = fsdp_checkpoint_units(r, &n);
  assert_int_equal(n, 1);
  assert_int_equal(u->n_params, 2);
  assert_int_equal(u->params[0].shape[1], 2);
  float got[8];
  assert_int_equal(fsdp_checkpoint_read_elements(r, 0, 0, 1, 7, got, &st), 0);
  assert_memory_equal(got, masters + 1, 5 * sizeof(float));
  assert_true(got[5] == 0 && got[6] == 0); /* past the saved padding */
  /* Out of range asks are refused, not read. */
  assert_true(fsdp_checkpoint_read_elements(r, 1, 0, 0, 1, got, &st) < 0);
  assert_true(fsdp_checkpoint_read_elements(r, 0, 1, 0, 1, got, &st) < 0);
  assert_true(fsdp_checkpoint_read_elements(r, 0, 0, 2, UINT64_MAX, NULL, &st) < 0);
  fsdp_checkpoint_close(r);
}

/* Each value of host-0.json damaged alone: DATA_LOSS naming the file and the key. */
static void test_host_file_values_of_the_wrong_type_or_size(void **state) {
  (void)state;
  static const struct {
    const char *path, *value, *words;
  } cases[] = {
      {"units", "5", "key 'units'"},
      {"units", "{}", "key 'units'"},
      {"units.0", "7", "units[0]: not an object"},
      {"units.0.name", "[]", "key 'name'"},
      {"units.0.name", NULL, "key 'name'"},
      {"units.0.strategy", "1", "key 'strategy'"},
      {"units.0.blocks", "5", "key 'blocks'"},
      {"units.0.blocks", "{\"a\": 1}", "key 'blocks'"},
      {"units.0.blocks", "[]", "key 'blocks'"},
      {"units.0.blocks", "[{}, {}, {}, {}, {}]", "key 'blocks'"},
      {"units.0.blocks.0", "\"x\"", "blocks[0]"},
      {"units.0.blocks.0.offset", "-5", "blocks[0]"},
      {"units.0.blocks.0.offset", "1.5", "blocks[0]"},
      {"units.0.blocks.0.offset", "8", "'offset' + 'bytes' (8 + 24) is past the end"},
      {"units.0.blocks.0.offset", "18446744073709551600", "'offset' + 'bytes'"},
      {"units.0.blocks.0.bytes", "4611686018427387904", "'bytes' is 4611686018427387904"},
      {"units.0.blocks.0.xxh64", "\"abc\"", "blocks[0]"},
      {"units.0.params", "5", "key 'params'"},
      {"units.0.params", NULL, "key 'params'"},
      {"units.0.params.0", "[]", "params[0] is not an object"},
      {"units.0.params.0.name", "5", "params[0]: key 'name'"},
      {"units.0.params.0.shape", "7", "parameter 'p0': key 'shape'"},
      {"units.0.params.0.shape", "{}", "parameter 'p0': key 'shape'"},
      {"units.0.params.0.shape.0", "-1", "'shape'[0]"},
      {"units.0.params.0.shape.0", "\"a\"", "'shape'[0]"},
      {"units.0.params.0.shape.0", "9223372036854775808", "'shape'[0]"},
      {"units.0.params.0.shape",
       "[4294967296, 4294967296, 4294967296]", "the nonzero dimensions of 'shape' is past"},
      {"units.0.params.0.shape", "[9223372036584775808, 0]", "nonzero dimensions"},
      {"units.0.params.0.shape", "[3, 3]", "lie past the unit's 6 ('numel')"},
      {"units.0.params.0.shape",
       "[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,"
       "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]", "at most 64 dimensions"},
      {"units.0.params.1.offset", "5", "lie past the unit's 6"},
      {"units.0.params.1.offset", "-1", "key 'offset'"},
      {"units.0.params.1.dtype", "[]", "key 'dtype'"},
      {"units.0.numel", "4611686018427387904", "key 'numel'"},
      {"units.0.numel", "-6", "key 'numel'"},
      {"units.0.numel", "\"6\"", "key 'numel'"},
      {"units.0.numel", "7", "or that is less than 'numel'"},
      {"units.0.padded_numel", "8", "is not 'padded_numel'"},
      {"units.0.shard_numel", "2305843009213693952", "'shards' x 'shard_numel'"},
      {"units.0.shards", "4294967296", "key 'shards'"},
      {"units.0.host_first_shard", "1", "'host_first_shard' + 'host_shards' (1 + 2)"},
      {"units.0.host_shards", "1", "'bytes' is 24, expected 12"},
      {"units.0.optimizer_steps", "-1", "key 'optimizer_steps'"},
      {"host", "\"0\"", "key 'host'"},
      {"host", "1", "it is host 1 of 1"},
      {"hosts", "2", "it is host 0 of 2"},
  };
  char dir[128];
  step_dir(dir, sizeof dir, "step-1");
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    write_checkpoint(dir, "j", 1);
    json_object *h = host_json();
    set_path(h, cases[i].path, cases[i].value);
    write_json(dir, "host-0.json", h);
    assert_data_loss(dir, "step-1/host-0.json", cases[i].words);
  }
  /* A unit listed twice; a unit whose elements no file holds. */
  json_object *h = host_json(), *units;
  json_object_object_get_ex(h, "units", &units);
  json_object_array_add(units, json_object_get(json_object_array_get_idx(units, 0)));
  write_json(dir, "host-0.json", h);
  assert_data_loss(dir, "host-0.json", "unit 'u': listed twice");
  h = host_json();
  set_path(h, "units.0.host_shards", "1");
  set_path(h, "units.0.blocks.0.bytes", "12");
  write_json(dir, "host-0.json", h);
  assert_data_loss(dir, "step-1", "no host's file holds element 3 of unit 'u'");
  /* Not JSON, or nested past any checkpoint's depth. */
  write_file(dir, "host-0.json", "{\"units\": [", 11);
  assert_data_loss(dir, "host-0.json", "is not JSON");
  write_file(dir, "host-0.json", "[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]", 40);
  assert_data_loss(dir, "host-0.json", "is not JSON");
}

/* manifest.json's values: steps that are not non-negative integers among them. */
static void test_manifest_values_of_the_wrong_type(void **state) {
  (void)state;
  static const struct {
    const char *path, *value, *words;
  } cases[] = {
      {"step", "-5", "key 'step'"},
      {"step", "\"abc\"", "key 'step'"},
      {"step", "1.5", "key 'step'"},
      {"step", "18446744073709551616", "key 'step'"}, /* read by json-c as 2^64 - 1 */
      {"step", "1e3", "key 'step'"},
      {"step", NULL, "key 'step'"},
      {"hosts", "0", "key 'hosts' is 0"},
      {"hosts", "5000", "key 'hosts' is 5000"},
      {"hosts", "[]", "key 'hosts'"},
      {"format", "\"1\"", "key 'format'"},
      {"job", "5", "key 'job'"},
      {"uid", "-1", "key 'uid'"},
  };
  char dir[128];
  step_dir(dir, sizeof dir, "step-1");
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    write_checkpoint(dir, "j", 1);
    json_object *m = manifest_json("j", 1);
    set_path(m, cases[i].path, cases[i].value);
    write_json(dir, "manifest.json", m);
    assert_data_loss(dir, "step-1/manifest.json", cases[i].words);
  }
  /* A manifest one byte short of JSON is not a checkpoint's either. */
  write_file(dir, "manifest.json", "{", 1);
  assert_data_loss(dir, "manifest.json", "is not JSON");
}

/* A FIFO, a link to /dev/zero, a link to a good file, or a directory in place of each file:
 * refused at once, never read from or waited on. */
static void test_files_that_are_not_regular_files(void **state) {
  (void)state;
  static const char *const files[] = {"manifest.json", "host-0.json", "host-0.bin"};
  char dir[128], path[256], good[256];
  step_dir(dir, sizeof dir, "step-1");
  for (size_t i = 0; i < 3; i++) {
    for (int kind = 0; kind < 4; kind++) {
      write_checkpoint(dir, "j", 1);
      snprintf(path, sizeof path, "%s/%s", dir, files[i]);
      snprintf(good, sizeof good, "%s/good-copy", root);
      unlink(good);
      assert_int_equal(rename(path, good), 0);
      int r = kind == 0   ? mkfifo(path, 0644)
              : kind == 1 ? symlink("/dev/zero", path)
              : kind == 2 ? symlink(good, path)
                          : mkdir(path, 0755);
      assert_int_equal(r, 0);
      assert_data_loss(dir, files[i], kind == 0 || kind == 3 ? "not a regular file"
                                                             : "a symbolic link");
      if (kind == 3)
        rmdir(path);
      else
        unlink(path);
    }
  }
  write_checkpoint(dir, "j", 1);
}

/* The newest complete checkpoint of the job's: another job's huge step in the same
 * directory is not it, nor a step directory whose manifest says another step or none. */
static void test_the_newest_checkpoint_is_the_jobs_own(void **state) {
  (void)state;
  char dir[128];
  step_dir(dir, sizeof dir, "step-1");
  write_checkpoint(dir, "j", 1);
  step_dir(dir, sizeof dir, "step-18446744073709551614");
  write_checkpoint(dir, "other", UINT64_MAX - 1);
  step_dir(dir, sizeof dir, "step-5");
  write_checkpoint(dir, "j", 5);
  json_object *m = manifest_json("j", 5);
  set_path(m, "step", "-5");
  write_json(dir, "manifest.json", m);
  step_dir(dir, sizeof dir, "step-7");
  write_checkpoint(dir, "j", 7);
  write_json(dir, "manifest.json", manifest_json("j", 70)); /* not step-7's */
  fsdp_checkpoint_reader_t *r;
  fsdp_status_t st = FSDP_STATUS_INIT;
  assert_int_equal(fsdp_checkpoint_open(root, "j", &r, &st), 0);
  assert_int_equal(fsdp_checkpoint_step(r), 1);
  fsdp_checkpoint_close(r);
  assert_int_equal(fsdp_checkpoint_open(root, NULL, &r, &st), 0);
  assert_string_equal(fsdp_checkpoint_job(r), "other");
  fsdp_checkpoint_close(r);
  assert_int_equal(open_code(root, "nobody", &st), FSDP_E_NOT_FOUND);
  assert_non_null(strstr(st.message, "of job 'nobody'"));
  step_dir(dir, sizeof dir, "step-5");
  assert_data_loss(dir, "step-5/manifest.json", "key 'step'");
  /* A relative path, or one through "..": refused, not resolved. */
  assert_int_equal(open_code("relative/dir", "j", &st), FSDP_E_INVALID_ARGUMENT);
  char up[160];
  snprintf(up, sizeof up, "%s/step-1/..", root);
  assert_int_equal(open_code(up, "j", &st), FSDP_E_INVALID_ARGUMENT);
}

static fsdp_checkpoint_job_t load_job(float *into, const atomic_int *stopping) {
  static fsdp_checkpoint_unit_t unit;
  unit = (fsdp_checkpoint_unit_t){.name = "u",
                                  .numel = 6,
                                  .padded_numel = 6,
                                  .shard_numel = 3,
                                  .shards = 2,
                                  .host_shards = 2,
                                  .masters = into};
  return (fsdp_checkpoint_job_t){.job = "j", .uid = 1000, .hosts = 1, .optimizer = "",
                                 .stopping = stopping, .units = &unit, .n_units = 1};
}

static int load(const fsdp_checkpoint_job_t *job, fsdp_status_t *st) {
  fsdp_checkpoint_loaded_t loaded;
  alarm(DEADLINE_S);
  int code = fsdp_checkpoint_load(root, job, &loaded, st);
  alarm(0);
  return code;
}

/* same_uid_only: a checkpoint of another uid, or of none, is refused; a stop abandons. */
static void test_a_load_keeps_to_the_uid_and_gives_up_at_a_stop(void **state) {
  (void)state;
  char dir[128];
  step_dir(dir, sizeof dir, "step-1");
  write_checkpoint(dir, "j", 1);
  float into[6] = {0};
  fsdp_status_t st = FSDP_STATUS_INIT;
  fsdp_checkpoint_job_t job = load_job(into, NULL);
  job.same_uid_only = true;
  assert_int_equal(load(&job, &st), 0);
  assert_memory_equal(into, masters, sizeof masters);
  job.uid = 1001;
  assert_int_equal(load(&job, &st), FSDP_E_PERMISSION_DENIED);
  assert_non_null(strstr(st.message, "saved by uid 1000, not job 'j''s uid 1001"));
  json_object *m = manifest_json("j", 1);
  set_path(m, "uid", NULL);
  write_json(dir, "manifest.json", m);
  assert_int_equal(load(&job, &st), FSDP_E_PERMISSION_DENIED);
  assert_non_null(strstr(st.message, "names no uid"));
  job.same_uid_only = false;
  assert_int_equal(load(&job, &st), 0);

  atomic_int stopping = FSDP_CHECKPOINT_ABANDON;
  job = load_job(into, &stopping);
  assert_int_equal(load(&job, &st), FSDP_E_ABORTED);
  assert_non_null(strstr(st.message, "abandoned"));
}

static int load_into(const char *dir, const fsdp_checkpoint_job_t *job,
                     fsdp_checkpoint_loaded_t *ret, fsdp_status_t *st) {
  alarm(DEADLINE_S);
  int code = fsdp_checkpoint_load(dir, job, ret, st);
  alarm(0);
  return code;
}

/* A caller's load (its rights guard the files) takes another job's checkpoint that it names
 * (a new launch is a new job), and under a directory the job's own first, else the newest
 * of another's; a load with the daemon's rights (own_job_only) keeps to the job's own. */
static void test_a_load_takes_another_jobs_checkpoint_where_the_caller_names_it(void **state) {
  (void)state;
  char dir[128];
  step_dir(dir, sizeof dir, "step-3");
  write_checkpoint(dir, "old-run", 3);
  float into[6] = {0};
  fsdp_status_t st = FSDP_STATUS_INIT;
  fsdp_checkpoint_loaded_t loaded;
  fsdp_checkpoint_job_t job = load_job(into, NULL);
  assert_int_equal(load_into(dir, &job, &loaded, &st), 0);
  assert_string_equal(loaded.job, "old-run");
  assert_int_equal(loaded.step, 3);
  assert_memory_equal(into, masters, sizeof masters);
  memset(into, 0, sizeof into);
  assert_int_equal(load_into(root, &job, &loaded, &st), 0); /* only another's: its newest */
  assert_string_equal(loaded.job, "old-run");
  assert_string_equal(loaded.path, dir);
  step_dir(dir, sizeof dir, "step-2");
  write_checkpoint(dir, "j", 2);
  assert_int_equal(load_into(root, &job, &loaded, &st), 0); /* the job's own first */
  assert_string_equal(loaded.job, "j");
  assert_int_equal(loaded.step, 2);

  job.own_job_only = true;
  step_dir(dir, sizeof dir, "step-3");
  assert_int_equal(load_into(dir, &job, &loaded, &st), FSDP_E_FAILED_PRECONDITION);
  assert_non_null(strstr(st.message, "is of job 'old-run', not 'j'"));
  assert_int_equal(load_into(root, &job, &loaded, &st), 0);
  assert_int_equal(loaded.step, 2);
  step_dir(dir, sizeof dir, "step-2");
  write_json(dir, "manifest.json", manifest_json("other", 2));
  assert_int_equal(load_into(root, &job, &loaded, &st), FSDP_E_NOT_FOUND);
  assert_non_null(strstr(st.message, "no complete checkpoint of job 'j'"));
}

/* The optimizer's state loads where both have it; a checkpoint's state a job has no room
 * for is left out, and a job's state the checkpoint lacks starts at zero, step 0; another
 * optimizer's arrays are refused. */
static void test_optimizer_state_loads_into_a_job_with_or_without_it(void **state) {
  (void)state;
  char dir[128];
  step_dir(dir, sizeof dir, "step-1");
  write_checkpoint(dir, "j", 1); /* no optimizer state */
  float into[6] = {0}, m1[6], m2[6];
  uint64_t steps = 7;
  for (int i = 0; i < 6; i++)
    m1[i] = m2[i] = 9;
  fsdp_status_t st = FSDP_STATUS_INIT;
  fsdp_checkpoint_loaded_t loaded;
  fsdp_checkpoint_job_t job = load_job(into, NULL);
  fsdp_checkpoint_unit_t *u = (fsdp_checkpoint_unit_t *)job.units;
  u->arrays = 2;
  u->state[0] = m1;
  u->state[1] = m2;
  u->steps = &steps;
  assert_int_equal(load_into(dir, &job, &loaded, &st), 0);
  assert_memory_equal(into, masters, sizeof masters);
  const float zeros[6] = {0};
  assert_memory_equal(m1, zeros, sizeof zeros);
  assert_memory_equal(m2, zeros, sizeof zeros);
  assert_int_equal(steps, 0);
  assert_int_equal(loaded.state_zeroed, 1);
  assert_false(loaded.optimizer_state);

  /* A checkpoint with one array of state (SGD's momentum). */
  float both[12];
  memcpy(both, masters, sizeof masters);
  for (int i = 0; i < 6; i++)
    both[6 + i] = 0.5f * (float)i;
  write_file(dir, "host-0.bin", both, sizeof both);
  json_object *h = host_json();
  char block[160];
  snprintf(block, sizeof block,
           "{\"what\": \"state0\", \"offset\": 24, \"bytes\": 24, \"xxh64\": %llu}",
           (unsigned long long)XXH64(both + 6, 24, 0));
  set_path(h, "units.0.blocks.1", block);
  write_json(dir, "host-0.json", h);
  assert_int_equal(load_into(dir, &job, &loaded, &st), FSDP_E_FAILED_PRECONDITION);
  assert_non_null(strstr(st.message, "holds 1 arrays of optimizer state, the job's optimizer 2"));
  u->arrays = 0;
  u->steps = NULL;
  memset(into, 0, sizeof into);
  assert_int_equal(load_into(dir, &job, &loaded, &st), 0);
  assert_memory_equal(into, masters, sizeof masters);
  assert_int_equal(loaded.state_left_out, 1);
  assert_true(loaded.optimizer_state);
  u->arrays = 1;
  u->steps = &steps;
  assert_int_equal(load_into(dir, &job, &loaded, &st), 0);
  assert_memory_equal(m1, both + 6, 6 * sizeof(float));
  assert_int_equal(steps, 1);
  assert_int_equal(loaded.state_left_out + loaded.state_zeroed, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_a_whole_checkpoint_reads_back, set_up, tear_down),
      cmocka_unit_test_setup_teardown(test_host_file_values_of_the_wrong_type_or_size, set_up,
                                      tear_down),
      cmocka_unit_test_setup_teardown(test_manifest_values_of_the_wrong_type, set_up,
                                      tear_down),
      cmocka_unit_test_setup_teardown(test_files_that_are_not_regular_files, set_up,
                                      tear_down),
      cmocka_unit_test_setup_teardown(test_the_newest_checkpoint_is_the_jobs_own, set_up,
                                      tear_down),
      cmocka_unit_test_setup_teardown(test_a_load_keeps_to_the_uid_and_gives_up_at_a_stop,
                                      set_up, tear_down),
      cmocka_unit_test_setup_teardown(
          test_a_load_takes_another_jobs_checkpoint_where_the_caller_names_it, set_up,
          tear_down),
      cmocka_unit_test_setup_teardown(test_optimizer_state_loads_into_a_job_with_or_without_it,
                                      set_up, tear_down),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
