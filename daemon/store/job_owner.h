/* Whom a job belongs to, apart from the store so that the sessions, which check it at every
 * Attach, need not know jobs. */
#ifndef FSDP_JOB_OWNER_H
#define FSDP_JOB_OWNER_H

#include <stddef.h>
#include <sys/types.h>

#include "proto/limits.h" /* FSDP_JOB_TOKEN_MAX */

/* Whom a job belongs to: the uid of the trainer that attached it first, and the job token
 * that trainer gave (AttachRequest.job_token; none: empty). Only that uid, with that token,
 * attaches to the job. */
typedef struct fsdp_job_owner {
  uid_t uid;
  size_t token_len;
  char token[FSDP_JOB_TOKEN_MAX]; /* zeros after token_len */
} fsdp_job_owner_t;

#endif
