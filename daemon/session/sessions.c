/* Trainer sessions: attach, use, expire. */
#include "daemon/session/sessions.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "fsdp/v1/trainer.pb-c.h"

static fsdp_session_t *find_id(const fsdp_sessions_t *sessions, uint64_t id) {
  for (fsdp_session_t *s = sessions->head; s; s = s->next)
    if (s->id == id)
      return s;
  return NULL;
}

/* The first session of `job`, or NULL. */
static const fsdp_session_t *find_job(const fsdp_sessions_t *sessions, const char *job) {
  for (const fsdp_session_t *s = sessions->head; s; s = s->next)
    if (strcmp(s->job, job) == 0)
      return s;
  return NULL;
}

/* Session ids are random so that one trainer cannot guess another's by counting. */
static int new_id(const fsdp_sessions_t *sessions, uint64_t *ret_id) {
  for (;;) {
    uint64_t id;
    if (getrandom(&id, sizeof id, 0) != sizeof id)
      return -errno;
    if (id != 0 && !find_id(sessions, id)) {
      *ret_id = id;
      return 0;
    }
  }
}

void fsdp_sessions_init(fsdp_sessions_t *sessions) {
  memset(sessions, 0, sizeof *sessions);
}

void fsdp_sessions_cleanup(fsdp_sessions_t *sessions) {
  while (sessions && sessions->head)
    fsdp_sessions_end(sessions, sessions->head);
}

/* Whether `pid` names process peer_pid in one of its pid namespaces: a trainer in a
 * container knows itself by its namespace's pid, SO_PEERCRED gives ours ("NSpid: 4711 12"). */
static bool is_pid_of(pid_t peer_pid, pid_t pid) {
  if (pid == peer_pid)
    return true;
  char path[64], line[512];
  snprintf(path, sizeof path, "/proc/%ld/status", (long)peer_pid);
  FILE *f = fopen(path, "re");
  if (!f)
    return false;
  bool found = false;
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "NSpid:", 6) != 0)
      continue;
    char *p = line + 6, *end;
    for (long v; (v = strtol(p, &end, 10)), end != p; p = end)
      if (v == pid)
        found = true;
    break;
  }
  fclose(f);
  return found;
}

static int check_request(const Fsdp__V1__AttachRequest *rq, const fsdp_credentials_t *cred,
                         fsdp_status_t *st) {
  if (!fsdp_job_name_valid(rq->job))
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'job' = '%.80s' must be 1 to %d of [A-Za-z0-9._-]", rq->job,
                           FSDP_JOB_NAME_MAX);
  if (rq->local_world_size == 0 || rq->local_world_size > FSDP_LOCAL_WORLD_MAX)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'local_world_size' = %u is outside [1, %d]",
                           rq->local_world_size, FSDP_LOCAL_WORLD_MAX);
  if (rq->local_rank >= rq->local_world_size)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'local_rank' = %u is outside [0, %u) (local_world_size)",
                           rq->local_rank, rq->local_world_size);
  if (rq->pid <= 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'pid' = %d must be the caller's process id", rq->pid);
  if (strlen(rq->job_token) > FSDP_JOB_TOKEN_MAX)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'job_token' is %zu bytes, more than %d", strlen(rq->job_token),
                           FSDP_JOB_TOKEN_MAX);
  if (!cred)
    return fsdp_status_set(st, FSDP_E_PERMISSION_DENIED,
                           "cannot identify the calling process: attach over the unix socket");
  if (!is_pid_of(cred->pid, rq->pid))
    return fsdp_status_set(st, FSDP_E_PERMISSION_DENIED,
                           "field 'pid' = %d, but the connection belongs to pid %d", rq->pid,
                           (int)cred->pid);
  return 0;
}

/* Whether `token` is the owner's, in time that does not depend on where they differ. */
static bool token_is(const fsdp_job_owner_t *owner, const char *token) {
  size_t len = strlen(token); /* at most FSDP_JOB_TOKEN_MAX: checked */
  unsigned char diff = owner->token_len != len;
  for (size_t i = 0; i < FSDP_JOB_TOKEN_MAX; i++)
    diff |= (unsigned char)(owner->token[i] ^ (i < len ? token[i] : 0));
  return diff == 0;
}

/* Jobs share the daemon's socket with every trainer of its group: without this, anyone in it
 * could attach as a rank whose trainer is gone, read the job's parameters and write what the
 * job gathers next. Root gets no exception: the rule keeps two jobs apart, and a trainer run
 * as root under another's job name is a clash to refuse, not a wish to honour. */
static int check_owner(const fsdp_job_owner_t *owner, const Fsdp__V1__AttachRequest *rq,
                       const fsdp_credentials_t *cred, fsdp_status_t *st) {
  if (owner->uid != cred->uid)
    return fsdp_status_set(st, FSDP_E_PERMISSION_DENIED,
                           "job '%s' belongs to uid %u (whose trainer attached it first), not "
                           "to the calling uid %u; every trainer of a job runs as its owner",
                           rq->job, (unsigned)owner->uid, (unsigned)cred->uid);
  if (!token_is(owner, rq->job_token))
    return fsdp_status_set(st, FSDP_E_PERMISSION_DENIED,
                           "field 'job_token' is not the job token job '%s' was first attached "
                           "with; every trainer of a job gives the one its launcher handed out, "
                           "or none",
                           rq->job);
  return 0;
}

