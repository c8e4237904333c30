/* Writing checkpoints (checkpoint/checkpoint.h): JSON by json-c, checksums by XXH64
 * (libxxhash), every write made durable before the next step of the protocol depends on it. */
#include "checkpoint/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <json-c/json.h>
#include <xxhash.h>

#include "checkpoint/files.h"
#include "common/clock.h"
#include "common/dirs.h"
#include "common/failpoint.h"
#include "common/io.h"

#define WAIT_POLL_MS 20

/* A file of blocks written front to back, with direct I/O where the filesystem has it
 * (O_DIRECT): the disk reads the blocks from the caller's memory, with no copy into the
 * page cache and none of its writeback to pay for, half a save's CPU time
 * (bench/checkpoint_bench.py). Each block then starts on a DIRECT_ALIGN boundary of the file
 * (the gap is zeros), written straight from the caller's buffer when that is aligned too
 * (staging is), its unaligned tail through an aligned bounce buffer.
 *
 * Elsewhere (or once the filesystem refuses a direct write) it goes through the page cache,
 * each chunk's writeback started once it is written and a chunk WRITEBACK_LAG bytes behind
 * waited for and dropped: the disk works while later chunks are copied and hashed, the final
 * fsync finds little left, and a save neither fills memory with dirty pages nor evicts what
 * training uses. */
#define WRITEBACK_LAG ((off_t)32 << 20)

typedef struct streamed_file {
  int fd;
  bool direct;   /* O_DIRECT is on */
  char *bounce;  /* IO_CHUNK bytes, aligned: what cannot go straight from the caller's */
  off_t written; /* bytes written so far, the padding after a block's tail included */
  off_t end;     /* the end of the last block, its padding not included */
  off_t settled; /* through the page cache: bytes written back and dropped */
  uint64_t rate; /* bytes per second at most (fsdp_checkpoint_job_t.write_rate); 0: no cap */
  unsigned share; /* percent of the time the writes may take (.disk_share); 100: all */
  uint64_t opened_ns;
  uint64_t busy_ns; /* the time the writes took, their waits for the disk included */
  const atomic_int *stopping; /* fsdp_checkpoint_job_t's */
} streamed_file_t;

/* Makes name under dirfd, a new file, for a streamed write of the job's, direct where the
 * filesystem allows it. */
static int stream_open(streamed_file_t *f, int dirfd, const char *name,
                       const fsdp_checkpoint_job_t *job) {
  *f = (streamed_file_t){.fd = -1,
                         .rate = job->write_rate,
                         .share = job->disk_share && job->disk_share < 100 ? job->disk_share
                                                                           : 100,
                         .opened_ns = fsdp_clock_now_ns(),
                         .stopping = job->stopping};
  f->bounce = aligned_alloc(DIRECT_ALIGN, IO_CHUNK);
  if (!f->bounce)
    return -ENOMEM;
  f->fd = fsdp_file_open_at(dirfd, name, O_WRONLY | O_CREAT | O_EXCL, 0640);
  if (f->fd < 0)
    return f->fd;
  /* Direct once made, not at the open: a filesystem without direct I/O refuses it then
   * (EINVAL), where an open with O_DIRECT may have made the file before refusing. */
  bool refused = fsdp_failpoint("checkpoint-direct"); /* as a filesystem without it */
  int fl = fcntl(f->fd, F_GETFL);
  f->direct = !refused && fl >= 0 && fcntl(f->fd, F_SETFL, fl | O_DIRECT) == 0;
  return 0;
}

/* Closes nothing: finish_durably does. */
static void stream_cleanup(streamed_file_t *f) {
  free(f->bounce);
  f->bounce = NULL;
}

