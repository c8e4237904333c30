/* The checkpoints of the daemon's jobs, over the data plane (see checkpoints.h). */
#include "daemon/dataplane/checkpoints.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "checkpoint/checkpoint.h"
#include "common/clock.h"
#include "common/failpoint.h"
#include "common/identity.h"
#include "common/log.h"
#include "daemon/dataplane/optimizer.h"

/* Who asked for a checkpoint's work (checkpoint_job). */
enum origin { BY_CALLER, BY_TRAINER, BY_SCHEDULE, BY_STOP, BY_RESUME };

/* Where the job stands among its steps. */
typedef struct job_steps {
  uint64_t completed; /* the least step its trainable units reduced; 0: none */
  bool trained;       /* it has a trainable unit */
  bool even;          /* they all reduced that step */
  bool reducing;      /* a reduce of the job runs */
  uint64_t newest;    /* the newest step a reduce of the job ran or runs */
} job_steps_t;

/* A checkpoint's work (fsdp_checkpoints_start), in cp->works: the job described on the
 * loop, the directory, and who hears the end. A load runs on the queue. A save's snapshot (a
 * copy of the job's state into its staging memory) runs beside the queue while the job's
 * reduces are held (fsdp_dataplane_hold_reduces); its write then runs beside the queue too,
 * from the snapshot, while training goes on. One of the job's at a time uses its staging
 * memory; a save asked meanwhile waits for it. */
typedef struct checkpoint_work {
  fsdp_checkpoints_t *cp;
  fsdp_job_t *owner;
  /* A save waits for the job's step boundary, or for its staging memory, then takes its
   * snapshot (once no reduce of the job runs) and writes its files; a load loads. */
  enum { SAVE_AT_BOUNDARY, SAVE_WAITING, SAVE_SNAPSHOT, SAVE_WRITING, LOADING } stage;
  unsigned keep; /* a save's: how many of the directory's checkpoints stay */
  /* A save of the schedule's (checkpoint.every_steps): training goes on while it writes and
   * nobody waits for it, so it keeps to checkpoint.disk_share. A save a caller waits for
   * (or a stop) writes at the disk's speed. */
  bool scheduled;
  uint64_t asked_step; /* a save's step as asked (0: the job's last completed one) */
  /* A save that waits for another: where the job stood when it was asked, or at the step
   * boundary it waited for. When its turn comes, a job that stood still is saved as it is,
   * as asked; one that has reduced since is saved as it is if it is between steps, else at
   * its next step boundary, not inside a step, which must come by boundary_deadline_ms
   * (loop time). */
  job_steps_t asked_at;
  uint64_t boundary_deadline_ms; /* 0: none (a stop's save: the stop has its own) */
  char dir[PATH_MAX];
  /* Whose rights its files are used with: a caller's, for a path of its own choosing, or
   * (as_daemon) the daemon's, in checkpoint.dir/<job>/, where a load reads only the
   * checkpoints of the job's own uid. */
  bool as_daemon;
  fsdp_identity_t as;
  fsdp_checkpoint_job_t job;
  fsdp_checkpoint_unit_t *units;
  fsdp_checkpoint_param_t *params; /* every unit's, one after the other */
  char path[PATH_MAX]; /* the step directory written or read */
  uint64_t step;
  /* A save a caller asked for through a trainer's session, which saves its own optimizer's
   * state beside the checkpoint where it wants it (fsdpd.torch's optimizer.pt); other saves
   * warn that they hold no trainer's optimizer state. */
  bool by_trainer;
  /* A load's: what it read, and whether it is the resume's (checkpoint.resume). */
  fsdp_checkpoint_loaded_t loaded;
  bool resume;
  /* A load's: the units pointed at what it read into staging. */
  fsdp_checkpoint_unit_t *staged;
  /* A load's: each unit's optimizer step count as read (units[i].steps non-NULL), for the
   * optimizer's record of a GPU's counts, which the loop cannot read (optimizer.h). */
  uint64_t *loaded_steps;
  uint64_t snapshot_ns, write_ns;
  fsdp_status_t st;
  fsdp_checkpoints_done_fn done;
  void *data;
  uv_work_t work; /* a save's snapshot, then its write */
  struct checkpoint_work *next; /* in cp->works */
} checkpoint_work_t;

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

/* The job's staging memory, made or grown on first need and kept for the next checkpoint:
 * a save's snapshot, or what a load reads before it goes into the job's memory. Only one
 * checkpoint of the job uses it at a time. */
