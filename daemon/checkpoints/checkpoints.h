/* The checkpoints of the daemon's jobs, over the data plane (checkpoint/checkpoint.h writes
 * and reads the files). A load reads its files into the job's staging memory beside the
 * data plane's queue, so that the other jobs' work goes on whatever the disk or the files
 * do, then copies them into the job's memory as a call on the queue, in turn with its
 * casts, reduces and optimizer steps, so that none of them runs meanwhile. A save's snapshot (a
 * copy of the job's masters, optimizer arrays and step counts into the job's staging
 * memory) runs beside the queue once no reduce of the job runs, with the job's later
 * reduces held until it ends (fsdp_dataplane_hold_reduces): the gathers of the next step go
 * on meanwhile. A trainer's own optimizer writing its masters is not seen: save between
 * steps (fsdp_checkpoints_save_at_boundary). A save's files are written from the snapshot
 * beside the queue while training goes on; a save asked while another checkpoint of the
 * job runs waits for it. Through the data plane's hooks: the saves that wait for a step
 * boundary, the schedule's (checkpoint.every_steps), and the start of a job new to this
 * daemon, which looks beside the queue for what to resume from (checkpoint.resume) while
 * the job's registrations wait. Loop thread only. */
#ifndef FSDP_CHECKPOINTS_H
#define FSDP_CHECKPOINTS_H

#include <limits.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "common/identity.h"
#include "common/status.h"
#include "daemon/dataplane/dataplane.h"

typedef struct fsdp_checkpoints {
  fsdp_dataplane_t *dp;
  struct checkpoint_work *works; /* loads, and saves waiting, taking a snapshot or writing */
  struct start_look *looks; /* jobs' starts, looking for what to resume from */
  /* checkpoint.*: where and how often the jobs are saved on schedule, how many are kept. */
  char dir[PATH_MAX]; /* with the links of its existing part resolved */
  uint64_t every_steps;
  unsigned keep;
  uint64_t write_rate; /* bytes per second; 0: no cap */
  unsigned disk_share; /* percent of the time a scheduled save writes at most; 100: all */
  bool resume; /* checkpoint.resume = latest */
  bool recover;                       /* store.recover_from_replicas */
  struct replica_look *replica_looks; /* jobs' starts, asking their replicas */
  atomic_int stopping; /* FSDP_CHECKPOINT_HURRY, _ABANDON: the daemon stops */
} fsdp_checkpoints_t;

/* Checkpoints of dp's jobs (no schedule, no resume until configured); takes dp's hooks. */
void fsdp_checkpoints_init(fsdp_checkpoints_t *cp, fsdp_dataplane_t *dp);

/* Once the loop has ended: frees the saves left waiting for a boundary that never came.
 * NULL-safe. */
void fsdp_checkpoints_cleanup(fsdp_checkpoints_t *cp);

/* checkpoint.dir, .every_steps, .keep, .write_rate, .disk_share, .resume: a job is saved
 * into dir/<job>/ (dir's links resolved: it is the operator's) every every_steps steps (0
 * or an empty dir: never), at the step boundary, and keeps the disk writing at most
 * disk_share percent of the time (100: all of it); every save keeps `keep` checkpoints (0:
 * all) and writes at most write_rate bytes per second (0: no cap). With resume, a job new to
 * this daemon goes on from its newest checkpoint there: its units report that step as
 * reduced when they register, and it is loaded before the job's first gather (one that fails
 * to load fails the job's units, naming why). */
void fsdp_checkpoints_configure(fsdp_checkpoints_t *cp, const char *dir, uint64_t every_steps,
                                unsigned keep, uint64_t write_rate, unsigned disk_share,
                                bool resume);

/* store.recover_from_replicas: a job new to this daemon whose first unit other hosts
 * replicate (its replica ring: HYBRID_SHARD's other replica groups, NO_SHARD's every host)
 * first asks them whether they hold it trained; the first that does gives it its step, and
 * at its first gather its state, copied from that host's memory over UCX (no disk read). A
 * job no replica holds looks in checkpoint.dir as configured. A replica that cannot say yet
 * (it resumes itself, does not answer) is asked again until
 * store.collective_timeout; one that holds the job inside a step fails it at once: then the
 * job's first gather fails naming why, rather than starting anew. */
void fsdp_checkpoints_configure_recovery(fsdp_checkpoints_t *cp, bool from_replicas);

/* A replica's answers to Peer.Recover (ask decoded by the Peer service). Where job (NULL:
 * none of that name here) stands for ask's host: 0 with *ret_step its last completed step
 * (0: it trained none); NOT_FOUND (no such job of that uid, or a unit whose shards are not
 * the asking host's: no replica), FAILED_PRECONDITION (it resumes itself), ABORTED (its
 * units reduced different steps: it stopped inside one). */
int fsdp_checkpoints_replica_step(fsdp_checkpoints_t *cp, const fsdp_job_t *job,
                                  const fsdp_peers_recover_t *ask, uint64_t *ret_step,
                                  fsdp_status_t *st);

/* Sends the job's state (a snapshot, as a save's, but holding no reduce: none of the job's
 * can change it before the asking host joins its all-reduce) to ask's host, over UCX to the
 * daemon it joined at that rank and incarnation, once the job's units are the ones ask names
 * and it stands after ask's step (FAILED_PRECONDITION naming the unit and field, or the
 * step, otherwise). The snapshot is in memory of its own, so it waits for no save of the
 * job. A send not taken within store.collective_timeout fails the connection to that host.
 * done runs once,
 * on the loop, once it is sent (st NULL and the answer: step, bytes, XXH64) or failed.
 * Returns 0, or an error that st explains (done never runs). */