static int buffered_write(streamed_file_t *f, const void *buf, size_t len) {
  int r = fsdp_write_all(f->fd, buf, len);
  if (r < 0)
    return r;
  /* Best effort: a filesystem without these still gets everything at the fsync. */
  sync_file_range(f->fd, f->written, (off_t)len, SYNC_FILE_RANGE_WRITE);
  f->written += (off_t)len;
  if (f->written - f->settled > WRITEBACK_LAG) {
    off_t n = f->written - WRITEBACK_LAG - f->settled;
    sync_file_range(f->fd, f->settled, n,
                    SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                        SYNC_FILE_RANGE_WAIT_AFTER);
    posix_fadvise(f->fd, f->settled, n, POSIX_FADV_DONTNEED);
    f->settled += n;
  }
  return 0;
}

/* Goes on through the page cache: the filesystem refused a direct write. */
static int stop_direct(streamed_file_t *f) {
  int flags = fcntl(f->fd, F_GETFL);
  if (flags < 0 || fcntl(f->fd, F_SETFL, flags & ~O_DIRECT) < 0)
    return -errno;
  f->direct = false;
  f->settled = f->written;
  return 0;
}

/* len bytes (at most IO_CHUNK) at the file's end, direct: the aligned part of an aligned
 * buffer straight from it, the rest through the bounce buffer, padded with zeros. The next
 * write then starts aligned. */
static int direct_write(streamed_file_t *f, const char *p, size_t len) {
  size_t straight = (uintptr_t)p % DIRECT_ALIGN == 0 ? len / DIRECT_ALIGN * DIRECT_ALIGN : 0;
  int r = straight ? fsdp_write_all(f->fd, p, straight) : 0;
  size_t rest = len - straight, padded = round_up(rest, DIRECT_ALIGN);
  if (r == 0 && rest) {
    memcpy(f->bounce, p + straight, rest);
    memset(f->bounce + rest, 0, padded - rest);
    r = fsdp_write_all(f->fd, f->bounce, padded);
  }
  return r;
}

static int stream_write(streamed_file_t *f, const void *buf, size_t len) {
  if (f->direct) {
    off_t before = f->written;
    int r = fsdp_failpoint("checkpoint-direct") ? -EINVAL : direct_write(f, buf, len);
    if (r == -EINVAL) { /* alignment this filesystem will not take: start the chunk again */
      if (lseek(f->fd, before, SEEK_SET) < 0)
        return -errno;
      r = stop_direct(f);
      if (r == 0)
        return stream_write(f, buf, len);
    }
    if (r == 0)
      f->written += (off_t)round_up(len, DIRECT_ALIGN);
    return r;
  }
  return buffered_write(f, buf, len);
}

static int stop_level(const atomic_int *stopping) {
  return stopping ? atomic_load(stopping) : FSDP_CHECKPOINT_GO_ON;
}

/* How long after the file opened its writes so far are paced out: its bytes at its rate,
 * and its writes' time at its share of the time, whichever is later. */
static double paced_since_open_ns(const streamed_file_t *f) {
  double by_rate = f->rate ? (double)f->written / (double)f->rate * 1e9 : 0;
  double by_share = (double)f->busy_ns * 100 / f->share;
  return by_rate > by_share ? by_rate : by_share;
}

/* Waits until the file's writes so far are paced out (paced_since_open_ns), in slices of
 * at most 100 ms, so that a save the daemon's stop hurries goes on soon and one it abandons
 * stops soon: -ECANCELED then. */
static int pace(const streamed_file_t *f) {
  for (;;) {
    int stop = stop_level(f->stopping);
    if (stop == FSDP_CHECKPOINT_ABANDON)
      return -ECANCELED;
    if (stop == FSDP_CHECKPOINT_HURRY)
      return 0;
    double due_ns = paced_since_open_ns(f);
    double elapsed_ns = (double)(fsdp_clock_now_ns() - f->opened_ns);
    if (due_ns <= elapsed_ns)
      return 0;
    double wait_ns = due_ns - elapsed_ns < 1e8 ? due_ns - elapsed_ns : 1e8;
    struct timespec t = {.tv_nsec = (long)wait_ns};
    nanosleep(&t, NULL); /* a signal: the loop looks again */
  }
}

