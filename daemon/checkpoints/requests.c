/* What asks for the jobs' checkpoints (see checkpoints.h): a caller or a trainer, the
 * schedule (checkpoint.every_steps), the daemon's stop, and the resume of a job whose start
 * found a checkpoint (job_start.c); the checkpoints' own life. */
#include "daemon/checkpoints/internal.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/checkpoint.h"
#include "common/identity.h"
#include "common/log.h"

static int checkpoint_job(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                          const fsdp_identity_t *as, bool load, enum origin origin,
                          uint64_t step,
                          fsdp_checkpoints_done_fn done, void *data, fsdp_status_t *st);

void fsdp_checkpoints_hurry(fsdp_checkpoints_t *cp) {
  int go_on = FSDP_CHECKPOINT_GO_ON;
  atomic_compare_exchange_strong(&cp->stopping, &go_on, FSDP_CHECKPOINT_HURRY);
}

void fsdp_checkpoints_abandon(fsdp_checkpoints_t *cp) {
  atomic_store(&cp->stopping, FSDP_CHECKPOINT_ABANDON);
}

void fsdp_checkpoints_expire(fsdp_checkpoints_t *cp, uint64_t now_ms) {
  ck_expire_sends(cp, now_ms);
  for (checkpoint_work_t *c = cp->works; c; c = c->next) {
    if (c->stage != SAVE_AT_BOUNDARY || !c->boundary_deadline_ms ||
        now_ms < c->boundary_deadline_ms)
      continue;
    fsdp_status_set(&c->st, FSDP_E_DEADLINE_EXCEEDED,
                    "SaveCheckpoint: job '%s' came to no step boundary within "
                    "store.collective_timeout (%llu ms) once the checkpoint it waited for had "
                    "ended: not saved",
                    c->owner->name, (unsigned long long)cp->dp->collective_timeout_ms);
    ck_unlink_work(cp, c);
    ck_end_checkpoint(c->owner, c, 0);
    fsdp_checkpoints_expire(cp, now_ms); /* the list changed: from its start again */
    return;
  }
}

bool fsdp_checkpoints_uses_job(const fsdp_checkpoints_t *cp, const fsdp_job_t *job) {
  for (const checkpoint_work_t *c = cp->works; c; c = c->next)
    if (c->owner == job)
      return true;
  return ck_looks_at_job(cp, job) || ck_replicas_use_job(cp, job);
}

void fsdp_checkpoints_cleanup(fsdp_checkpoints_t *cp) {
  while (cp && cp->works) {
    checkpoint_work_t *c = cp->works;
    cp->works = c->next;
    ck_free_checkpoint_work(c);
  }
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
  if (fsdp_dataplane_job_resuming(job))
    return; /* its state is the checkpoint's, not loaded yet */
  /* A save waiting for a boundary takes this one: at once, or when the staging memory is
   * free, as any save that waited. */
  for (checkpoint_work_t *c = cp->works; c && step; c = c->next)
    if (c->owner == job && c->stage == SAVE_AT_BOUNDARY) {
      c->stage = SAVE_WAITING;
      c->asked_step = step;
      c->asked_at = ck_job_steps(job);
      if (!ck_staging_user(cp, job))
        ck_start_save(cp, job, c);
      return; /* a scheduled save of the step would find the staging memory in use */
    }
  fsdp_job_checkpoints_t *ck = ck_job(job);
  if (!cp->every_steps || !cp->dir[0] || step == 0 || step % cp->every_steps != 0 || !ck ||
      step <= ck->checkpointed_step)
    return;
  ck->checkpointed_step = step;
  if (ck_staging_user(cp, job)) {
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

/* Whether dir is checkpoint.dir/<job>/ or below it. */
static bool in_job_dir(const fsdp_checkpoints_t *cp, const fsdp_job_t *job, const char *dir) {
  char own[PATH_MAX];
  int n = snprintf(own, sizeof own, "%s/%s", cp->dir, job->name);
  /* Paths are walked with ".." refused (common/dirs.h): a prefix is a place. */
  return cp->dir[0] && n > 0 && (size_t)n < sizeof own && strncmp(dir, own, (size_t)n) == 0 &&
         (dir[n] == '\0' || dir[n] == '/');
}

checkpoint_work_t *ck_new_work(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                               const fsdp_identity_t *as, int stage, uint64_t step,
                               fsdp_checkpoints_done_fn done, void *data, const char *verb,
                               fsdp_status_t *st) {
  if (strlen(dir) >= sizeof ((checkpoint_work_t *)NULL)->dir) {
    fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "%s: path too long", verb);
    return NULL;
  }
  /* The job's checkpoint state is made here, on the loop, for the pool threads its work
   * runs on. */
  checkpoint_work_t *c = ck_job(job) ? calloc(1, sizeof *c) : NULL;
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
  ck_append_work(cp, c);
  return c;
}

/* A load (a resume's too) or a save (the schedule's, a stop's...: origin), once the caller's own
 * conditions hold. */
static int checkpoint_job(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                          const fsdp_identity_t *as, bool load, enum origin origin,
                          uint64_t step,
                          fsdp_checkpoints_done_fn done, void *data, fsdp_status_t *st) {
  const char *verb = load ? "LoadCheckpoint" : "SaveCheckpoint";
  if (!load && fsdp_dataplane_job_resuming(job))
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "%s: job '%s' resumes from a checkpoint not loaded yet: save once "
                           "its first gather has loaded it",
                           verb, job->name);
  /* A load reads through the staging memory a save writes from. */
  const checkpoint_work_t *user = ck_staging_user(cp, job);
  if (load && user)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "%s: job '%s' has a %s under way: load once it ends (fsdpctl "
                           "status shows it)",
                           verb, job->name, user->stage == LOADING ? "load" : "save");
  /* One checkpoint of a job at a time in its staging memory: later saves wait their turn. */
  checkpoint_work_t *c = ck_new_work(cp, job, dir, as,
                                  load ? LOADING : user ? SAVE_WAITING : SAVE_SNAPSHOT, step,
                                  done, data, verb, st);
  if (!c)
    return st->code;
  c->scheduled = origin == BY_SCHEDULE;
  c->by_trainer = origin == BY_TRAINER;
  c->resume = origin == BY_RESUME;
  if (c->stage == SAVE_WAITING) {
    c->asked_at = ck_job_steps(job);
    log_info("job '%s': a save into %s waits for the checkpoint under way", job->name, dir);
    return 0;
  }
  int r = ck_queue_checkpoint(cp, job, c, st);
  if (r < 0) {
    ck_unlink_work(cp, c);
    ck_free_checkpoint_work(c);
  }
  return r;
}