static void *staging(fsdp_job_t *job, checkpoint_work_t *c) {
  size_t bytes = fsdp_checkpoint_staging_bytes(c->units, c->job.n_units);
  if (bytes > job->checkpoint_staging_bytes) {
    free(job->checkpoint_staging);
    job->checkpoint_staging_bytes = 0;
    bytes = (bytes + STAGING_ALIGN - 1) / STAGING_ALIGN * STAGING_ALIGN;
    job->checkpoint_staging = aligned_alloc(STAGING_ALIGN, bytes); /* checkpoint.h's too */
    if (job->checkpoint_staging)
      madvise(job->checkpoint_staging, bytes, MADV_HUGEPAGE); /* best effort */
    if (!job->checkpoint_staging) {
      fsdp_status_set(&c->st, FSDP_E_RESOURCE_EXHAUSTED,
                      "checkpoint: no memory for the %zu bytes of its staging", bytes);
      return NULL;
    }
    job->checkpoint_staging_bytes = bytes;
  }
  return job->checkpoint_staging;
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

/* On a pool thread, beside the queue (the other jobs' work goes on, whatever the disk or
 * the files do): a load reads the checkpoint into the job's staging memory, every block
 * checked before anything goes into the job's memory, so that a refusal leaves the job as
 * it was. */
static void read_load(uv_work_t *req) {
  checkpoint_work_t *c = req->data;
  uint64_t start_ns = fsdp_clock_now_ns();
  size_t n = c->job.n_units;
  void *at = staging(c->owner, c);
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

/* On a pool thread, in the queue's turn (none of the job's casts, reduces or optimizer
 * steps runs meanwhile): what the load read goes into the job's memory. */
static void copy_load(void *arg) {
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

/* On a pool thread, beside the queue, the job's reduces held: a save's snapshot, the job's
 * buffers copied into staging, which the save then writes from. Nothing, when describing
 * the job failed (c->st says why). */
static void take_snapshot(uv_work_t *req) {
  checkpoint_work_t *c = req->data;
  if (c->st.code < 0)
    return;
  fsdp_failpoint("checkpoint-snapshot");
  uint64_t start_ns = fsdp_clock_now_ns();
  void *at = staging(c->owner, c);
  if ((at ? fsdp_checkpoint_stage(c->units, c->job.n_units, at, copy_beside,
                                  &c->cp->dp->backend, &c->st)
          : c->st.code) == 0)
    fsdp_status_clear(&c->st);
  c->snapshot_ns = fsdp_clock_now_ns() - start_ns;
}


static void free_checkpoint_work(checkpoint_work_t *c) {
  free(c->staged);
  free(c->loaded_steps);
  free(c->params);
  free(c->units);
  free(c);
}

static bool daemon_steps_every_unit(fsdp_job_t *job);

/* On the loop: what a load read, said once: whose checkpoint it was, and what of the
 * optimizer's state it could not give back. */
static void log_loaded(fsdp_job_t *job, const checkpoint_work_t *c) {
  const fsdp_checkpoint_loaded_t *l = &c->loaded;
  bool other = strcmp(l->job, job->name) != 0;
  log_info("job '%s': checkpoint of step %llu%s%s%s loaded from %s in %.1f ms", job->name,
           (unsigned long long)c->step, other ? " of job '" : "", other ? l->job : "",
           other ? "'" : "", c->path, (double)c->snapshot_ns / 1e6);
  if (l->state_left_out)
    log_info("job '%s': the daemon optimizer's state of %zu unit(s) in %s is left out: the "
             "job has no optimizer in the daemon (the masters alone loaded)",
             job->name, l->state_left_out, c->path);
  if (l->state_zeroed)
    log_warning("job '%s': %s holds no optimizer state: the daemon's optimizer starts at "
                "zero, step 0, for %zu unit(s)",
                job->name, c->path, l->state_zeroed);
  if (c->resume && !l->optimizer_state && !daemon_steps_every_unit(job))
    log_warning("job '%s': resumes from %s, which holds no optimizer state: a trainer's torch "
                "optimizer starts afresh (its moments at zero); only fsdpd.optim's state is in "
                "the daemon's checkpoints",
                job->name, c->path);
}

/* On the loop: a checkpoint's end. */
static void end_checkpoint(fsdp_job_t *job, checkpoint_work_t *c, int status) {
  if (status < 0)
    fsdp_status_set(&c->st, status, "the checkpoint's work did not run: %s",
                    fsdp_strerror(status));
  if (c->st.code < 0)
    log_error("job '%s': %s", job->name, c->st.message);
  else if (c->stage == LOADING)
    log_loaded(job, c);
  else {
    log_info("job '%s': checkpoint of step %llu saved in %s (snapshot %.1f ms, written in "
             "%.1f ms beside training)",
             job->name, (unsigned long long)c->step, c->path, (double)c->snapshot_ns / 1e6,
             (double)c->write_ns / 1e6);
    if (!c->by_trainer && !daemon_steps_every_unit(job))
      log_warning("job '%s': the checkpoint of step %llu in %s holds the masters but no "
                  "optimizer state of the trainers' (a torch optimizer's, which the daemon "
                  "does not see): a resume from it starts that optimizer afresh (its moments "
                  "at zero). fsdpd.optim keeps its state in every checkpoint; a trainer's "
                  "model.save_checkpoint(dir, optimizer=opt) saves a torch optimizer's "
                  "beside it",
                  job->name, (unsigned long long)c->step, c->path);
    char *path = strdup(c->path);
    if (path) {
      free(job->last_checkpoint);
      job->last_checkpoint = path;
      job->last_checkpoint_step = c->step;
    }
  }
  c->done(c->data, &c->st, c->path, c->step);
  free_checkpoint_work(c);
}

static void unlink_work(fsdp_checkpoints_t *cp, checkpoint_work_t *c) {
  for (checkpoint_work_t **p = &cp->works; *p; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      return;
    }
}

static void append_work(fsdp_checkpoints_t *cp, checkpoint_work_t *c) {
  checkpoint_work_t **tail = &cp->works;
  while (*tail)
    tail = &(*tail)->next;
  *tail = c;
}

/* The checkpoint of the job that uses its staging memory (a save taking its snapshot or
 * writing, a load), or NULL. */
static const checkpoint_work_t *staging_user(const fsdp_checkpoints_t *cp,
                                             const fsdp_job_t *job) {
  for (const checkpoint_work_t *c = cp->works; c; c = c->next)
    if (c->owner == job && c->stage >= SAVE_SNAPSHOT)
      return c;
  return NULL;
}

static job_steps_t job_steps(const fsdp_job_t *job) {
  job_steps_t s = {.even = true};
  for (const fsdp_unit_t *u = job->units; u; u = u->next) {
    if (u->spec->scratch)
      continue;
    s.reducing |= u->reduce.running;
    uint64_t reduced = u->reduce.running ? u->reduce.step : u->reduced_step;
    s.newest = reduced > s.newest ? reduced : s.newest;
    if (!u->trainable)
      continue;
    s.even &= !s.trained || u->reduced_step == s.completed;
    s.completed = s.trained && u->reduced_step > s.completed ? s.completed : u->reduced_step;
    s.trained = true;
  }
  return s;
}

static int queue_checkpoint(fsdp_checkpoints_t *cp, fsdp_job_t *job, checkpoint_work_t *c,
                            fsdp_status_t *st);
static int checkpoint_job(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                          const fsdp_identity_t *as, bool load, enum origin origin,
                          uint64_t step,
                          fsdp_checkpoints_done_fn done, void *data, fsdp_status_t *st);

/* Whether the job's masters are final for `step`: the daemon's optimizer stepped them, or
 * every local rank asked a gather of the next step (a trainer's optimizer wrote them). */
static bool masters_final(fsdp_job_t *job, uint64_t step) {
  return daemon_steps_every_unit(job) || job->masters_final_step > step;
}

static void start_waiting_save(fsdp_checkpoints_t *cp, fsdp_job_t *job);

/* The staging memory is free: the save c, waiting, takes its snapshot, unless the job has
 * trained since it was asked and is inside a step (see asked_at). */
static void start_save(fsdp_checkpoints_t *cp, fsdp_job_t *job, checkpoint_work_t *c) {
  job_steps_t now = job_steps(job);
  bool moved = now.completed != c->asked_at.completed || now.newest != c->asked_at.newest ||
               now.reducing;
  bool between = now.even && !now.reducing && masters_final(job, now.completed);
  if (moved && !between) {
    c->stage = SAVE_AT_BOUNDARY;
    c->boundary_deadline_ms = uv_now(cp->dp->loop) + cp->dp->collective_timeout_ms;
    log_info("job '%s': a save asked after step %llu waited for another, and the job is "
             "inside a step since: it saves at its next step boundary",
             job->name, (unsigned long long)c->asked_at.completed);
    return;
  }
  if (moved)
    c->asked_step = now.completed; /* the step it holds, not the one asked */
  c->stage = SAVE_SNAPSHOT;
  if (queue_checkpoint(cp, job, c, &c->st) == 0)
    return;
  unlink_work(cp, c);
  end_checkpoint(job, c, 0);
  start_waiting_save(cp, job);
}

/* A checkpoint of the job ended: the first save waiting for it starts. */
static void start_waiting_save(fsdp_checkpoints_t *cp, fsdp_job_t *job) {
  for (checkpoint_work_t *c = cp->works; c; c = c->next)
    if (c->owner == job && c->stage == SAVE_WAITING) {
      start_save(cp, job, c);
      return;
    }
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

/* On a thread of libuv's pool, beside the queue: a save's files, from its snapshot, written
 * by a thread of the lowest priority (the pool's threads run the queue's work too, so they
 * keep theirs), or by this one when none can start. */
static void write_checkpoint(uv_work_t *req) {
  checkpoint_work_t *c = req->data;
  uint64_t start_ns = fsdp_clock_now_ns();
  pthread_t writer;
  if (pthread_create(&writer, NULL, write_files_niced, c) == 0)
    pthread_join(writer, NULL);
  else
    write_files(c);
  c->write_ns = fsdp_clock_now_ns() - start_ns;
}

/* On the loop: a checkpoint ends, and the save waiting for it, if any, starts. */
static void end_work(fsdp_checkpoints_t *cp, checkpoint_work_t *c, int status) {
  fsdp_job_t *job = c->owner;
  unlink_work(cp, c);
  end_checkpoint(job, c, status);
  start_waiting_save(cp, job);
}

static void checkpoint_written(uv_work_t *req, int status) {
  checkpoint_work_t *c = req->data;
  end_work(c->cp, c, status);
}

/* A save's snapshot is taken: its write starts. */
static void start_write(fsdp_checkpoints_t *cp, checkpoint_work_t *c) {
  c->stage = SAVE_WRITING;
  int r = uv_queue_work(cp->dp->loop, &c->work, write_checkpoint, checkpoint_written);
  if (r < 0) {
    fsdp_status_set(&c->st, FSDP_E_INTERNAL, "checkpoint: cannot start its write: %s",
                    uv_strerror(r));
    end_work(cp, c, 0);
  }
}

/* On the loop, once the snapshot is taken: the job's reduces go on, and the write starts. */
static void snapshot_taken(uv_work_t *req, int status) {
  checkpoint_work_t *c = req->data;
  fsdp_dataplane_release_reduces(c->cp->dp, c->owner);
  if (status == 0 && c->st.code == 0)
    start_write(c->cp, c);
  else
    end_work(c->cp, c, status);
}

static int start_snapshot(fsdp_checkpoints_t *cp, checkpoint_work_t *c, fsdp_status_t *st) {
  c->work.data = c;
  int r = uv_queue_work(cp->dp->loop, &c->work, take_snapshot, snapshot_taken);
  if (r < 0) {
    fsdp_dataplane_release_reduces(cp->dp, c->owner);
    return fsdp_status_set(st, FSDP_E_INTERNAL, "checkpoint: cannot start its snapshot: %s",
                           uv_strerror(r));
  }
  return 0;
}

static int describe(fsdp_job_t *job, checkpoint_work_t *c, fsdp_status_t *st);

/* On the loop, from inside the data plane: the reduces of the job that ran when its save
 * asked to hold them ended. The job is described again, as they left it, and the snapshot
 * starts; a description that fails ends the save from the snapshot's end, outside the data
 * plane. */
static void reduces_quiet(void *arg) {
  checkpoint_work_t *c = arg;
  if (describe(c->owner, c, &c->st) == 0)
    fsdp_status_clear(&c->st);
  if (start_snapshot(c->cp, c, &c->st) < 0)
    end_work(c->cp, c, 0); /* libuv refused work: it cannot, but for a missing callback */
}

/* On the loop, once copy_load ran: the job's state is the checkpoint's step. */
static void load_copied(void *arg, int status) {
  checkpoint_work_t *c = arg;
  for (size_t i = 0; c->loaded_steps && i < c->job.n_units; i++)
    if (c->units[i].steps)
      fsdp_optimizer_stepped(c->owner, fsdp_store_find_unit(c->owner, c->units[i].name),
                             c->loaded_steps[i]);
  if (status == 0 && c->st.code == 0)
    fsdp_dataplane_reached_step(c->owner, c->step);
  end_work(c->cp, c, status);
}

/* The unit of the job with a collective running, or NULL. */
static const fsdp_unit_t *collective_running(const fsdp_job_t *job) {
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (u->gather.running || u->reduce.running)
      return u;
  return NULL;
}

/* On the loop, once read_load ran: the copy into the job's memory waits for the queue,
 * unless the job went into a step while the files were read (the load would land inside
 * it, some units gathered before it and some after); a resume's gathers wait for it. */
static void load_read(uv_work_t *req, int status) {
  checkpoint_work_t *c = req->data;
  const fsdp_unit_t *busy =
      status == 0 && c->st.code == 0 && !c->resume ? collective_running(c->owner) : NULL;
  if (busy)
    fsdp_status_set(&c->st, FSDP_E_FAILED_PRECONDITION,
                    "LoadCheckpoint: job '%s': unit '%s' began a collective while the "
                    "checkpoint was read: nothing loaded; load between steps",
                    c->owner->name, busy->spec->unit);
  if (status < 0 || c->st.code < 0 ||
      fsdp_dataplane_queue_call(c->cp->dp, c->owner, copy_load, load_copied, c, &c->st) < 0)
    end_work(c->cp, c, status);
}

void fsdp_checkpoints_hurry(fsdp_checkpoints_t *cp) {
  int go_on = FSDP_CHECKPOINT_GO_ON;
  atomic_compare_exchange_strong(&cp->stopping, &go_on, FSDP_CHECKPOINT_HURRY);
}

void fsdp_checkpoints_abandon(fsdp_checkpoints_t *cp) {
  atomic_store(&cp->stopping, FSDP_CHECKPOINT_ABANDON);
}

void fsdp_checkpoints_expire(fsdp_checkpoints_t *cp, uint64_t now_ms) {
  for (checkpoint_work_t *c = cp->works; c; c = c->next) {
    if (c->stage != SAVE_AT_BOUNDARY || !c->boundary_deadline_ms ||
        now_ms < c->boundary_deadline_ms)
      continue;
    fsdp_status_set(&c->st, FSDP_E_DEADLINE_EXCEEDED,
                    "SaveCheckpoint: job '%s' came to no step boundary within "
                    "store.collective_timeout (%llu ms) once the checkpoint it waited for had "
                    "ended: not saved",
                    c->owner->name, (unsigned long long)cp->dp->collective_timeout_ms);
    unlink_work(cp, c);
    end_checkpoint(c->owner, c, 0);
    fsdp_checkpoints_expire(cp, now_ms); /* the list changed: from its start again */
    return;
  }
}

bool fsdp_checkpoints_uses_job(const fsdp_checkpoints_t *cp, const fsdp_job_t *job) {
  for (const checkpoint_work_t *c = cp->works; c; c = c->next)
    if (c->owner == job)
      return true;
  return false;
}

void fsdp_checkpoints_cleanup(fsdp_checkpoints_t *cp) {
  while (cp && cp->works) {
    checkpoint_work_t *c = cp->works;
    cp->works = c->next;
    free_checkpoint_work(c);
  }
}

/* Whether the job's memory waits for the checkpoint it resumes from. */
static bool resuming(const fsdp_job_t *job) {
  return job->resume_from || job->resuming;
}

/* A job new to this daemon: host 0 removes what unfinished saves left in
 * checkpoint.dir/<job>/ (fsdp_checkpoint_remove_unfinished). With checkpoint.resume = latest
 * the job goes on from its newest checkpoint there, loaded before its first gather. One that
 * cannot be read is still loaded then, and fails the job naming why: it does not start anew
 * without a word. */
static void job_starts(void *ctx, fsdp_job_t *job) {
  const fsdp_checkpoints_t *cp = ctx;
  char dir[PATH_MAX];
  if (!cp->dir[0] ||
      (size_t)snprintf(dir, sizeof dir, "%s/%s", cp->dir, job->name) >= sizeof dir)
    return;
  if (!cp->dp->peers || fsdp_peers_host_rank(cp->dp->peers) == 0)
    fsdp_checkpoint_remove_unfinished(dir, job->name);
  if (!cp->resume)
    return;
  char from[PATH_MAX];
  uint64_t uid = job->owner.uid, step;
  fsdp_status_t st;
  if (fsdp_checkpoint_find(dir, job->name, &uid, from, sizeof from, &step, &st) < 0) {
    if (st.code == FSDP_E_NOT_FOUND) {
      log_info("job '%s': nothing to resume from in %s: it starts anew", job->name, dir);
      return;
    }
    log_error("job '%s': cannot resume: %s", job->name, st.message);
    /* Loaded all the same at the first gather, which fails naming why. */
    job->resume_from = strdup(st.code == FSDP_E_DATA_LOSS ? from : dir);
    return;
  }
  job->resume_from = strdup(from);
  job->resume_step = step;
  job->checkpointed_step = job->resume_step; /* the schedule does not save it again */
  if (job->resume_from)
    log_info("job '%s': resumes from %s, after step %llu, at its first gather", job->name,
             job->resume_from, (unsigned long long)job->resume_step);
}

static void on_scheduled_checkpoint(void *data, const fsdp_status_t *st, const char *path,
                                    uint64_t step) {
  (void)data, (void)st, (void)path, (void)step; /* end_checkpoint logged how it went */
}

/* checkpoint.every_steps: every local rank asked the forward's gather of step + 1, so their
 * masters are final for `step` and stay so until its reduces, which the save holds until
 * its snapshot is taken: the job is saved into checkpoint.dir/<job>/ when step is one of
 * every N. */
static void step_boundary(void *ctx, fsdp_job_t *job, uint64_t step) {
  fsdp_checkpoints_t *cp = ctx;
  if (resuming(job))
    return; /* its state is the checkpoint's, not loaded yet */
  /* A save waiting for a boundary takes this one: at once, or when the staging memory is
   * free, as any save that waited. */
  for (checkpoint_work_t *c = cp->works; c && step; c = c->next)
    if (c->owner == job && c->stage == SAVE_AT_BOUNDARY) {
      c->stage = SAVE_WAITING;
      c->asked_step = step;
      c->asked_at = job_steps(job);
      if (!staging_user(cp, job))
        start_save(cp, job, c);
      return; /* a scheduled save of the step would find the staging memory in use */
    }
  if (!cp->every_steps || !cp->dir[0] || step == 0 || step % cp->every_steps != 0 ||
      step <= job->checkpointed_step)
    return;
  job->checkpointed_step = step;
  if (staging_user(cp, job)) {
    log_warning("job '%s': no checkpoint of step %llu: the previous save is still being "
                "written (checkpoint.every_steps is shorter than a save)",
                job->name, (unsigned long long)step);
    return;
  }
  char dir[PATH_MAX];
  fsdp_status_t st;
  if ((size_t)snprintf(dir, sizeof dir, "%s/%s", cp->dir, job->name) >= sizeof dir)
    fsdp_status_set(&st, FSDP_E_INVALID_ARGUMENT, "checkpoint.dir is too long");
  else if (checkpoint_job(cp, job, dir, NULL, false, BY_SCHEDULE, step, on_scheduled_checkpoint,
                          NULL,
                          &st) == 0)
    return;
  log_error("job '%s': no checkpoint of step %llu: %s", job->name, (unsigned long long)step,
            st.message);
}


/* The job's state as a checkpoint holds it: every unit's masters, and the optimizer's state
 * of the units it steps. */
static int describe_checkpoint(fsdp_job_t *job, checkpoint_work_t *c, fsdp_status_t *st) {
  size_t n_params = 0;
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    n_params += u->spec->scratch ? 0 : u->spec->n_params;
  c->units = calloc(job->n_units ? job->n_units : 1, sizeof *c->units);
  c->params = calloc(n_params ? n_params : 1, sizeof *c->params);
  if (!c->units || !c->params)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for a checkpoint");
  fsdp_checkpoint_param_t *params = c->params;
  char *base = fsdp_arena_base(job->arena);
  size_t n = 0;
  for (fsdp_unit_t *u = job->units; u; u = u->next) {
    if (u->spec->scratch)
      continue; /* a client's own buffer: not the model's state */
    if (u->state != FSDP_UNIT_READY)
      return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                             "job '%s': unit '%s' has no buffers ready yet", job->name,
                             u->spec->unit);
    fsdp_dataplane_buffers_t b;
    fsdp_dataplane_buffers(u, 0, &b);
    fsdp_checkpoint_unit_t *cu = &c->units[n++];
    for (size_t k = 0; k < u->spec->n_params; k++) {
      const fsdp_param_spec_t *p = &u->spec->params[k];
      params[k] = (fsdp_checkpoint_param_t){.name = p->name,
                                            .shape = p->shape,
                                            .ndim = p->n_shape,
                                            .offset = u->layout.offsets[k],
                                            .dtype = fsdp_unit_dtype_name(p->dtype)};
    }
    *cu = (fsdp_checkpoint_unit_t){
        .name = u->spec->unit,
        .strategy = fsdp_unit_strategy_name(u->spec->strategy),
        .params = params,
        .n_params = u->spec->n_params,
        .numel = u->layout.numel,
        .padded_numel = u->layout.padded_numel,
        .shard_numel = u->layout.shard_numel,
        .shards = u->layout.shards,
        .host_first_shard = b.host_first_shard,
        .host_shards = b.host_shards,
        .masters = (float *)(void *)(base + u->master_offset),
    };
    params += u->spec->n_params;
    fsdp_optimizer_state_t state;
    if (fsdp_optimizer_steps_unit(job, u)) {
      if (fsdp_optimizer_unit_state(job, u, &state, st) < 0)
        return st->code;
      cu->arrays = state.arrays;
      for (unsigned a = 0; a < state.arrays; a++)
        cu->state[a] = (float *)(void *)(base + state.arrays_offset + a * state.array_stride);
      cu->steps = (uint64_t *)(void *)(base + state.steps_offset);
    }
  }
  c->job.step = job_steps(job).completed;
  c->job.job = job->name;
  c->job.uid = job->owner.uid;
  c->job.same_uid_only = c->as_daemon; /* the job's trainers cannot read its files */
  c->job.own_job_only = c->as_daemon;  /* nor another job's there: the daemon's rights */
  c->job.host = c->cp->dp->peers ? fsdp_peers_host_rank(c->cp->dp->peers) : 0;
  c->job.hosts = c->cp->dp->peers ? fsdp_peers_host_count(c->cp->dp->peers) : 1;
  c->job.optimizer = fsdp_optimizer_kind_name(job);
  c->job.write_rate = c->cp->write_rate;
  c->job.disk_share = c->scheduled && c->cp->disk_share ? c->cp->disk_share : 100;
  /* Host 0 waits for the others' files as long as a collective among hosts may take, and
   * as many times longer as pacing makes the saves last. */
  c->job.hosts_wait_ms = c->cp->dp->collective_timeout_ms * 100 / c->job.disk_share;
  c->job.stopping = &c->cp->stopping;
  c->job.units = c->units;
  c->job.n_units = n;
  return 0;
}

/* Whether dir is checkpoint.dir/<job>/ or below it. */
static bool in_job_dir(const fsdp_checkpoints_t *cp, const fsdp_job_t *job, const char *dir) {
  char own[PATH_MAX];
  int n = snprintf(own, sizeof own, "%s/%s", cp->dir, job->name);
  /* Paths are walked with ".." refused (common/dirs.h): a prefix is a place. */
  return cp->dir[0] && n > 0 && (size_t)n < sizeof own && strncmp(dir, own, (size_t)n) == 0 &&
         (dir[n] == '\0' || dir[n] == '/');
}

/* A checkpoint's work at `stage` into dir, in cp->works, with the rights of as (NULL, or a
 * dir in checkpoint.dir/<job>/: the daemon's own); NULL with st set (verb naming the
 * call) for want of memory or a path too long. */
static checkpoint_work_t *new_work(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                                   const fsdp_identity_t *as, int stage, uint64_t step,
                                   fsdp_checkpoints_done_fn done, void *data, const char *verb,
                                   fsdp_status_t *st) {
  if (strlen(dir) >= sizeof ((checkpoint_work_t *)NULL)->dir) {
    fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "%s: path too long", verb);
    return NULL;
  }
  checkpoint_work_t *c = calloc(1, sizeof *c);
  if (!c) {
    fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "%s: out of memory", verb);
    return NULL;
  }
  *c = (checkpoint_work_t){.cp = cp, .owner = job, .stage = stage, .keep = cp->keep,
                           .asked_step = step, .done = done, .data = data,
                           .as_daemon = !as || in_job_dir(cp, job, dir)};
  if (!c->as_daemon)
    c->as = *as;
  snprintf(c->dir, sizeof c->dir, "%s", dir);
  append_work(cp, c);
  return c;
}

/* A load (a resume's too) or a save (the schedule's, a stop's...: origin), once the caller's own
 * conditions hold. */
static int checkpoint_job(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                          const fsdp_identity_t *as, bool load, enum origin origin,
                          uint64_t step,
                          fsdp_checkpoints_done_fn done, void *data, fsdp_status_t *st) {
  const char *verb = load ? "LoadCheckpoint" : "SaveCheckpoint";
  if (!load && resuming(job))
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "%s: job '%s' resumes from a checkpoint not loaded yet: save once "
                           "its first gather has loaded it",
                           verb, job->name);
  /* A load reads through the staging memory a save writes from. */
  const checkpoint_work_t *user = staging_user(cp, job);
  if (load && user)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "%s: job '%s' has a %s under way: load once it ends (fsdpctl "
                           "status shows it)",
                           verb, job->name, user->stage == LOADING ? "load" : "save");
  /* One checkpoint of a job at a time in its staging memory: later saves wait their turn. */
  checkpoint_work_t *c = new_work(cp, job, dir, as,
                                  load ? LOADING : user ? SAVE_WAITING : SAVE_SNAPSHOT, step,
                                  done, data, verb, st);
  if (!c)
    return st->code;
  c->scheduled = origin == BY_SCHEDULE;
  c->by_trainer = origin == BY_TRAINER;
  c->resume = origin == BY_RESUME;
  if (c->stage == SAVE_WAITING) {
    c->asked_at = job_steps(job);
    log_info("job '%s': a save into %s waits for the checkpoint under way", job->name, dir);
    return 0;
  }
  int r = queue_checkpoint(cp, job, c, st);
  if (r < 0) {
    unlink_work(cp, c);
    free_checkpoint_work(c);
  }
  return r;
}

