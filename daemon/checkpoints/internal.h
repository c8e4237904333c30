/* What the checkpoints' files share: a checkpoint's work and where the job stands among its
 * steps, and the steps each file offers the others. Internal to daemon/checkpoints/
 * (checkpoints.h is the contract). */
#ifndef FSDP_CHECKPOINTS_INTERNAL_H
#define FSDP_CHECKPOINTS_INTERNAL_H

#include <limits.h>
#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "checkpoint/checkpoint.h"
#include "daemon/checkpoints/checkpoints.h"

/* What the checkpoints keep of a job (fsdp_job_t.checkpoints), made on the loop at its first
 * need (ck_job) and freed with the job. */
typedef struct fsdp_job_checkpoints {
  uint64_t checkpointed_step; /* the last step checkpoint.every_steps saved */
  /* A save's snapshot of the job's state, written from while training goes on, or what a
   * load reads before it goes into the job's memory; kept for the next checkpoint. */
  void *staging;
  size_t staging_bytes;
  uint64_t last_step; /* the last save this daemon wrote, in last_path */
  char *last_path;    /* its step directory; NULL: none */
  /* checkpoint.resume = latest: the checkpoint to load at the job's first gather, until
   * that gather starts the load (fsdp_dataplane_job_resuming says while it waits). */
  char *resume_from;
  /* store.recover_from_replicas: the job goes on from the state of replica host
   * recover_host, copied from its memory at the job's first gather (recover), or fails that
   * gather naming recover_error (its replicas held it inside a step). */
  bool recover;
  unsigned recover_host;
  char *recover_error;
  /* The saves and loads that ended (fsdp_checkpoints_job_info's counts). */
  uint64_t saved, save_failed, loaded, load_failed, saved_bytes, loaded_bytes, save_ns, load_ns;
} fsdp_job_checkpoints_t;

/* Who asked for a checkpoint's work (checkpoint_job). */
enum origin { BY_CALLER, BY_TRAINER, BY_SCHEDULE, BY_STOP, BY_RESUME, BY_REPLICA };

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
  enum { SAVE_AT_BOUNDARY, SAVE_WAITING, SAVE_SNAPSHOT, SAVE_WRITING, SAVE_SENDING,
         LOADING } stage;
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
  /* Recovery from a replica (replicas.c): a load's state comes from host `peer`'s memory
   * instead of files, and a snapshot goes to host `peer` instead of a disk; the tag of what
   * is sent names the asking daemon (peer_incarnation), xxh64 is its checksum, transfer the
   * UCX side of it and what each side waits for. */
  bool by_replica;
  unsigned peer;
  uint64_t peer_incarnation;
  uint64_t xxh64;
  struct replica_io *replica;
  fsdp_status_t st;
  fsdp_checkpoints_done_fn done;
  void *data;
  uv_work_t work; /* a save's snapshot, then its write */
  struct checkpoint_work *next; /* in cp->works */
} checkpoint_work_t;

/* requests.c */

/* A checkpoint's work at `stage` into dir, in cp->works, with the rights of as (NULL, or a
 * dir in checkpoint.dir/<job>/: the daemon's own); NULL with st set (verb naming the
 * call) for want of memory or a path too long. */
checkpoint_work_t *ck_new_work(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                               const fsdp_identity_t *as, int stage, uint64_t step,
                               fsdp_checkpoints_done_fn done, void *data, const char *verb,
                               fsdp_status_t *st);

/* job_start.c */

/* The data plane's job_starts: starts the look beside the queue when checkpoint.dir is set
 * (then true: the job's registrations wait for fsdp_dataplane_looked). */
bool ck_job_starts(void *ctx, fsdp_job_t *job, const fsdp_unit_t *unit);

/* Whether a start of the job looks (the job's memory must stay: the loop runs until every
 * look has ended, a stop included). */
bool ck_looks_at_job(const fsdp_checkpoints_t *cp, const fsdp_job_t *job);

/* The look in checkpoint.dir (host 0's clearing of unfinished saves, checkpoint.resume's
 * search), when there is one to make: then true, and it ends with fsdp_dataplane_looked. */
bool ck_disk_look(fsdp_checkpoints_t *cp, fsdp_job_t *job);

/* replicas.c */

/* Whether c is a replica's snapshot sent to a host that recovers (no save: it uses memory of
 * its own, and counts as none of the job's checkpoints). */
static inline bool ck_is_replica_send(const checkpoint_work_t *c) {
  return c->by_replica && c->stage != LOADING;
}

/* The data plane's job_starts for a job whose first unit (unit) other hosts replicate, with
 * store.recover_from_replicas: asks them whether they hold the job trained (then true: the
 * job's registrations wait for fsdp_dataplane_looked, which the look calls on a later turn
 * of the loop, or the disk's look it goes on to when none does). */
bool ck_replicas_look(fsdp_checkpoints_t *cp, fsdp_job_t *job, const fsdp_unit_t *unit);

/* The job's first gather: its state is copied from ck->recover_host's memory and loaded;
 * done as a load's. Returns 0, or an error that st explains (done is not called). */
int ck_recover_from_replica(fsdp_checkpoints_t *cp, fsdp_job_t *job,
                            fsdp_checkpoints_done_fn done, void *data, fsdp_status_t *st);