/* Writes len bytes and their XXH64, a chunk at a time, paced. */
static int write_hashed(streamed_file_t *f, const void *buf, size_t len,
                        XXH64_hash_t *ret_hash) {
  XXH64_state_t *h = XXH64_createState();
  if (!h)
    return -ENOMEM;
  XXH64_reset(h, 0);
  const char *p = buf;
  int r = 0;
  for (size_t done = 0; r == 0 && done < len;) {
    size_t n = len - done < IO_CHUNK ? len - done : IO_CHUNK;
    uint64_t start_ns = fsdp_clock_now_ns();
    fsdp_failpoint("checkpoint-write"); /* its sleep: a slow disk */
    r = stream_write(f, p + done, n);
    f->busy_ns += fsdp_clock_now_ns() - start_ns;
    XXH64_update(h, p + done, n);
    done += n;
    if (r == 0)
      r = pace(f);
  }
  *ret_hash = XXH64_digest(h);
  XXH64_freeState(h);
  return r;
}

/* Ends the writing of fd (r: how it went so far) at tmp under dirfd: synced, closed and
 * renamed to name; on any failure tmp goes and st names dir_path/name. */
static int finish_durably(int dirfd, const char *dir_path, int fd, int r, const char *tmp,
                          const char *name, fsdp_status_t *st) {
  if (r == 0 && fsync(fd) < 0)
    r = -errno;
  close(fd);
  if (r == 0 && renameat(dirfd, tmp, dirfd, name) < 0)
    r = -errno;
  if (r < 0) {
    unlinkat(dirfd, tmp, 0);
    char path[PATH_MAX];
    join(path, sizeof path, dir_path, "/", name);
    return io_failed(st, "writing", path, -r);
  }
  return 0;
}

/* name's bytes under dirfd made durable: written to name.tmp, fsynced, renamed. */
static int write_durably(int dirfd, const char *dir_path, const char *name, const void *data,
                         size_t len, fsdp_status_t *st) {
  char tmp[NAME_MAX + 1];
  if (!join(tmp, sizeof tmp, name, "", ".tmp"))
    return io_failed(st, "naming", name, ENAMETOOLONG);
  unlinkat(dirfd, tmp, 0); /* what a save that died left: ours (a link goes as itself) */
  int fd = fsdp_file_open_at(dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL, 0640);
  if (fd < 0)
    return io_failed(st, "creating a file in", dir_path, -fd);
  int r = fsdp_write_all(fd, data, len);
  return finish_durably(dirfd, dir_path, fd, r, tmp, name, st);
}

static int fsync_dir(int dirfd, const char *dir_path, fsdp_status_t *st) {
  return fsync(dirfd) < 0 ? io_failed(st, "syncing the directory", dir_path, errno) : 0;
}

static json_object *json_u64(uint64_t v) {
  return json_object_new_uint64(v);
}

/* Writes the units' blocks to host-<h>.bin under dirfd, hashing them as they go, and each
 * unit's metadata into the array units. */