int fsdp_sessions_attach(fsdp_sessions_t *sessions, const Fsdp__V1__AttachRequest *rq,
                         const fsdp_credentials_t *cred, const fsdp_job_owner_t *job_owner,
                         uint64_t now_ms, unsigned max_sessions, fsdp_session_t **ret_session,
                         fsdp_status_t *st) {
  int r = check_request(rq, cred, st);
  if (r < 0)
    return r;
  /* The store knows the owner as long as the job's units live; before, its sessions do (they
   * all have the same). */
  if (!job_owner) {
    const fsdp_session_t *first = find_job(sessions, rq->job);
    job_owner = first ? &first->owner : NULL;
  }
  if (job_owner && (r = check_owner(job_owner, rq, cred, st)) < 0)
    return r;
  for (fsdp_session_t *s = sessions->head; s; s = s->next) {
    if (strcmp(s->job, rq->job) != 0)
      continue;
    if (s->local_world_size != rq->local_world_size)
      return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                             "job '%s' has local_world_size %u (local rank %u attached with it), "
                             "not %u",
                             rq->job, s->local_world_size, s->local_rank, rq->local_world_size);
    if (s->local_rank == rq->local_rank && s->pid == cred->pid && !s->channel) {
      /* The same process again before it opened the memory channel: its earlier reply was
       * lost, or it retries. With the channel open, it is a second trainer for the rank. */
      s->last_call_ms = now_ms;
      *ret_session = s;
      return 0;
    }
    if (s->local_rank == rq->local_rank)
      return fsdp_status_set(st, FSDP_E_ALREADY_EXISTS,
                             "job '%s' local rank %u is already attached (session %016llx, pid %d)",
                             rq->job, rq->local_rank, (unsigned long long)s->id, (int)s->pid);
  }
  if (sessions->count >= max_sessions)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED,
                           "the daemon holds %u sessions (session.max_sessions = %u)",
                           sessions->count, max_sessions);
  fsdp_session_t *s = calloc(1, sizeof *s);
  if (!s)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for a session");
  if ((r = new_id(sessions, &s->id)) < 0) {
    free(s);
    return fsdp_status_set(st, r, "cannot draw a session id: %s", fsdp_strerror(r));
  }
  memcpy(s->job, rq->job, strlen(rq->job) + 1);
  s->local_rank = rq->local_rank;
  s->local_world_size = rq->local_world_size;
  s->generation = rq->generation;
  s->pid = cred->pid; /* the daemon's view, which later calls are checked against */
  s->owner.uid = cred->uid;
  s->owner.token_len = strlen(rq->job_token);
  memcpy(s->owner.token, rq->job_token, s->owner.token_len);
  s->attached_ms = s->last_call_ms = now_ms;
  s->serial = sessions->attaches++;
  s->next = sessions->head;
  sessions->head = s;
  sessions->count++;
  *ret_session = s;
  return 0;
}

int fsdp_sessions_use(fsdp_sessions_t *sessions, uint64_t id, const fsdp_credentials_t *caller,
                      uint64_t now_ms, fsdp_session_t **ret_session, fsdp_status_t *st) {
  fsdp_session_t *s = find_id(sessions, id);
  if (!s)
    return fsdp_status_set(st, FSDP_E_NOT_FOUND,
                           "session %016llx is not attached (it detached, its lease ran out, or "
                           "it never was)",
                           (unsigned long long)id);
  /* Session ids are shown to operators; holding one is no licence to act for its process. */
  if (!caller || caller->pid != s->pid)
    return fsdp_status_set(st, FSDP_E_PERMISSION_DENIED,
                           "session %016llx belongs to pid %d, not to the calling pid %d",
                           (unsigned long long)id, (int)s->pid, caller ? (int)caller->pid : -1);
  s->last_call_ms = now_ms;
  *ret_session = s;
  return 0;
}

void fsdp_session_call_parked(fsdp_session_t *session) {
  session->parked++;
}

void fsdp_session_call_ended(fsdp_session_t *session, uint64_t now_ms) {
  session->parked--;
  if (now_ms > session->last_call_ms)
    session->last_call_ms = now_ms;
}

void fsdp_sessions_end(fsdp_sessions_t *sessions, fsdp_session_t *session) {
  for (fsdp_session_t **p = &sessions->head; *p; p = &(*p)->next) {
    if (*p == session) {
      *p = session->next;
      sessions->count--;
      free(session);
      return;
    }
  }
}

unsigned fsdp_sessions_expire(fsdp_sessions_t *sessions, uint64_t now_ms, uint64_t lease_ms,
                              void (*expired)(fsdp_session_t *session, void *data),
                              void *data) {
  unsigned n = 0;
  fsdp_session_t **p = &sessions->head;
  while (*p) {
    fsdp_session_t *s = *p;
    /* A trainer waiting in a collective makes no other call: it is alive while it waits. */
    if (s->parked || now_ms - s->last_call_ms < lease_ms) {
      p = &s->next;
      continue;
    }
    if (expired)
      expired(s, data);
    *p = s->next;
    sessions->count--;
    free(s);
    n++;
  }
  return n;
}