int fsdp_checkpoints_start(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                           const fsdp_checkpoints_caller_t *caller, bool load, uint64_t step,
                           fsdp_checkpoints_done_fn done, void *data, fsdp_status_t *st) {
  /* A collective that only waits for ranks runs after the load, in turn. */
  const fsdp_unit_t *busy = load ? ck_collective_running(job) : NULL;
  if (busy)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "LoadCheckpoint: job '%s': unit '%s' has a collective running: "
                           "load between steps",
                           job->name, busy->spec->unit);
  uint64_t completed = ck_job_steps(job).completed;
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

int fsdp_checkpoints_save_at_boundary(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                                      bool attached, fsdp_checkpoints_done_fn done, void *data,
                                      fsdp_status_t *st) {
  if (fsdp_dataplane_job_resuming(job))
    return 1; /* its state is still the checkpoint it resumes from */
  job_steps_t now = ck_job_steps(job);
  uint64_t step = now.completed;
  if (!now.trained || (now.even && step == 0))
    return 1; /* nothing trained: its trainers start it again from their initial values */
  bool between = now.even && !now.reducing;
  if (!between && !attached)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "job '%s' stopped inside a step (its units have reduced different "
                           "steps) and no trainer is attached to finish it: not saved",
                           job->name);
  bool final = !attached || ck_masters_final(job, step);
  if (between && final)
    return checkpoint_job(cp, job, dir, NULL, false, BY_STOP, 0, done, data, st);
  if (!ck_new_work(cp, job, dir, NULL, SAVE_AT_BOUNDARY, 0, done, data, "SaveCheckpoint", st))
    return st->code;
  log_info("job '%s': saves at its next step boundary", job->name);
  return 0;
}

typedef struct resume_call {
  fsdp_checkpoints_t *cp;
  fsdp_job_t *job;
  bool from_replica; /* store.recover_from_replicas's, else checkpoint.resume's */
} resume_call_t;

static void resumed(void *data, const fsdp_status_t *st, const char *path, uint64_t step) {
  resume_call_t call = *(resume_call_t *)data;
  free(data);
  (void)path, (void)step; /* end_checkpoint logged them */
  fsdp_status_t said = *st;
  if (st->code < 0 && !call.from_replica)
    fsdp_status_set(&said, st->code, "checkpoint.resume = latest: %s", st->message);
  fsdp_dataplane_resumed(call.cp->dp, call.job, &said);
}

/* Loads the checkpoint the job resumes from, or its state from a replica's memory, once;
 * its gathers wait for it. */
static void resume(void *ctx, fsdp_job_t *job) {
  fsdp_checkpoints_t *cp = ctx;
  char *from = job->checkpoints->resume_from;
  job->checkpoints->resume_from = NULL;
  fsdp_status_t st;
  resume_call_t *call = malloc(sizeof *call);
  int r = call ? 0 : fsdp_status_set(&st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory");
  if (call) {
    *call = (resume_call_t){.cp = cp, .job = job,
                            .from_replica = job->checkpoints->recover ||
                                            job->checkpoints->recover_error};
    r = call->from_replica
            ? ck_recover_from_replica(cp, job, resumed, call, &st)
            : checkpoint_job(cp, job, from, NULL, true, BY_RESUME, 0, resumed, call, &st);
  }
  free(from);
  if (r < 0 && call)
    resumed(call, &st, "", 0);
  else if (r < 0)
    fsdp_dataplane_resumed(cp->dp, job, &st);
}

const char *fsdp_checkpoints_save_state(const fsdp_checkpoints_t *cp, const fsdp_job_t *job) {
  static const char *const names[] = {"waiting for the step boundary",
                                      "waiting for the save before", "taking its snapshot",
                                      "writing", "sending it to a replica"};
  int stage = -1;
  for (const checkpoint_work_t *c = cp->works; c; c = c->next)
    if (c->owner == job && c->stage != LOADING && (int)c->stage > stage)
      stage = (int)c->stage;
  return stage < 0 ? "" : names[stage];
}

void fsdp_checkpoints_init(fsdp_checkpoints_t *cp, fsdp_dataplane_t *dp) {
  *cp = (fsdp_checkpoints_t){.dp = dp};
  dp->hooks = (fsdp_dataplane_hooks_t){
      .ctx = cp, .job_starts = ck_job_starts, .resume = resume, .step_boundary = step_boundary};
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

void fsdp_checkpoints_configure_recovery(fsdp_checkpoints_t *cp, bool from_replicas) {
  cp->recover = from_replicas;
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