int fsdp_checkpoints_start(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                           const fsdp_checkpoints_caller_t *caller, bool load, uint64_t step,
                           fsdp_checkpoints_done_fn done, void *data, fsdp_status_t *st) {
  /* A collective that only waits for ranks runs after the load, in turn. */
  const fsdp_unit_t *busy = load ? collective_running(job) : NULL;
  if (busy)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "LoadCheckpoint: job '%s': unit '%s' has a collective running: "
                           "load between steps",
                           job->name, busy->spec->unit);
  uint64_t completed = job_steps(job).completed;
  if (!load && caller && caller->trainer && step > completed)
    return fsdp_status_set(st, FSDP_E_OUT_OF_RANGE,
                           "SaveCheckpoint: field 'step' = %llu: job '%s' has completed step "
                           "%llu; a checkpoint is named for a step the job has reached (0: "
                           "its last)",
                           (unsigned long long)step, job->name, (unsigned long long)completed);
  return checkpoint_job(cp, job, dir, caller ? &caller->as : NULL, load,
                        caller && caller->trainer ? BY_TRAINER : BY_CALLER, step, done, data,
                        st);
}

/* Whether the daemon's optimizer steps every trainable unit: no trainer writes masters. */
static bool daemon_steps_every_unit(fsdp_job_t *job) {
  for (const fsdp_unit_t *u = job->units; u; u = u->next)
    if (u->trainable && !u->spec->scratch && !fsdp_optimizer_steps_unit(job, u))
      return false;
  return true;
}

