/* A job's start (the data plane's job_starts hook): its replicas are asked whether they hold
 * it (replicas.c); where none does, host 0 removes what unfinished saves left
 * in checkpoint.dir/<job>/ (fsdp_checkpoint_remove_unfinished), and with checkpoint.resume =
 * latest the newest checkpoint there is found, for the job to go on from it, loaded before
 * its first gather. One that cannot be read is still loaded then, and fails the job naming
 * why: it does not start anew without a word. Both read the disk and the directory's files,
 * which may be slow or hostile, so they run beside the data plane's queue; the job's
 * registrations wait for them (fsdp_dataplane_looked), the other jobs do not. */
#include "daemon/checkpoints/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/checkpoint.h"
#include "common/failpoint.h"
#include "common/log.h"

typedef struct start_look {
  uv_work_t work;
  fsdp_checkpoints_t *cp;
  fsdp_job_t *job;        /* lives while the look runs (fsdp_checkpoints_uses_job) */
  char dir[PATH_MAX];     /* checkpoint.dir/<job> */
  bool remove_unfinished; /* host 0's */
  bool find;              /* checkpoint.resume */
  uint64_t uid;           /* the job's owner, whose checkpoints it may resume from */
  char from[PATH_MAX];    /* what find found */
  uint64_t step;
  int found;
  fsdp_status_t st;
  struct start_look *next; /* in cp->looks */
} start_look_t;

static void look(uv_work_t *req) {
  start_look_t *l = req->data;
  fsdp_failpoint("checkpoint-look"); /* its sleep: a slow disk */
  if (l->remove_unfinished)
    fsdp_checkpoint_remove_unfinished(l->dir, l->job->name);
  if (l->find)
    l->found = fsdp_checkpoint_find(l->dir, l->job->name, &l->uid, l->from, sizeof l->from,
                                    &l->step, &l->st);
}

/* Whether the look found a checkpoint to resume from, or one to fail the job with; sets the
 * job's resume_from, and *ret_step to the step it goes on after (0: unknown). */
static bool resumes(const start_look_t *l, fsdp_job_checkpoints_t *ck, uint64_t *ret_step) {
  const char *name = l->job->name;
  if (l->found < 0 && l->st.code == FSDP_E_NOT_FOUND) {
    log_info("job '%s': nothing to resume from in %s: it starts anew", name, l->dir);
    return false;
  }
  if (l->found < 0) {
    log_error("job '%s': cannot resume: %s", name, l->st.message);
    /* Loaded all the same at the first gather, which fails naming why. */
    ck->resume_from = strdup(l->st.code == FSDP_E_DATA_LOSS ? l->from : l->dir);
    return ck->resume_from != NULL;
  }
  ck->resume_from = strdup(l->from);
  if (!ck->resume_from)
    return false;
  *ret_step = l->step;
  ck->checkpointed_step = l->step; /* the schedule does not save it again */
  log_info("job '%s': resumes from %s, after step %llu, at its first gather", name,
           ck->resume_from, (unsigned long long)l->step);
  return true;
}

static void looked(uv_work_t *req, int status) {
  start_look_t *l = req->data;
  fsdp_checkpoints_t *cp = l->cp;
  for (start_look_t **p = &cp->looks; *p; p = &(*p)->next)
    if (*p == l) {
      *p = l->next;
      break;
    }
  uint64_t step = 0;
  bool resume = false;
  if (status < 0)
    log_error("job '%s': cannot look for a checkpoint to resume from: %s", l->job->name,
              uv_strerror(status));
  else if (l->find)
    resume = resumes(l, l->job->checkpoints, &step);
  fsdp_dataplane_looked(cp->dp, l->job, resume, step);
  free(l);
}

bool ck_looks_at_job(const fsdp_checkpoints_t *cp, const fsdp_job_t *job) {
  for (const start_look_t *l = cp->looks; l; l = l->next)
    if (l->job == job)
      return true;
  return false;
}

bool ck_job_starts(void *ctx, fsdp_job_t *job, const fsdp_unit_t *unit) {
  fsdp_checkpoints_t *cp = ctx;
  return ck_replicas_look(cp, job, unit) || ck_disk_look(cp, job);
}

bool ck_disk_look(fsdp_checkpoints_t *cp, fsdp_job_t *job) {
  if (!cp->dir[0])
    return false;
  start_look_t *l = calloc(1, sizeof *l);
  if (!l) {
    log_error("job '%s': no memory to look for a checkpoint in %s: it starts without one",
              job->name, cp->dir);
    return false;
  }
  *l = (start_look_t){.cp = cp, .job = job, .uid = job->owner.uid,
                      .remove_unfinished = !cp->dp->peers ||
                                           fsdp_peers_host_rank(cp->dp->peers) == 0,
                      .find = cp->resume && ck_job(job)};
  l->work.data = l;
  int n = snprintf(l->dir, sizeof l->dir, "%s/%s", cp->dir, job->name);
  if (n < 0 || (size_t)n >= sizeof l->dir) {
    free(l);
    return false;
  }
  int r = uv_queue_work(cp->dp->loop, &l->work, look, looked);
  if (r < 0) {
    log_error("job '%s': cannot look for a checkpoint to resume from: %s", job->name,
              uv_strerror(r));
    free(l);
    return false;
  }
  l->next = cp->looks;
  cp->looks = l;
  return true;
}