static int write_blocks(int dirfd, const char *dir_path, const fsdp_checkpoint_job_t *job,
                        json_object *units, fsdp_status_t *st) {
  char name[32], tmp[40];
  host_file(name, sizeof name, job->host, "bin");
  snprintf(tmp, sizeof tmp, "%s.tmp", name);
  unlinkat(dirfd, tmp, 0); /* what a save that died left: ours (a link goes as itself) */
  streamed_file_t file;
  int r = stream_open(&file, dirfd, tmp, job);
  if (r < 0) {
    stream_cleanup(&file);
    return io_failed(st, "creating a file in", dir_path, -r);
  }
  for (size_t i = 0; r == 0 && i < job->n_units; i++) {
    const fsdp_checkpoint_unit_t *u = &job->units[i];
    json_object *blocks = json_object_new_array();
    for (unsigned b = 0; r == 0 && b < n_blocks(u); b++) {
      size_t bytes = host_numel(u) * sizeof(float);
      uint64_t offset = (uint64_t)file.written;
      XXH64_hash_t hash = 0;
      r = write_hashed(&file, block(u, b), bytes, &hash);
      file.end = (off_t)(offset + bytes);
      json_object *o = json_object_new_object();
      json_object_object_add(o, "what", json_object_new_string(block_name(b)));
      json_object_object_add(o, "offset", json_u64(offset));
      json_object_object_add(o, "bytes", json_u64(bytes));
      json_object_object_add(o, "xxh64", json_u64(hash));
      json_object_array_add(blocks, o);
    }
    json_object *params = json_object_new_array();
    for (size_t k = 0; k < u->n_params; k++) {
      const fsdp_checkpoint_param_t *p = &u->params[k];
      json_object *po = json_object_new_object(), *shape = json_object_new_array();
      for (size_t d = 0; d < p->ndim; d++)
        json_object_array_add(shape, json_u64(p->shape[d]));
      json_object_object_add(po, "name", json_object_new_string(p->name));
      json_object_object_add(po, "shape", shape);
      json_object_object_add(po, "offset", json_u64(p->offset));
      json_object_object_add(po, "dtype", json_object_new_string(p->dtype));
      json_object_array_add(params, po);
    }
    json_object *o = json_object_new_object();
    json_object_object_add(o, "name", json_object_new_string(u->name));
    json_object_object_add(o, "strategy", json_object_new_string(u->strategy));
    json_object_object_add(o, "params", params);
    json_object_object_add(o, "numel", json_u64(u->numel));
    json_object_object_add(o, "padded_numel", json_u64(u->padded_numel));
    json_object_object_add(o, "shard_numel", json_u64(u->shard_numel));
    json_object_object_add(o, "shards", json_u64(u->shards));
    json_object_object_add(o, "host_first_shard", json_u64(u->host_first_shard));
    json_object_object_add(o, "host_shards", json_u64(u->host_shards));
    json_object_object_add(o, "optimizer_steps", json_u64(u->steps ? *u->steps : 0));
    json_object_object_add(o, "blocks", blocks);
    json_object_array_add(units, o);
  }
  /* The last block's padding, or what a refused direct write left past it, goes: the file
   * ends where its data does. */
  if (r == 0 && ftruncate(file.fd, file.end) < 0)
    r = -errno;
  stream_cleanup(&file);
  return finish_durably(dirfd, dir_path, file.fd, r, tmp, name, st);
}

static int write_json(int dirfd, const char *dir_path, const char *name, json_object *o,
                      fsdp_status_t *st) {
  const char *text = json_object_to_json_string_ext(o, JSON_C_TO_STRING_PRETTY);
  return write_durably(dirfd, dir_path, name, text, strlen(text), st);
}

/* Removes the files whose names start with prefix from the directory open at dirfd (links
 * as themselves). */
static void remove_files(int dirfd, const char *prefix) {
  DIR *d = fsdp_dir_list(dirfd);
  if (!d)
    return;
  for (struct dirent *e; (e = readdir(d));)
    if (e->d_name[0] != '.' && strncmp(e->d_name, prefix, strlen(prefix)) == 0)
      unlinkat(dirfd, e->d_name, 0);
  closedir(d);
}

/* Host 0's wait, before it writes the manifest: every other host's metadata, written last of
 * its files, in the partial directory open at dirfd (dir_path). DEADLINE_EXCEEDED names the
 * hosts missing; a stop abandons it. */