int fsdp_checkpoints_save_at_boundary(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                                      bool attached, fsdp_checkpoints_done_fn done, void *data,
                                      fsdp_status_t *st) {
  if (resuming(job))
    return 1; /* its state is still the checkpoint it resumes from */
  job_steps_t now = job_steps(job);
  uint64_t step = now.completed;
  if (!now.trained || (now.even && step == 0))
    return 1; /* nothing trained: its trainers start it again from their initial values */
  bool between = now.even && !now.reducing;
  if (!between && !attached)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "job '%s' stopped inside a step (its units have reduced different "
                           "steps) and no trainer is attached to finish it: not saved",
                           job->name);
  bool final = !attached || masters_final(job, step);
  if (between && final)
    return checkpoint_job(cp, job, dir, NULL, false, BY_STOP, 0, done, data, st);
  if (!new_work(cp, job, dir, NULL, SAVE_AT_BOUNDARY, 0, done, data, "SaveCheckpoint", st))
    return st->code;
  log_info("job '%s': saves at its next step boundary", job->name);
  return 0;
}

typedef struct resume_call {
  fsdp_checkpoints_t *cp;
  fsdp_job_t *job;
} resume_call_t;

static void resumed(void *data, const fsdp_status_t *st, const char *path, uint64_t step) {
  resume_call_t call = *(resume_call_t *)data;
  free(data);
  (void)path, (void)step; /* end_checkpoint logged them */
  fsdp_dataplane_resumed(call.cp->dp, call.job, st);
}

