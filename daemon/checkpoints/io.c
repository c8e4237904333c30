/* A checkpoint's work on libuv's pool threads, with the rights its files are used with:
 * the job's staging memory, a load's read and its copy into the job's memory, a save's
 * snapshot and its write by a thread of the lowest priority. */
#include "daemon/checkpoints/internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <xxhash.h>

#include "checkpoint/checkpoint.h"
#include "common/clock.h"
#include "common/failpoint.h"
#include "common/identity.h"

/* The job's memory, the backend's, to or from staging, the host's: in the queue's turn, or
 * beside it. */
static int copy_by_backend(void *backend, void *dst, const void *src, size_t bytes,
                           fsdp_status_t *st) {
  return fsdp_backend_copy(backend, dst, src, bytes, st);
}

static int copy_beside(void *backend, void *dst, const void *src, size_t bytes,
                       fsdp_status_t *st) {
  return fsdp_backend_copy_beside(backend, dst, src, bytes, st);
}

/* Staging memory lies in transparent huge pages where the kernel gives them: a direct
 * write then pins one page per 2 MiB, not 512, which takes a quarter of the kernel's CPU
 * time per save (and the copies miss the TLB less). */
#define STAGING_ALIGN ((size_t)2 << 20)

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* The job's staging memory is kept for the next checkpoint: a save's snapshot, or what a
 * load reads before it goes into the job's memory. Made faulted in (MADV_POPULATE_WRITE,
 * Linux 5.14), several times faster than the copies' first touches of each page. */
void *ck_alloc_staging(size_t *bytes) {
  *bytes = (*bytes + STAGING_ALIGN - 1) / STAGING_ALIGN * STAGING_ALIGN;
  void *at = aligned_alloc(STAGING_ALIGN, *bytes); /* checkpoint.h's too */
  if (at) { /* best effort: faulted in at once, where the kernel can */
    madvise(at, *bytes, MADV_HUGEPAGE);
    madvise(at, *bytes, MADV_POPULATE_WRITE);
  }
  return at;
}

void *ck_staging(fsdp_job_t *job, checkpoint_work_t *c) {
  fsdp_job_checkpoints_t *ck = job->checkpoints; /* made by the work's start */
  size_t bytes = fsdp_checkpoint_staging_bytes(c->units, c->job.n_units);
  if (bytes > ck->staging_bytes) {
    free(ck->staging);
    ck->staging_bytes = 0;
    ck->staging = ck_alloc_staging(&bytes);
    if (!ck->staging) {
      fsdp_status_set(&c->st, FSDP_E_RESOURCE_EXHAUSTED,
                      "checkpoint: no memory for the %zu bytes of its staging", bytes);
      return NULL;
    }
    ck->staging_bytes = bytes;
  }
  return ck->staging;
}

/* This thread takes the rights c's files are used with (see as_daemon); false, with c->st
 * set, where the daemon may not take them. */
static bool enter_identity(checkpoint_work_t *c, fsdp_identity_t *ret_saved) {
  if (c->as_daemon) {
    fsdp_identity_self(ret_saved);
    return true;
  }
  int r = fsdp_identity_enter(&c->as, ret_saved);
  if (r == 0)
    return true;
  fsdp_status_set(&c->st, FSDP_E_PERMISSION_DENIED,
                  "checkpoint: %s: the daemon cannot act with the rights of uid %u (%s), and "
                  "uses no rights of its own for a caller's path: name a directory under "
                  "checkpoint.dir/%s/",
                  c->dir, (unsigned)c->as.uid,
                  r == -EPERM ? "it runs without the privilege to" : strerror(-r),
                  c->owner->name);
  return false;
}

void ck_read_load(uv_work_t *req) {
  checkpoint_work_t *c = req->data;
  uint64_t start_ns = fsdp_clock_now_ns();
  size_t n = c->job.n_units;
  void *at = ck_staging(c->owner, c);
  fsdp_identity_t saved;
  if (!at || !enter_identity(c, &saved))
    return;
  fsdp_failpoint("checkpoint-load"); /* its sleep: a slow disk */
  c->staged = malloc((n ? n : 1) * sizeof *c->staged);
  if (c->staged) {
    memcpy(c->staged, c->units, n * sizeof *c->staged);
    fsdp_checkpoint_job_t into = c->job;
    into.units = c->staged;
    if (fsdp_checkpoint_stage(c->staged, n, at, NULL, NULL, &c->st) == 0 &&
        fsdp_checkpoint_load(c->dir, &into, &c->loaded, &c->st) == 0) {
      snprintf(c->path, sizeof c->path, "%s", c->loaded.path);
      c->step = c->loaded.step;
      fsdp_status_clear(&c->st);
    }
  } else {
    fsdp_status_set(&c->st, FSDP_E_RESOURCE_EXHAUSTED, "checkpoint: out of memory");
  }
  fsdp_identity_leave(&saved);
  c->snapshot_ns = fsdp_clock_now_ns() - start_ns;
}

void ck_copy_load(void *arg) {
  checkpoint_work_t *c = arg;
  size_t n = c->job.n_units;
  uint64_t start_ns = fsdp_clock_now_ns();
  if (fsdp_checkpoint_unstage(c->staged, c->units, n, copy_by_backend, &c->cp->dp->backend,
                              &c->st) == 0 &&
      (c->loaded_steps = calloc(n ? n : 1, sizeof *c->loaded_steps)))
    for (size_t i = 0; i < n; i++)
      c->loaded_steps[i] = c->staged[i].steps ? *c->staged[i].steps : 0;
  c->snapshot_ns += fsdp_clock_now_ns() - start_ns;
}

void ck_take_snapshot(uv_work_t *req) {
  checkpoint_work_t *c = req->data;
  if (c->st.code < 0)
    return;
  fsdp_failpoint("checkpoint-snapshot");
  uint64_t start_ns = fsdp_clock_now_ns();
  void *at = c->by_replica ? ck_replica_snapshot(c) : ck_staging(c->owner, c);
  if ((at ? fsdp_checkpoint_stage(c->units, c->job.n_units, at, copy_beside,
                                  &c->cp->dp->backend, &c->st)
          : c->st.code) == 0)
    fsdp_status_clear(&c->st);
  if (c->st.code == 0 && c->by_replica) /* what it sends to the host that recovers */
    c->xxh64 = XXH64(at, fsdp_checkpoint_staging_bytes(c->units, c->job.n_units), 0);
  c->snapshot_ns = fsdp_clock_now_ns() - start_ns;
}

static void *write_files(void *arg) {
  checkpoint_work_t *c = arg;
  fsdp_identity_t saved;
  if (!enter_identity(c, &saved))
    return NULL;
  if (fsdp_checkpoint_save(c->dir, &c->job, c->keep, c->path, sizeof c->path, &c->st) == 0)
    fsdp_status_clear(&c->st);
  fsdp_identity_leave(&saved);
  return NULL;
}

/* The write's thread yields the CPU to training: its hashing (and, where a filesystem has no
 * direct I/O, its copying into the page cache) take as long as the cores that training
 * leaves idle allow. */
static void *write_files_niced(void *arg) {
  setpriority(PRIO_PROCESS, (id_t)gettid(), 19); /* best effort */
  return write_files(arg);
}

void ck_write_checkpoint(uv_work_t *req) {
  checkpoint_work_t *c = req->data;
  uint64_t start_ns = fsdp_clock_now_ns();
  pthread_t writer;
  if (pthread_create(&writer, NULL, write_files_niced, c) == 0)
    pthread_join(writer, NULL);
  else
    write_files(c);
  c->write_ns = fsdp_clock_now_ns() - start_ns;
}
