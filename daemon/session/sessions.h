/* Trainer sessions: one per (job, local rank) on this host.
 *
 * A trainer attaches with its job, local rank, local world size L and pid; the daemon checks
 * the pid against the connection's SO_PEERCRED credentials (in any of the process's pid
 * namespaces), so a session always belongs to the process that opened it, and only that
 * process may use it. A job belongs to the uid (and job token) of its first trainer: an
 * Attach from another uid, or with another token, is refused. A second session for the same
 * (job, rank) is refused while the first lives, except that the same process attaching again
 * before it opened the session's memory channel (its reply was lost) gets its session back.
 * Every rank of a job must give the same L. A session ends on Detach or when its lease runs
 * out without a call (KeepAlive renews it). A call parked in the daemon (a collective waiting
 * for the other ranks) keeps its session alive however long it waits: the lease counts from
 * the end of the session's last call.
 *
 * Owned by the daemon, loop thread only. Sessions are few (session.max_sessions), so a list
 * is enough. */
#ifndef FSDP_SESSIONS_H
#define FSDP_SESSIONS_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/credentials.h"
#include "common/status.h"
#include "daemon/store/job_owner.h"
#include "proto/limits.h" /* FSDP_JOB_NAME_MAX, FSDP_LOCAL_WORLD_MAX */

typedef struct fsdp_session {
  uint64_t id;     /* random, never 0 */
  uint64_t serial; /* the daemon's count of Attaches before this one: orders sessions */
  char job[FSDP_JOB_NAME_MAX + 1];
  uint32_t local_rank;
  uint32_t local_world_size;
  uint64_t generation; /* the job's run, as the trainer said (AttachRequest.generation) */
  pid_t pid; /* as the daemon sees it (SO_PEERCRED) */
  fsdp_job_owner_t owner; /* its process's uid and the token it gave: its job's owner */
  uint64_t attached_ms;  /* loop time of the Attach */
  uint64_t last_call_ms; /* loop time of the latest call naming the session, or of the end of
                          * its last parked call, whichever came later */
  unsigned parked;       /* calls naming it that the daemon holds (fsdp_session_call_*) */
  void *channel;         /* its memory channel connection (daemon/session/channel.h), or NULL */
  void *fast_path;       /* its fast path (daemon/services/fastpath.h), or NULL */
  void *cuda_events;     /* its job on a GPU: daemon/services/trainer_events.h; else NULL */
  struct fsdp_session *next;
} fsdp_session_t;

/* fsdp.v1.AttachRequest (fsdp/v1/trainer.pb-c.h), named only here: the store and the data
 * plane use sessions without the protocol's headers. */
struct Fsdp__V1__AttachRequest;

typedef struct fsdp_sessions {
  fsdp_session_t *head;
  unsigned count;
  uint64_t attaches; /* so far: the next session's serial */
} fsdp_sessions_t;

void fsdp_sessions_init(fsdp_sessions_t *sessions);
/* Ends every session. */
void fsdp_sessions_cleanup(fsdp_sessions_t *sessions);

/* Opens a session for rq from the process with credentials `cred` (NULL: unknown, which is
 * refused).
 * job_owner: whom the job belongs to while the store keeps it (its units outlive its
 * sessions), NULL when the store does not know the job; then its sessions say. */
int fsdp_sessions_attach(fsdp_sessions_t *sessions, const struct Fsdp__V1__AttachRequest *rq,
                         const fsdp_credentials_t *cred, const fsdp_job_owner_t *job_owner,
                         uint64_t now_ms, unsigned max_sessions, fsdp_session_t **ret_session,
                         fsdp_status_t *st);

/* The session with this id, its lease renewed, if `caller` (NULL: unknown) is its process;
 * NOT_FOUND or PERMISSION_DENIED naming the id otherwise. */
int fsdp_sessions_use(fsdp_sessions_t *sessions, uint64_t id, const fsdp_credentials_t *caller,
                      uint64_t now_ms, fsdp_session_t **ret_session, fsdp_status_t *st);

/* Ends one session (Detach, its channel closed) and frees it: its parked calls must have
 * ended first (fsdp_dataplane_release_session), since they point to it. */
void fsdp_sessions_end(fsdp_sessions_t *sessions, fsdp_session_t *session);

/* A call naming the session is parked in the daemon, and the end of one (now_ms: when it
 * was answered or cancelled). While it has a parked call the session does not expire. */
void fsdp_session_call_parked(fsdp_session_t *session);
void fsdp_session_call_ended(fsdp_session_t *session, uint64_t now_ms);

/* Ends every session with no parked call and idle for lease_ms or more; calls
 * expired(session, data) for each just before it goes, so the daemon can release what it
 * holds and say so. Returns how many ended. */
unsigned fsdp_sessions_expire(fsdp_sessions_t *sessions, uint64_t now_ms, uint64_t lease_ms,
                              void (*expired)(fsdp_session_t *session, void *data),
                              void *data);

#endif