static int wait_for_hosts(int dirfd, const char *dir_path, const fsdp_checkpoint_job_t *job,
                          fsdp_status_t *st) {
  for (uint64_t waited = 0;; waited += WAIT_POLL_MS) {
    if (stop_level(job->stopping) == FSDP_CHECKPOINT_ABANDON)
      return io_failed(st, "waiting for the other hosts' files in", dir_path, ECANCELED);
    char missing[256] = "";
    size_t len = 0;
    for (unsigned h = 1; h < job->hosts; h++) {
      char name[32];
      struct stat s;
      host_file(name, sizeof name, h, "json");
      if (fstatat(dirfd, name, &s, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(s.st_mode))
        continue;
      if (len < sizeof missing)
        len += (size_t)snprintf(missing + len, sizeof missing - len, "%s%u", len ? ", " : "",
                                h);
    }
    if (!missing[0])
      return 0;
    if (waited >= job->hosts_wait_ms)
      return fsdp_status_set(st, FSDP_E_DEADLINE_EXCEEDED,
                             "checkpoint: the files of host(s) %s did not appear in %s within "
                             "%" PRIu64 " ms (the checkpoint's directory must be shared by "
                             "every host, and each saves the same step)",
                             missing, dir_path, job->hosts_wait_ms);
    struct timespec t = {.tv_nsec = WAIT_POLL_MS * 1000000L};
    nanosleep(&t, NULL);
  }
}

/* A job's name as a checkpoint records it and as its partial directories carry it: the
 * characters of the daemon's job names ([A-Za-z0-9._-]), not "." or "..". */
static bool job_name_ok(const char *job) {
  size_t n = strlen(job);
  if (n == 0 || n > FSDP_CHECKPOINT_JOB_MAX || strcmp(job, ".") == 0 || strcmp(job, "..") == 0)
    return false;
  for (const char *p = job; *p; p++)
    if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
          *p == '.' || *p == '_' || *p == '-'))
      return false;
  return true;
}

/* "step-<S>.<job>.partial": where the job's save of step S is written until complete. Each
 * job's are its own, so that a save never takes up what another job's left. */
static void partial_name(char *buf, size_t size, uint64_t step, const char *job) {
  snprintf(buf, size, "step-%" PRIu64 ".%s.partial", step, job);
}

/* Whether the step directory `name` under dirfd may be replaced by the job's save: it is
 * missing, or a complete checkpoint of the same job. 0, or FAILED_PRECONDITION naming whose
 * it is. */
static int replaceable(int dirfd, const char *dir_path, const char *name,
                       const fsdp_checkpoint_job_t *job, fsdp_status_t *st) {
  int fd = fsdp_dir_open_at(dirfd, name, false, 0, NULL);
  if (fd == -ENOENT)
    return 0;
  if (fd < 0)
    return fsdp_status_set(st, fd == -EACCES ? FSDP_E_PERMISSION_DENIED
                                             : FSDP_E_FAILED_PRECONDITION,
                           "checkpoint: %s/%s is there and is %s: a save replaces only a "
                           "complete checkpoint of its own job",
                           dir_path, name, fsdp_dirs_strerror(-fd));
  manifest_t m;
  fsdp_status_t why;
  int r = read_manifest(fd, name, &m, &why);
  close(fd);
  if (r < 0 || strcmp(m.job, job->job) != 0)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "checkpoint: %s/%s is %s%s%s: a save replaces only a complete "
                           "checkpoint of its own job ('%s')",
                           dir_path, name, r < 0 ? "no checkpoint (" : "job '",
                           r < 0 ? why.message : m.job, r < 0 ? ")" : "''s", job->job);
  if (!m.has_uid || m.uid != job->uid)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "checkpoint: %s/%s is of a job '%s' of %s, not of uid %" PRIu64
                           ": a save replaces only a complete checkpoint of its own job",
                           dir_path, name, m.job, m.has_uid ? "another uid" : "no known uid",
                           job->uid);
  return 0;
}

/* What a save of this host that died left in the partial directory `name` under dirfd: all
 * of it with one host, this host's files with several (the others' are theirs). */
static int clear_partial(int dirfd, const char *dir_path, const char *name,
                         const fsdp_checkpoint_job_t *job, fsdp_status_t *st) {
  int r;
  if (job->hosts == 1) {
    r = fsdp_dir_remove_at(dirfd, name);
  } else {
    char own[32];
    snprintf(own, sizeof own, "host-%u.", job->host);
    int fd = fsdp_dir_open_at(dirfd, name, false, 0, NULL);
    if (fd >= 0) {
      remove_files(fd, own);
      close(fd);
    }
    r = fd;
  }
  if (r < 0 && r != -ENOENT) {
    char path[PATH_MAX];
    join(path, sizeof path, dir_path, "/", name);
    return io_failed(st, "clearing", path, -r);
  }
  return 0;
}

