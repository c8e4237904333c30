/* What a peer's messages must hold before the peer table looks at them (see peer_check.h). */
#include "daemon/cluster/peer_check.h"

#include <stdio.h>
#include <string.h>

#include <fsdp/fsdp_version.h>

#include "proto/host/formats.h"
#include "proto/limits.h"

/* A host rank that is one of our peers; rank names the field for the message. */
static int check_rank(const fsdp_peer_rules_t *rules, unsigned rank, fsdp_status_t *st) {
  if (rules->n_hosts == 1)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "field 'host_rank' = %u: this fsdpd serves one host (cluster.hosts "
                           "is empty) and has no peers",
                           rank);
  if (rank >= rules->n_hosts || rank == rules->self)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'host_rank' = %u is not a peer: cluster.hosts has %u hosts "
                           "and %u is this daemon's own rank",
                           rank, rules->n_hosts, rules->self);
  return 0;
}

static int check_address(const ProtobufCBinaryData *addr, unsigned rank, fsdp_status_t *st) {
  if (addr->len == 0)
    return 0;
  char label[64];
  snprintf(label, sizeof label, "host %u", rank);
  fsdp_status_t why;
  if (fsdp_ucx_address_check(addr->data, addr->len, label, &why) < 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "field 'ucx_worker_address': %s",
                           why.message);
  return 0;
}

/* The first setting that does not agree, as a refusal; 0 when all agree. */
static int compare_settings(const fsdp_peer_rules_t *rules, const Fsdp__V1__JoinRequest *rq,
                            fsdp_status_t *st) {
  /* Each of ours once, nothing else: a longer list cannot agree. */
  if (rq->n_settings > rules->n_settings)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'settings' holds %zu entries; host %u expects %zu",
                           rq->n_settings, rules->self, rules->n_settings);
  for (size_t i = 0; i < rq->n_settings; i++) {
    const Fsdp__V1__Setting *theirs = rq->settings[i];
    size_t k = 0;
    while (k < rules->n_settings && strcmp(rules->settings[k].key, theirs->key) != 0)
      k++;
    if (k == rules->n_settings)
      return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                             "host %u sends setting '%s' = '%s', which host %u does not know "
                             "(another fsdpd release?)",
                             rq->host_rank, theirs->key, theirs->value, rules->self);
    if (strcmp(rules->settings[k].value, theirs->value) != 0)
      return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                             "setting '%s' differs: host %u has '%s', host %u has '%s'; every "
                             "host must use the same value",
                             theirs->key, rq->host_rank, theirs->value, rules->self,
                             rules->settings[k].value);
  }
  for (size_t k = 0; k < rules->n_settings; k++) {
    size_t i = 0;
    while (i < rq->n_settings && strcmp(rules->settings[k].key, rq->settings[i]->key) != 0)
      i++;
    if (i == rq->n_settings)
      return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                             "field 'settings' lacks '%s' (host %u has '%s'); every host must "
                             "send it",
                             rules->settings[k].key, rules->self, rules->settings[k].value);
  }
  return 0;
}

int fsdp_peer_check_join(const fsdp_peer_rules_t *rules, const Fsdp__V1__JoinRequest *rq,
                         fsdp_status_t *st) {
  int r;
  if (rq->protocol_version != FSDP_PROTOCOL_VERSION)
    return fsdp_status_set(st, FSDP_E_PROTOCOL_VERSION,
                           "protocol_version %u from the peer daemon, but this fsdpd %s speaks "
                           "protocol %u",
                           rq->protocol_version, FSDP_VERSION_STRING, FSDP_PROTOCOL_VERSION);
  if ((r = check_rank(rules, rq->host_rank, st)) < 0)
    return r;
  if (rq->incarnation == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'incarnation' = 0 from host %u; expected a random nonzero id",
                           rq->host_rank);
  if ((r = check_address(&rq->ucx_worker_address, rq->host_rank, st)) < 0)
    return r;
  return compare_settings(rules, rq, st);
}

int fsdp_peer_check_join_reply(const fsdp_peer_rules_t *rules, unsigned host_rank,
                               const char *address, const Fsdp__V1__JoinReply *reply,
                               fsdp_status_t *st) {
  (void)rules;
  if (reply->host_rank != host_rank || reply->incarnation == 0 ||
      reply->protocol_version != FSDP_PROTOCOL_VERSION)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "%s answered as host %u, protocol %u, incarnation %016llx; expected "
                           "host %u, protocol %u, an incarnation",
                           address, reply->host_rank, reply->protocol_version,
                           (unsigned long long)reply->incarnation, host_rank,
                           FSDP_PROTOCOL_VERSION);
  return check_address(&reply->ucx_worker_address, host_rank, st);
}

int fsdp_peer_check_heartbeat(const fsdp_peer_rules_t *rules,
                              const Fsdp__V1__HeartbeatRequest *rq, fsdp_status_t *st) {
  return check_rank(rules, rq->host_rank, st);
}

int fsdp_peer_check_heartbeat_reply(const fsdp_peer_rules_t *rules, unsigned host_rank,
                                    const Fsdp__V1__HeartbeatReply *reply, fsdp_status_t *st) {
  (void)rules;
  if (reply->incarnation == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'incarnation' = 0 in the Heartbeat reply of host %u; expected "
                           "a random nonzero id",
                           host_rank);
  return 0;
}

int fsdp_peer_check_leave(const fsdp_peer_rules_t *rules, const Fsdp__V1__LeaveRequest *rq,
                          fsdp_status_t *st) {
  int r = check_rank(rules, rq->host_rank, st);
  if (r < 0)
    return r;
  size_t len = strlen(rq->reason);
  if (len > FSDP_PEER_REASON_MAX)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'reason' holds %zu bytes from host %u, at most %d", len,
                           rq->host_rank, FSDP_PEER_REASON_MAX);
  return 0;
}

int fsdp_peer_check_recover(const fsdp_peer_rules_t *rules, const Fsdp__V1__RecoverRequest *rq,
                            fsdp_status_t *st) {
  int r = check_rank(rules, rq->host_rank, st);
  if (r < 0)
    return r;
  if (rq->incarnation == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'incarnation' = 0 in the Recover of host %u; expected its "
                           "daemon's random nonzero id",
                           rq->host_rank);
  if (!fsdp_job_name_valid(rq->job))
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "field 'job' = '%.80s' must be 1 to %d of [A-Za-z0-9._-]", rq->job,
                           FSDP_JOB_NAME_MAX);
  if (!rq->fetch)
    return 0;
  if (rq->bytes == 0 || rq->n_units == 0 || rq->step == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "a Recover that fetches names the step (%llu), the units (%zu) and "
                           "the bytes (%llu) it takes; none may be 0",
                           (unsigned long long)rq->step, rq->n_units,
                           (unsigned long long)rq->bytes);
  for (size_t i = 0; i < rq->n_units; i++)
    if (strlen(rq->units[i]->name) > FSDP_UNIT_NAME_MAX)
      return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                             "field 'units[%zu].name' holds %zu bytes, at most %d", i,
                             strlen(rq->units[i]->name), FSDP_UNIT_NAME_MAX);
  return 0;
}