typedef void (*fsdp_checkpoints_sent_fn)(void *data, const fsdp_status_t *st,
                                         const fsdp_peers_recovered_t *answer);
int fsdp_checkpoints_send_to_replica(fsdp_checkpoints_t *cp, fsdp_job_t *job,
                                     const fsdp_peers_recover_t *ask,
                                     fsdp_checkpoints_sent_fn done, void *data,
                                     fsdp_status_t *st);

/* The host that asked the send started with `data` no longer waits (its call ended): what
 * has not been sent yet is not sent; done still runs (CANCELLED). */
void fsdp_checkpoints_abandon_send(fsdp_checkpoints_t *cp, const void *data);

/* Who asks for a checkpoint: whose rights its files are used with (the caller's, as it
 * connected), and whether a trainer of the job asks, whose saves name at most the job's
 * last completed step (an operator may name any). */
typedef struct fsdp_checkpoints_caller {
  fsdp_identity_t as;
  bool trainer;
} fsdp_checkpoints_caller_t;

/* A checkpoint's end, on the loop: st->code 0 with the step directory written or read and
 * its step, or an error that st explains. */
typedef void (*fsdp_checkpoints_done_fn)(void *data, const fsdp_status_t *st, const char *path,
                                         uint64_t step);

/* Saves the job's state on this host (every unit's masters, the optimizer's state) into a
 * checkpoint of `step` under dir (0: the least reduced_step of its trainable units, beyond
 * which a trainer may name none: OUT_OF_RANGE), or loads the one at dir into the job's
 * registered units (`step` unused). The files are used with the caller's rights
 * (checkpoint/checkpoint.h: no link followed): the daemon's own rights serve only its own
 * directory for the job, checkpoint.dir/<job>/ and below (and a NULL caller: the daemon),
 * where a load reads only a checkpoint saved by a job of the same uid. A daemon that may not take a
 * caller's rights (it is not root) refuses other paths of a caller of another uid
 * (PERMISSION_DENIED, at the work's start). done is called once, on
 * the loop, once the files are written or read, unless this fails at once (st says why:
 * FAILED_PRECONDITION for a unit without buffers, a save of a job whose resume has not
 * loaded yet, a load while a collective runs or while another checkpoint of the job is
 * under way: a save writes from the staging memory a load reads into). A save asked while
 * another checkpoint of the job is under way waits for it; if the job has reduced since it
 * was asked, it then holds the job's step as it is then (its reply says which) when the job
 * is between steps, else the one of its next step boundary, never the inside of a step
 * (fsdp_checkpoints_expire ends it if none comes). The
 * job's memory may be a GPU's: it goes to and from the host's staging memory through the
 * backend. dir is copied. */
int fsdp_checkpoints_start(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                           const fsdp_checkpoints_caller_t *caller, bool load, uint64_t step,
                           fsdp_checkpoints_done_fn done, void *data, fsdp_status_t *st);

/* Saves the job into dir (as fsdp_checkpoints_start) at its step boundary: at once when it
 * is at one (no reduce running, every trainable unit reduced the same step, and that step's
 * masters final: the daemon's optimizer stepped them, every local rank asked a gather of
 * the next step, or no trainer is attached to write them), otherwise when every local rank
 * asks the forward's gather of the next step. Returns 0 (done is called once), 1 when the
 * job has not trained a step (nothing to save; done is not called), or an error:
 * FAILED_PRECONDITION for a job stopped inside a step with no trainer attached (attached
 * false) to finish it. */
int fsdp_checkpoints_save_at_boundary(fsdp_checkpoints_t *cp, fsdp_job_t *job, const char *dir,
                                      bool attached, fsdp_checkpoints_done_fn done, void *data,
                                      fsdp_status_t *st);

/* What Operator.Status and the metrics show of a job's checkpoints: its staging memory's
 * bytes, the last save this daemon wrote (step 0 and path "": none; the path is the job's,
 * valid until its next save), and the saves and loads that ended, by outcome, with the bytes
 * and the time of those that succeeded (a save's: its snapshot and its writing). */
typedef struct fsdp_checkpoints_job_info {
  size_t staging_bytes;
  uint64_t last_step;
  const char *last_path;
  uint64_t saved, save_failed, loaded, load_failed;
  uint64_t saved_bytes, loaded_bytes;
  uint64_t save_ns, load_ns;
} fsdp_checkpoints_job_info_t;
void fsdp_checkpoints_job_info(const fsdp_job_t *job, fsdp_checkpoints_job_info_t *ret_info);

/* What the job's saves are doing, the furthest along: "" (none), "waiting for the step
 * boundary", "waiting for the save before", "taking its snapshot", "writing". Static. */
const char *fsdp_checkpoints_save_state(const fsdp_checkpoints_t *cp, const fsdp_job_t *job);

/* Ends with DEADLINE_EXCEEDED the saves that waited for another and then for a step
 * boundary that has not come within store.collective_timeout; from the housekeeping timer
 * (now_ms: loop time). */
void fsdp_checkpoints_expire(fsdp_checkpoints_t *cp, uint64_t now_ms);

/* The daemon begins to stop: saves under way and to come write at the disk's speed,
 * checkpoint.write_rate and .disk_share no longer holding them back, so that the saves the
 * stop waits for (and those they wait for) end soon. */
void fsdp_checkpoints_hurry(fsdp_checkpoints_t *cp);

/* The daemon stops: saves writing stop at their next chunk and fail (ABORTED), the
 * checkpoints before them as they were. */
void fsdp_checkpoints_abandon(fsdp_checkpoints_t *cp);

/* Whether a checkpoint of the job waits or is under way, or its start looks for what to
 * resume from (its memory must stay). */
bool fsdp_checkpoints_uses_job(const fsdp_checkpoints_t *cp, const fsdp_job_t *job);

#endif