/* The complete save at `partial` under dirfd takes the place of the step directory `name`
 * that is there, in one step (RENAME_EXCHANGE), if that is a complete checkpoint of the
 * same job: looked at again now, as another job's save may have put its own there since
 * this one began, and once more after the swap (the displaced one, now at `partial`), which
 * a save that came in between is undone for. */
static int swap_in(int dirfd, const char *dir, const char *partial, const char *name,
                   const fsdp_checkpoint_job_t *job, fsdp_status_t *st) {
  int r = replaceable(dirfd, dir, name, job, st);
  if (r < 0)
    return r;
  if (renameat2(dirfd, partial, dirfd, name, RENAME_EXCHANGE) < 0)
    return io_failed(st, "renaming into", name, errno);
  if ((r = replaceable(dirfd, dir, partial, job, st)) < 0)
    (void)renameat2(dirfd, partial, dirfd, name, RENAME_EXCHANGE); /* theirs back */
  return r;
}

static void keep_newest(int dirfd, const fsdp_checkpoint_job_t *job, unsigned keep);
static void remove_unfinished_below(int dirfd, const char *job, uint64_t below);

/* This host's part of the checkpoint into the partial directory open at pfd (partial_path),
 * and on host 0 the manifest once every host's part is there. */
static int write_part(int pfd, const char *partial_path, const fsdp_checkpoint_job_t *job,
                      fsdp_status_t *st) {
  char name[32];
  json_object *host = json_object_new_object(), *units = json_object_new_array();
  json_object_object_add(host, "format", json_u64(FSDP_CHECKPOINT_FORMAT));
  json_object_object_add(host, "job", json_object_new_string(job->job));
  json_object_object_add(host, "host", json_u64(job->host));
  json_object_object_add(host, "hosts", json_u64(job->hosts));
  json_object_object_add(host, "step", json_u64(job->step));
  json_object_object_add(host, "optimizer", json_object_new_string(job->optimizer));
  json_object_object_add(host, "units", units);

  /* This host's metadata after its blocks: once it is there, the host's part is whole. */
  int r = write_blocks(pfd, partial_path, job, units, st);
  fsdp_failpoint("checkpoint-blocks");
  host_file(name, sizeof name, job->host, "json");
  if (r == 0)
    r = write_json(pfd, partial_path, name, host, st);
  json_object_put(host);
  if (r < 0 || job->host != 0) /* host 0 completes the checkpoint */
    return r;
  r = wait_for_hosts(pfd, partial_path, job, st);
  /* The manifest last: until it is there, the directory is no checkpoint. */
  json_object *manifest = json_object_new_object(), *files = json_object_new_array();
  json_object_object_add(manifest, "format", json_u64(FSDP_CHECKPOINT_FORMAT));
  json_object_object_add(manifest, "job", json_object_new_string(job->job));
  json_object_object_add(manifest, "uid", json_u64(job->uid));
  json_object_object_add(manifest, "step", json_u64(job->step));
  json_object_object_add(manifest, "hosts", json_u64(job->hosts));
  for (unsigned h = 0; h < job->hosts; h++)
    for (int k = 0; k < 2; k++) {
      host_file(name, sizeof name, h, k ? "bin" : "json");
      json_object_array_add(files, json_object_new_string(name));
    }
  json_object_object_add(manifest, "files", files);
  if (r == 0)
    r = write_json(pfd, partial_path, MANIFEST, manifest, st);
  json_object_put(manifest);
  return r;
}