/* Loads the checkpoint the job resumes from, once; its gathers wait for it. */
static void resume(void *ctx, fsdp_job_t *job) {
  fsdp_checkpoints_t *cp = ctx;
  if (job->resuming)
    return;
  char *from = job->resume_from;
  job->resume_from = NULL;
  job->resuming = true;
  fsdp_status_t st;
  resume_call_t *call = malloc(sizeof *call);
  int r = call ? 0 : fsdp_status_set(&st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory");
  if (call) {
    *call = (resume_call_t){.cp = cp, .job = job};
    r = checkpoint_job(cp, job, from, NULL, true, BY_RESUME, 0, resumed, call, &st);
  }
  free(from);
  if (r < 0) {
    free(call);
    fsdp_dataplane_resumed(cp->dp, job, &st);
  }
}

/* Describes the job as it is now into c. */
static int describe(fsdp_job_t *job, checkpoint_work_t *c, fsdp_status_t *st) {
  free(c->params);
  free(c->units);
  c->params = NULL;
  c->units = NULL;
  int r = describe_checkpoint(job, c, st);
  if (r < 0)
    return r;
  if (c->asked_step)
    c->job.step = c->asked_step;
  c->step = c->job.step; /* a load's is the checkpoint's, read with it */
  return 0;
}

/* Starts c's work, described as the job is now: a load in the queue's turn, a save's
 * snapshot once no reduce of the job runs, holding those of later steps. */
static int queue_checkpoint(fsdp_checkpoints_t *cp, fsdp_job_t *job, checkpoint_work_t *c,
                            fsdp_status_t *st) {
  int r = describe(job, c, st);
  if (r < 0)
    return r;
  if (c->stage == LOADING) {
    c->work.data = c;
    int q = uv_queue_work(cp->dp->loop, &c->work, read_load, load_read);
    return q < 0 ? fsdp_status_set(st, FSDP_E_INTERNAL, "checkpoint: cannot start its load: %s",
                                   uv_strerror(q))
                 : 0;
  }
  /* While a reduce runs, the step under way ends: the snapshot starts after it. */
  if (!fsdp_dataplane_hold_reduces(cp->dp, job, job_steps(job).newest, reduces_quiet, c))
    return 0;
  return start_snapshot(cp, c, st);
}

const char *fsdp_checkpoints_save_state(const fsdp_checkpoints_t *cp, const fsdp_job_t *job) {
  static const char *const names[] = {"waiting for the step boundary",
                                      "waiting for the save before", "taking its snapshot",
                                      "writing"};
  int stage = -1;
  for (const checkpoint_work_t *c = cp->works; c; c = c->next)
    if (c->owner == job && c->stage != LOADING && (int)c->stage > stage)
      stage = (int)c->stage;
  return stage < 0 ? "" : names[stage];
}

void fsdp_checkpoints_init(fsdp_checkpoints_t *cp, fsdp_dataplane_t *dp) {
  *cp = (fsdp_checkpoints_t){.dp = dp};
  dp->hooks = (fsdp_dataplane_hooks_t){
      .ctx = cp, .job_starts = job_starts, .resume = resume, .step_boundary = step_boundary};
}

/* checkpoint.dir with the links in the part of it that exists resolved: the operator's
 * configuration may go through links (a /var on another disk), which the walks of
 * checkpoint/ refuse in a path a caller names. */
static void resolve_configured(const char *dir, char *out, size_t size) {
  char head[PATH_MAX], real[PATH_MAX];
  snprintf(out, size, "%s", dir);
  if (!dir[0] || strlen(dir) >= sizeof head)
    return;
  snprintf(head, sizeof head, "%s", dir);
  for (char *cut = NULL;; ) {
    if (realpath(head, real)) {
      int n = snprintf(out, size, "%s%s%s", strcmp(real, "/") == 0 && cut ? "" : real,
                       cut ? "/" : "", cut ? dir + (cut - head) + 1 : "");
      if (n < 0 || (size_t)n >= size) /* too long resolved: as configured */
        snprintf(out, size, "%s", dir);
      return;
    }
    if (errno != ENOENT || !(cut = strrchr(head, '/')) || cut == head)
      return;
    *cut = '\0';
  }
}

void fsdp_checkpoints_configure(fsdp_checkpoints_t *cp, const char *dir, uint64_t every_steps,
                                unsigned keep, uint64_t write_rate, unsigned disk_share,
                                bool resume) {
  resolve_configured(dir, cp->dir, sizeof cp->dir);
  cp->every_steps = every_steps;
  cp->keep = keep;
  cp->write_rate = write_rate;
  cp->disk_share = disk_share;
  cp->resume = resume;
}

