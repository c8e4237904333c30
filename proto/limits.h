/* The limits and names the trainers' side (libfsdp, fsdpctl, python/fsdpd) and the daemon
 * must agree on, in one place: a client that checks a request before sending it checks it
 * against the daemon's own numbers, and finds the daemon's sockets by the daemon's own names.
 *
 * They belong to the protocol (FSDP_PROTOCOL_VERSION in include/fsdp/fsdp_version.h): lowering
 * a limit, or renaming a socket, breaks clients built against the old value, so it comes with
 * a new protocol version. The public headers repeat some of them in prose (fsdp_trainer.h);
 * python/fsdpd says where it repeats one. */
#ifndef FSDP_PROTO_LIMITS_H
#define FSDP_PROTO_LIMITS_H

#include <stdbool.h>
#include <string.h>

/* The run directory (daemon.run_dir): the gRPC socket trainers and operators connect to,
 * the memory channel's socket (proto/fsdp/v1/channel.proto; AttachReply names its path),
 * and the lock file that says which daemon owns the directory. */
#define FSDP_SOCKET_NAME "fsdpd.sock"
#define FSDP_CHANNEL_SOCKET_NAME "fsdpd.mem.sock"
#define FSDP_LOCK_NAME "fsdpd.lock"
/* daemon.run_dir's default, and so where the tools look for the socket without being told. */
#define FSDP_DEFAULT_RUN_DIR "./run"
#define FSDP_DEFAULT_SOCKET FSDP_DEFAULT_RUN_DIR "/" FSDP_SOCKET_NAME

/* Trainer.Attach. */
#define FSDP_JOB_NAME_MAX 64      /* bytes of a job name, of [A-Za-z0-9._-] */
#define FSDP_LOCAL_WORLD_MAX 256  /* a job's local ranks on one host */
#define FSDP_JOB_TOKEN_MAX 256    /* bytes of a job token */

/* Whether job is a job name: 1 to FSDP_JOB_NAME_MAX of [A-Za-z0-9._-]. */
static inline bool fsdp_job_name_valid(const char *job) {
  size_t len = strlen(job);
  if (len == 0 || len > FSDP_JOB_NAME_MAX)
    return false;
  for (const char *c = job; *c; c++)
    if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
          *c == '.' || *c == '_' || *c == '-'))
      return false;
  return true;
}

/* Trainer.RegisterUnit. */
#define FSDP_UNIT_NAME_MAX 256           /* bytes in a unit or parameter name */
#define FSDP_UNIT_MAX_PARAMS 65536       /* parameters in one unit */
#define FSDP_UNIT_MAX_DIMS 64            /* dimensions of one parameter */
#define FSDP_UNIT_MAX_NUMEL (1ull << 40) /* elements in one unit */

/* Trainer.Unshard, ReduceScatter and AllReduce (and the fast path's): the most steps past
 * its job's last one an operation may name. Steps only go forward, so one far ahead would
 * hold the unit until the job's steps came to it: at 2^64 - 1, for the rest of the job. */
#define FSDP_STEP_AHEAD_MAX 64

/* The memory channel's welcome for a job on a GPU: the CUDA IPC events of a session
 * (ChannelWelcome.cuda_events), each a cudaIpcEventHandle_t. A trainer records them in
 * turn, so an event is recorded again only after as many operations more. As many as the
 * fast path's operations in flight (proto/fastpath.h): by its next record, the operation
 * that named it was answered, so the daemon waited on the record it meant (a later record
 * on the same stream would only order more; on another stream it would order the wrong
 * work). */
#define FSDP_SESSION_CUDA_EVENTS 32
#define FSDP_CUDA_IPC_EVENT_BYTES 64

#endif
