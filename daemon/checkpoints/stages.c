/* A checkpoint's way on the loop, from queued to ended: a save waits for the job's
 * staging memory and its step boundary, holds the job's reduces for its snapshot and
 * writes beside training; a load reads beside the queue and copies in the queue's turn. */
#include "daemon/checkpoints/internal.h"

#include <stdlib.h>
#include <string.h>

#include "checkpoint/checkpoint.h"
#include "common/log.h"
#include "daemon/dataplane/optimizer.h"

static void start_waiting_save(fsdp_checkpoints_t *cp, fsdp_job_t *job);

void ck_free_checkpoint_work(checkpoint_work_t *c) {
  ck_free_replica_io(c->replica);
  free(c->staged);
  free(c->loaded_steps);
  free(c->params);
  free(c->units);
  free(c);
}

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
  if (c->resume && !l->optimizer_state && !ck_daemon_steps_every_unit(job))
    log_warning("job '%s': resumes from %s, which holds no optimizer state: a trainer's torch "
                "optimizer starts afresh (its moments at zero); only fsdpd.optim's state is in "
                "the daemon's checkpoints",
                job->name, c->path);
}

/* The job's counts of saves and loads, for the metrics. */
static void count(fsdp_job_t *job, const checkpoint_work_t *c) {
  fsdp_job_checkpoints_t *ck = ck_job(job);
  if (!ck)
    return;
  if (ck_is_replica_send(c))
    return; /* no save */
  bool ok = c->st.code >= 0;
  uint64_t bytes = ok ? fsdp_checkpoint_staging_bytes(c->units, c->job.n_units) : 0;
  if (c->stage == LOADING) {
    ck->loaded += ok;
    ck->load_failed += !ok;
    ck->loaded_bytes += bytes;
    ck->load_ns += ok ? c->snapshot_ns : 0;
  } else {
    ck->saved += ok;
    ck->save_failed += !ok;
    ck->saved_bytes += bytes;
    ck->save_ns += ok ? c->snapshot_ns + c->write_ns : 0;
  }
}

void ck_end_checkpoint(fsdp_job_t *job, checkpoint_work_t *c, int status) {
  if (status < 0)
    fsdp_status_set(&c->st, status, "the checkpoint's work did not run: %s",
                    fsdp_strerror(status));
  count(job, c);
  if (c->st.code < 0)
    log_error("job '%s': %s", job->name, c->st.message);
  else if (c->stage == LOADING)
    log_loaded(job, c);
  else if (c->by_replica)
    log_info("job '%s': its state after step %llu went to host %u, which recovers it (%zu "
             "bytes; snapshot %.1f ms, sent in %.1f ms)",
             job->name, (unsigned long long)c->step, c->peer,
             fsdp_checkpoint_staging_bytes(c->units, c->job.n_units),
             (double)c->snapshot_ns / 1e6, (double)c->write_ns / 1e6);
  else {
    log_info("job '%s': checkpoint of step %llu saved in %s (snapshot %.1f ms, written in "
             "%.1f ms beside training)",
             job->name, (unsigned long long)c->step, c->path, (double)c->snapshot_ns / 1e6,
             (double)c->write_ns / 1e6);
    if (!c->by_trainer && !ck_daemon_steps_every_unit(job))
      log_warning("job '%s': the checkpoint of step %llu in %s holds the masters but no "
                  "optimizer state of the trainers' (a torch optimizer's, which the daemon "
                  "does not see): a resume from it starts that optimizer afresh (its moments "
                  "at zero). fsdpd.optim keeps its state in every checkpoint; a trainer's "
                  "model.save_checkpoint(dir, optimizer=opt) saves a torch optimizer's "
                  "beside it",
                  job->name, (unsigned long long)c->step, c->path);
    fsdp_job_checkpoints_t *ck = ck_job(job);
    char *path = ck ? strdup(c->path) : NULL;
    if (path) {
      free(ck->last_path);
      ck->last_path = path;
      ck->last_step = c->step;
    }
  }
  c->done(c->data, &c->st, c->path, c->step);
  ck_free_checkpoint_work(c);
}

void ck_unlink_work(fsdp_checkpoints_t *cp, checkpoint_work_t *c) {
  for (checkpoint_work_t **p = &cp->works; *p; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      return;
    }
}

void ck_append_work(fsdp_checkpoints_t *cp, checkpoint_work_t *c) {
  checkpoint_work_t **tail = &cp->works;
  while (*tail)
    tail = &(*tail)->next;
  *tail = c;
}

const checkpoint_work_t *ck_staging_user(const fsdp_checkpoints_t *cp,
                                         const fsdp_job_t *job) {
  for (const checkpoint_work_t *c = cp->works; c; c = c->next)
    if (c->owner == job && c->stage >= SAVE_SNAPSHOT && !ck_is_replica_send(c))
      return c;
  return NULL;
}

void ck_start_save(fsdp_checkpoints_t *cp, fsdp_job_t *job, checkpoint_work_t *c) {
  job_steps_t now = ck_job_steps(job);
  bool moved = now.completed != c->asked_at.completed || now.newest != c->asked_at.newest ||
               now.reducing;
  bool between = now.even && !now.reducing && ck_masters_final(job, now.completed);
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
  if (ck_queue_checkpoint(cp, job, c, &c->st) == 0)
    return;
  ck_unlink_work(cp, c);
  ck_end_checkpoint(job, c, 0);
  start_waiting_save(cp, job);
}