/* A replica's snapshot is taken (stage SAVE_SENDING): it goes to the asking host. */
void ck_send_snapshot(fsdp_checkpoints_t *cp, checkpoint_work_t *c);

/* A replica's snapshot for the host that asked: memory of the work's own (NULL with c->st
 * set when there is none), not the job's staging memory. On a pool thread. */
void *ck_replica_snapshot(checkpoint_work_t *c);

/* Frees what a work of replicas.c holds (NULL-safe). */
void ck_free_replica_io(struct replica_io *io);

/* Whether a look of replicas.c uses the job. */
bool ck_replicas_use_job(const fsdp_checkpoints_t *cp, const fsdp_job_t *job);

/* Ends the sends to a recovering host that it has not taken within store.collective_timeout
 * (their connection failed: UCX ends a send no other way); from the housekeeping. */
void ck_expire_sends(fsdp_checkpoints_t *cp, uint64_t now_ms);

/* describe.c */

/* The job's checkpoint state, made on first need; NULL when there is no memory for it. Loop
 * thread only: a pool thread uses the one its work's start made. */
fsdp_job_checkpoints_t *ck_job(fsdp_job_t *job);

/* Where the job stands among its steps now (scratch units left out). */
job_steps_t ck_job_steps(const fsdp_job_t *job);

/* Whether the job's masters are final for `step`: the daemon's optimizer stepped them, or
 * every local rank asked a gather of the next step (a trainer's optimizer wrote them). */
bool ck_masters_final(fsdp_job_t *job, uint64_t step);

/* The unit of the job with a collective running, or NULL. */
const fsdp_unit_t *ck_collective_running(const fsdp_job_t *job);

/* Whether the daemon's optimizer steps every trainable unit: no trainer writes masters. */
bool ck_daemon_steps_every_unit(fsdp_job_t *job);

/* Describes the job as it is now into c. */
int ck_describe(fsdp_job_t *job, checkpoint_work_t *c, fsdp_status_t *st);

/* io.c */

/* On a pool thread, beside the queue (the other jobs' work goes on, whatever the disk or
 * the files do): a load reads the checkpoint into the job's staging memory, every block
 * checked before anything goes into the job's memory, so that a refusal leaves the job as
 * it was. */
void ck_read_load(uv_work_t *req);

/* On a pool thread, in the queue's turn (none of the job's casts, reduces or optimizer
 * steps runs meanwhile): what the load read goes into the job's memory. */
void ck_copy_load(void *arg);

/* On a pool thread, beside the queue, the job's reduces held: a save's snapshot, the job's
 * buffers copied into staging, which the save then writes from. Nothing, when describing
 * the job failed (c->st says why). */
void ck_take_snapshot(uv_work_t *req);

/* The job's staging memory for c's units, made or grown on first need (NULL with c->st set
 * when there is no memory for it). Only one checkpoint of the job uses it at a time. */
void *ck_staging(fsdp_job_t *job, checkpoint_work_t *c);

/* Staging memory of at least *bytes, which it rounds up to a multiple of its alignment (the
 * size made), faulted in; NULL without. */
void *ck_alloc_staging(size_t *bytes);

/* On a thread of libuv's pool, beside the queue: a save's files, from its snapshot, written
 * by a thread of the lowest priority (the pool's threads run the queue's work too, so they
 * keep theirs), or by this one when none can start. */
void ck_write_checkpoint(uv_work_t *req);

/* stages.c */

/* Frees c and what it owns. */
void ck_free_checkpoint_work(checkpoint_work_t *c);

/* On the loop: a checkpoint's end. */
void ck_end_checkpoint(fsdp_job_t *job, checkpoint_work_t *c, int status);

/* On the loop: a checkpoint ends, and the save waiting for it, if any, starts. */
void ck_end_work(fsdp_checkpoints_t *cp, checkpoint_work_t *c, int status);

/* On the loop, once a load's state is in staging (read_load ran): the copy into the job's
 * memory waits for the queue's turn. */
void ck_load_read(uv_work_t *req, int status);

/* Takes c out of cp->works, or puts it at their end. */
void ck_unlink_work(fsdp_checkpoints_t *cp, checkpoint_work_t *c);
void ck_append_work(fsdp_checkpoints_t *cp, checkpoint_work_t *c);

/* The checkpoint of the job that uses its staging memory (a save taking its snapshot or
 * writing, a load), or NULL. */
const checkpoint_work_t *ck_staging_user(const fsdp_checkpoints_t *cp,
                                         const fsdp_job_t *job);

/* The staging memory is free: the save c, waiting, takes its snapshot, unless the job has
 * trained since it was asked and is inside a step (see asked_at). */
void ck_start_save(fsdp_checkpoints_t *cp, fsdp_job_t *job, checkpoint_work_t *c);

/* Starts c's work, described as the job is now: a load in the queue's turn, a save's
 * snapshot once no reduce of the job runs, holding those of later steps. */
int ck_queue_checkpoint(fsdp_checkpoints_t *cp, fsdp_job_t *job, checkpoint_work_t *c,
                        fsdp_status_t *st);

#endif