int fsdp_checkpoint_save(const char *dir, const fsdp_checkpoint_job_t *job, unsigned keep,
                         char *ret_path, size_t size, fsdp_status_t *st) {
  if (!job_name_ok(job->job))
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "checkpoint: job name '%.64s' is not one a checkpoint records "
                           "(1 to %d of [A-Za-z0-9._-])",
                           job->job, FSDP_CHECKPOINT_JOB_MAX);
  char name[32], partial[NAME_MAX + 1], final_path[PATH_MAX], partial_path[PATH_MAX];
  snprintf(name, sizeof name, "step-%" PRIu64, job->step);
  partial_name(partial, sizeof partial, job->step, job->job);
  if (!join(final_path, sizeof final_path, dir, "/", name) ||
      !join(partial_path, sizeof partial_path, dir, "/", partial))
    return io_failed(st, "naming the checkpoint under", dir, ENAMETOOLONG);
  int root = fsdp_dir_open(dir, true, 0750);
  if (root < 0)
    return io_failed(st, "opening", dir, -root);
  int pfd = -1, r = replaceable(root, dir, name, job, st);
  if (r == 0)
    r = clear_partial(root, dir, partial, job, st);
  if (r == 0 && (pfd = fsdp_dir_open_at(root, partial, true, 0750, NULL)) < 0)
    r = io_failed(st, "making", partial_path, -pfd);
  fsdp_failpoint("checkpoint-begun");
  if (r == 0)
    r = write_part(pfd, partial_path, job, st);
  if (r == 0)
    r = fsync_dir(pfd, partial_path, st);
  if (pfd >= 0)
    close(pfd);
  if (job->host != 0) {
    close(root);
    if (r == 0)
      snprintf(ret_path, size, "%s", final_path);
    return r;
  }
  fsdp_failpoint("checkpoint-written");
  /* A checkpoint of the same step (the job's own: replaceable) is swapped for this one in
   * one step (the old one then has the partial name, and goes): there is no moment without
   * one of them complete. */
  if (r == 0 && renameat2(root, partial, root, name, RENAME_NOREPLACE) < 0)
    r = errno == EEXIST ? swap_in(root, dir, partial, name, job, st)
                        : io_failed(st, "renaming", partial_path, errno);
  fsdp_failpoint("checkpoint-renamed");
  if (r == 0)
    r = fsync_dir(root, dir, st);
  if (r == 0 || job->hosts == 1)
    fsdp_dir_remove_at(root, partial); /* the replaced checkpoint, or what failed */
  if (r == 0) {
    /* Saves of older steps that died can no longer complete: every host's save of the job
     * runs after the one before it ended, and they all wrote this step. */
    remove_unfinished_below(root, job->job, job->step);
    if (keep)
      keep_newest(root, job, keep);
    snprintf(ret_path, size, "%s", final_path);
  }
  close(root);
  return r;
}

/* Removes the job's step-<S>.<job>.partial/ under dirfd for every S below `below`. */
static void remove_unfinished_below(int dirfd, const char *job, uint64_t below) {
  DIR *d = fsdp_dir_list(dirfd);
  if (!d)
    return;
  char suffix[NAME_MAX + 1];
  snprintf(suffix, sizeof suffix, ".%s.partial", job);
  for (struct dirent *e; (e = readdir(d));) {
    uint64_t step;
    if (parse_step_name(e->d_name, suffix, &step) && step < below)
      fsdp_dir_remove_at(dirfd, e->d_name); /* a link or a file in its place stays */
  }
  closedir(d);
}

void fsdp_checkpoint_remove_unfinished(const char *dir, const char *job) {
  int fd = job_name_ok(job) ? fsdp_dir_open(dir, false, 0) : -EINVAL;
  if (fd < 0)
    return;
  remove_unfinished_below(fd, job, UINT64_MAX);
  close(fd);
}

/* Removes all but the newest `keep` complete checkpoints of the job (its name and uid) under
 * dirfd (best effort: a save has already succeeded); other jobs' stay. */
static void keep_newest(int dirfd, const fsdp_checkpoint_job_t *job, unsigned keep) {
  uint64_t *steps = NULL;
  size_t n = complete_steps_of(dirfd, job->job, job->uid, &steps);
  if (n <= keep) {
    free(steps);
    return;
  }
  qsort(steps, n, sizeof *steps, steps_descending);
  char name[32];
  for (size_t i = keep; i < n; i++) {
    snprintf(name, sizeof name, "step-%" PRIu64, steps[i]);
    fsdp_dir_remove_at(dirfd, name);
  }
  free(steps);
}
