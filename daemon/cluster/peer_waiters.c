/* Waiting for the cluster (fsdp_peers_when_ready): the waiters, the deadline each waits by
 * (the join deadline while the cluster forms, peer.timeout once it had been ready) and the
 * word that ends the wait. Apart from the table because it is the one thing the rest of the
 * daemon waits on, with its own rules of time, and touches no call and no Join. */
#include "daemon/cluster/peers_internal.h"

#include <stdio.h>

#include "common/log.h"

void fsdp_peers_run_waiters(fsdp_peers_t *peers, int status, const char *why) {
  while (peers->waiters) {
    fsdp_peers_waiter_t *w = peers->waiters;
    peers->waiters = w->next;
    w->next = NULL;
    w->cb(w->data, status, why);
  }
}

void fsdp_peers_on_ready(void *data) {
  fsdp_peers_t *peers = data;
  peers->formed = true;
  fsdp_peers_run_waiters(peers, 0, "");
}

/* Fails the waiters whose time is up: those waiting for the cluster to form once
 * peer.join_timeout has passed (formation), those with a deadline of their own once it has
 * passed (now). */
static void fail_waiters(fsdp_peers_t *peers, bool formation, uint64_t now, const char *why) {
  for (fsdp_peers_waiter_t **w = &peers->waiters; *w;) {
    fsdp_peers_waiter_t *waiter = *w;
    if (waiter->deadline_ms ? waiter->deadline_ms > now : !formation) {
      w = &waiter->next;
      continue;
    }
    *w = waiter->next;
    waiter->next = NULL;
    waiter->cb(waiter->data, FSDP_E_UNAVAILABLE, why);
    w = &peers->waiters; /* the callback may have added or cancelled waiters */
  }
}

void fsdp_peers_expire_waiters(fsdp_peers_t *peers, uint64_t now) {
  bool due = false;
  for (const fsdp_peers_waiter_t *w = peers->waiters; w; w = w->next)
    due |= w->deadline_ms && w->deadline_ms <= now;
  if (!due)
    return;
  char missing[2048], why[2300];
  fsdp_membership_describe_missing(peers->m, missing, sizeof missing);
  snprintf(why, sizeof why, "%s; not back within peer.timeout (%llu ms)", missing,
           (unsigned long long)peers->timeout_ms);
  fail_waiters(peers, false, now, why);
}

void fsdp_peers_on_join_deadline(uv_timer_t *timer) {
  fsdp_peers_t *peers = timer->data;
  peers->deadline_passed = true;
  if (fsdp_membership_ready(peers->m) || peers->formed)
    return;
  char missing[2048], why[2300];
  fsdp_membership_describe_missing(peers->m, missing, sizeof missing);
  snprintf(why, sizeof why, "the cluster is not ready %llu ms after start (peer.join_timeout): %s",
           (unsigned long long)peers->join_deadline_ms, missing);
  log_error("peers: %s", why);
  fail_waiters(peers, true, 0, why);
}

void fsdp_peers_when_ready(fsdp_peers_t *peers, fsdp_peers_waiter_t *waiter,
                           fsdp_peers_ready_fn cb, void *data) {
  waiter->cb = cb;
  waiter->data = data;
  waiter->next = NULL;
  /* Once the cluster had been ready, a host missing was lost or left: whoever needs it
   * waits peer.timeout for it to be back, not what is left of the join deadline. */
  waiter->deadline_ms = peers->formed ? now_ms(peers) + peers->timeout_ms : 0;
  if (fsdp_membership_ready(peers->m)) {
    cb(data, 0, "");
    return;
  }
  if (peers->closing || leaving(peers)) {
    cb(data, FSDP_E_CANCELLED, "fsdpd is stopping");
    return;
  }
  if (peers->deadline_passed && !peers->formed) {
    char missing[2048], why[2300];
    fsdp_membership_describe_missing(peers->m, missing, sizeof missing);
    snprintf(why, sizeof why, "the cluster is not ready (peer.join_timeout %llu ms passed): %s",
             (unsigned long long)peers->join_deadline_ms, missing);
    cb(data, FSDP_E_UNAVAILABLE, why);
    return;
  }
  waiter->next = peers->waiters;
  peers->waiters = waiter;
}

void fsdp_peers_wait_cancel(fsdp_peers_t *peers, fsdp_peers_waiter_t *waiter) {
  for (fsdp_peers_waiter_t **w = &peers->waiters; *w; w = &(*w)->next)
    if (*w == waiter) {
      *w = waiter->next;
      waiter->next = NULL;
      return;
    }
}