/* A checkpoint of the job ended: the first save waiting for it starts. */
static void start_waiting_save(fsdp_checkpoints_t *cp, fsdp_job_t *job) {
  for (checkpoint_work_t *c = cp->works; c; c = c->next)
    if (c->owner == job && c->stage == SAVE_WAITING) {
      ck_start_save(cp, job, c);
      return;
    }
}

void ck_end_work(fsdp_checkpoints_t *cp, checkpoint_work_t *c, int status) {
  fsdp_job_t *job = c->owner;
  ck_unlink_work(cp, c);
  ck_end_checkpoint(job, c, status);
  start_waiting_save(cp, job);
}

static void checkpoint_written(uv_work_t *req, int status) {
  checkpoint_work_t *c = req->data;
  ck_end_work(c->cp, c, status);
}

/* A save's snapshot is taken: its write starts. */
static void start_write(fsdp_checkpoints_t *cp, checkpoint_work_t *c) {
  c->stage = SAVE_WRITING;
  int r = uv_queue_work(cp->dp->loop, &c->work, ck_write_checkpoint, checkpoint_written);
  if (r < 0) {
    fsdp_status_set(&c->st, FSDP_E_INTERNAL, "checkpoint: cannot start its write: %s",
                    uv_strerror(r));
    ck_end_work(cp, c, 0);
  }
}

/* On the loop, once the snapshot is taken: the job's reduces go on, and the write starts. */
static void snapshot_taken(uv_work_t *req, int status) {
  checkpoint_work_t *c = req->data;
  if (!c->by_replica) /* which held none */
    fsdp_dataplane_release_reduces(c->cp->dp, c->owner);
  if (status == 0 && c->st.code == 0 && c->by_replica) {
    c->stage = SAVE_SENDING;
    ck_send_snapshot(c->cp, c);
  } else if (status == 0 && c->st.code == 0)
    start_write(c->cp, c);
  else
    ck_end_work(c->cp, c, status);
}

static int start_snapshot(fsdp_checkpoints_t *cp, checkpoint_work_t *c, fsdp_status_t *st) {
  c->work.data = c;
  int r = uv_queue_work(cp->dp->loop, &c->work, ck_take_snapshot, snapshot_taken);
  if (r < 0) {
    if (!c->by_replica)
      fsdp_dataplane_release_reduces(cp->dp, c->owner);
    return fsdp_status_set(st, FSDP_E_INTERNAL, "checkpoint: cannot start its snapshot: %s",
                           uv_strerror(r));
  }
  return 0;
}

/* On the loop, from inside the data plane: the reduces of the job that ran when its save
 * asked to hold them ended. The job is described again, as they left it, and the snapshot
 * starts; a description that fails ends the save from the snapshot's end, outside the data
 * plane. */
static void reduces_quiet(void *arg) {
  checkpoint_work_t *c = arg;
  if (ck_describe(c->owner, c, &c->st) == 0)
    fsdp_status_clear(&c->st);
  if (start_snapshot(c->cp, c, &c->st) < 0)
    ck_end_work(c->cp, c, 0); /* libuv refused work: it cannot, but for a missing callback */
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
  ck_end_work(c->cp, c, status);
}

/* Unless the job went into a step while the files were read (the load would land inside
 * it, some units gathered before it and some after); a resume's gathers wait for it. */
void ck_load_read(uv_work_t *req, int status) {
  checkpoint_work_t *c = req->data;
  const fsdp_unit_t *busy =
      status == 0 && c->st.code == 0 && !c->resume ? ck_collective_running(c->owner) : NULL;
  if (busy)
    fsdp_status_set(&c->st, FSDP_E_FAILED_PRECONDITION,
                    "LoadCheckpoint: job '%s': unit '%s' began a collective while the "
                    "checkpoint was read: nothing loaded; load between steps",
                    c->owner->name, busy->spec->unit);
  if (status < 0 || c->st.code < 0 ||
      fsdp_dataplane_queue_call(c->cp->dp, c->owner, ck_copy_load, load_copied, c, &c->st) < 0)
    ck_end_work(c->cp, c, status);
}

int ck_queue_checkpoint(fsdp_checkpoints_t *cp, fsdp_job_t *job, checkpoint_work_t *c,
                        fsdp_status_t *st) {
  int r = ck_describe(job, c, st);
  if (r < 0)
    return r;
  if (c->stage == LOADING) {
    c->work.data = c;
    int q = uv_queue_work(cp->dp->loop, &c->work, ck_read_load, ck_load_read);
    return q < 0 ? fsdp_status_set(st, FSDP_E_INTERNAL, "checkpoint: cannot start its load: %s",
                                   uv_strerror(q))
                 : 0;
  }
  /* A replica's state for a host that recovers: no reduce changes it until that host takes
   * part (replicas.c), so the snapshot waits for none. */
  if (c->by_replica)
    return start_snapshot(cp, c, st);
  /* While a reduce runs, the step under way ends: the snapshot starts after it. */
  if (!fsdp_dataplane_hold_reduces(cp->dp, job, ck_job_steps(job).newest, reduces_quiet, c))
    return 0;
  return start_snapshot(cp, c, st);
}
