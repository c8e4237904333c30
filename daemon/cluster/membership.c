/* The membership state machine (see membership.h). */
#include "daemon/cluster/membership.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

struct fsdp_membership {
  unsigned n, self;
  fsdp_member_t *members; /* n of them; members[self] is this daemon */
  uint64_t incarnation;
  uint64_t heartbeat_ms, timeout_ms;
  fsdp_membership_listener_t listener;
  bool ready, leaving;
};

const char *fsdp_peer_state_name(fsdp_peer_state_t state) {
  switch (state) {
  case FSDP_PEER_SELF:
    return "SELF";
  case FSDP_PEER_JOINING:
    return "JOINING";
  case FSDP_PEER_JOINED:
    return "JOINED";
  case FSDP_PEER_LOST:
    return "LOST";
  case FSDP_PEER_LEFT:
    return "LEFT";
  case FSDP_PEER_REFUSED:
    return "REFUSED";
  }
  return "UNKNOWN";
}

bool fsdp_address_equal(const uint8_t *a, size_t a_len, const uint8_t *b, size_t b_len) {
  return a_len == b_len && (a_len == 0 || memcmp(a, b, a_len) == 0);
}

int fsdp_address_copy(uint8_t **dst, size_t *dst_len, const uint8_t *bytes, size_t len) {
  if (*dst && fsdp_address_equal(*dst, *dst_len, bytes, len))
    return 0;
  uint8_t *copy = malloc(len ? len : 1);
  if (!copy)
    return -ENOMEM;
  if (len)
    memcpy(copy, bytes, len);
  free(*dst);
  *dst = copy;
  *dst_len = len;
  return 1;
}

static void set_error(fsdp_member_t *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_error(fsdp_member_t *p, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->last_error, sizeof p->last_error, fmt, ap);
  va_end(ap);
}

static bool all_joined(const fsdp_membership_t *m) {
  for (unsigned i = 0; i < m->n; i++)
    if (i != m->self && m->members[i].state != FSDP_PEER_JOINED)
      return false;
  return true;
}

static void check_ready(fsdp_membership_t *m) {
  bool ready = all_joined(m);
  if (ready && !m->ready) {
    log_info("peers: all %u hosts joined; the cluster is ready", m->n);
    m->ready = true;
    if (m->listener.ready)
      m->listener.ready(m->listener.data);
  } else if (!ready) {
    m->ready = false;
  }
}

static void announce_joined(fsdp_membership_t *m, const fsdp_member_t *p) {
  if (m->listener.joined)
    m->listener.joined(m->listener.data, p->rank, p->incarnation, p->ucx, p->ucx_len);
}

/* Both halves are gone; tells the listener if the peer was JOINED. */
static void drop(fsdp_membership_t *m, fsdp_member_t *p, uint64_t now, fsdp_peer_state_t state,
                 const char *why) {
  bool was_joined = p->state == FSDP_PEER_JOINED;
  p->in = p->out = false;
  p->rejoin = false;
  p->state = state;
  snprintf(p->last_error, sizeof p->last_error, "%s", why);
  p->next_join_ms = now;
  p->backoff_ms = FSDP_MEMBERSHIP_BACKOFF_MIN_MS;
  if (was_joined) {
    char host[16];
    snprintf(host, sizeof host, "%u", p->rank);
    const fsdp_log_field_t fields[] = {{"HOST", host}};
    fsdp_log_fields(FSDP_LOG_WARNING, fields, 1, "peers: host %u (%s) is %s: %s", p->rank,
                    p->address, fsdp_peer_state_name(state), why);
  }
  if (p->announced) {
    p->announced = false;
    char msg[700];
    snprintf(msg, sizeof msg, "host %u (%s) %s: %s", p->rank, p->address,
             state == FSDP_PEER_LEFT ? "left" : "lost", why);
    if (m->listener.lost)
      m->listener.lost(m->listener.data, p->rank, msg);
  }
  check_ready(m);
}

static void maybe_joined(fsdp_membership_t *m, fsdp_member_t *p, uint64_t now) {
  if (!p->in || !p->out || p->state == FSDP_PEER_JOINED)
    return;
  p->state = FSDP_PEER_JOINED;
  p->last_error[0] = p->logged_in_refusal[0] = p->logged_out_refusal[0] = '\0';
  p->next_heartbeat_ms = now;
  log_info("peers: host %u (%s) joined, incarnation %016llx, data-plane address of %zu bytes",
           p->rank, p->address, (unsigned long long)p->incarnation, p->ucx_len);
  p->announced = true;
  announce_joined(m, p);
  check_ready(m);
}

/* A peer answered with, or joined as, another incarnation than the one we knew. */
static void check_incarnation(fsdp_membership_t *m, fsdp_member_t *p, uint64_t now,
                              uint64_t incarnation) {
  if (p->incarnation == incarnation)
    return;
  if (p->incarnation && (p->in || p->out)) {
    char why[128];
    snprintf(why, sizeof why, "restarted (incarnation %016llx, before %016llx)",
             (unsigned long long)incarnation, (unsigned long long)p->incarnation);
    drop(m, p, now, FSDP_PEER_JOINING, why);
  }
  p->incarnation = incarnation;
}

int fsdp_membership_new(const fsdp_membership_options_t *o, fsdp_membership_t **ret) {
  fsdp_membership_t *m = calloc(1, sizeof *m);
  if (!m || !(m->members = calloc(o->n_hosts, sizeof *m->members))) {
    free(m);
    return -ENOMEM;
  }
  m->n = o->n_hosts;
  m->self = o->self;
  m->incarnation = o->incarnation;
  m->listener = o->listener;
  fsdp_membership_set_timing(m, o->heartbeat_interval_ms, o->timeout_ms);
  for (unsigned i = 0; i < m->n; i++) {
    fsdp_member_t *p = &m->members[i];
    p->rank = i;
    if (o->addresses)
      snprintf(p->address, sizeof p->address, "%s", o->addresses[i]);
    p->state = i == m->self ? FSDP_PEER_SELF : FSDP_PEER_JOINING;
    p->backoff_ms = FSDP_MEMBERSHIP_BACKOFF_MIN_MS;
  }
  m->members[m->self].incarnation = m->incarnation;
  m->ready = m->n == 1;
  *ret = m;
  return 0;
}

void fsdp_membership_free(fsdp_membership_t *m) {
  if (!m)
    return;
  for (unsigned i = 0; i < m->n; i++)
    free(m->members[i].ucx);
  free(m->members);
  free(m);
}

void fsdp_membership_set_timing(fsdp_membership_t *m, uint64_t heartbeat_interval_ms,
                                uint64_t timeout_ms) {
  m->heartbeat_ms = heartbeat_interval_ms;
  m->timeout_ms = timeout_ms;
}

unsigned fsdp_membership_host_count(const fsdp_membership_t *m) {
  return m->n;
}

const fsdp_member_t *fsdp_membership_member(const fsdp_membership_t *m, unsigned host_rank) {
  return &m->members[host_rank];
}

bool fsdp_membership_ready(const fsdp_membership_t *m) {
  return m->ready;
}

bool fsdp_membership_leaving(const fsdp_membership_t *m) {
  return m->leaving;
}

static void send_heartbeat(fsdp_membership_t *m, fsdp_member_t *p, uint64_t now) {
  p->next_heartbeat_ms = now + m->heartbeat_ms;
  p->heartbeat_in_flight =
      m->listener.send_heartbeat && m->listener.send_heartbeat(m->listener.data, p->rank);
}

void fsdp_membership_tick(fsdp_membership_t *m, uint64_t now) {
  if (m->leaving)
    return;
  for (unsigned i = 0; i < m->n; i++) {
    fsdp_member_t *p = &m->members[i];
    if (i == m->self)
      continue;
    if ((p->in || p->out) && p->last_heard_ms && now - p->last_heard_ms >= m->timeout_ms) {
      char why[160];
      snprintf(why, sizeof why, "no answer for %llu ms (peer.timeout %llu ms)",
               (unsigned long long)(now - p->last_heard_ms), (unsigned long long)m->timeout_ms);
      drop(m, p, now, FSDP_PEER_LOST, why);
    }
    if ((!p->out || p->rejoin) && !p->join_in_flight && !p->join_checking &&
        now >= p->next_join_ms)
      fsdp_membership_send_join(m, i, now);
    if (p->out && !p->heartbeat_in_flight && now >= p->next_heartbeat_ms)
      send_heartbeat(m, p, now);
  }
}

bool fsdp_membership_send_join(fsdp_membership_t *m, unsigned host_rank, uint64_t now) {
  fsdp_member_t *p = &m->members[host_rank];
  if (p->join_in_flight)
    return true;
  p->rejoin = false;
  p->join_in_flight = m->listener.send_join && m->listener.send_join(m->listener.data, p->rank);
  if (!p->join_in_flight)
    p->next_join_ms = now + p->backoff_ms;
  return p->join_in_flight;
}

static void join_failed(fsdp_membership_t *m, fsdp_member_t *p, uint64_t now, bool refused) {
  p->join_in_flight = p->join_checking = false;
  p->next_join_ms = now + p->backoff_ms;
  p->backoff_ms = p->backoff_ms * 2 > FSDP_MEMBERSHIP_BACKOFF_MAX_MS
                      ? FSDP_MEMBERSHIP_BACKOFF_MAX_MS
                      : p->backoff_ms * 2;
  if (refused) {
    if (strcmp(p->logged_out_refusal, p->last_error) != 0) {
      log_error("peers: host %u (%s) refused: %s", p->rank, p->address, p->last_error);
      snprintf(p->logged_out_refusal, sizeof p->logged_out_refusal, "%s", p->last_error);
    }
    if (p->state == FSDP_PEER_JOINED) {
      /* drop() writes last_error: it must not read from it at the same time. */
      char why[sizeof p->last_error];
      snprintf(why, sizeof why, "%s", p->last_error);
      drop(m, p, now, FSDP_PEER_REFUSED, why);
    }
    p->state = FSDP_PEER_REFUSED;
  }
}

void fsdp_membership_join_failed(fsdp_membership_t *m, unsigned host_rank, uint64_t now,
                                 bool refused, const char *why) {
  fsdp_member_t *p = &m->members[host_rank];
  set_error(p, "%s", why);
  join_failed(m, p, now, refused);
}

void fsdp_membership_join_unreachable(fsdp_membership_t *m, unsigned host_rank, uint64_t now,
                                      const char *why) {
  fsdp_member_t *p = &m->members[host_rank];
  /* Why a peer was lost, left or refused says more than that it is still unreachable. */
  if (p->state != FSDP_PEER_LOST && p->state != FSDP_PEER_LEFT && p->state != FSDP_PEER_REFUSED)
    set_error(p, "%s", why);
  join_failed(m, p, now, false);
}

void fsdp_membership_join_replied(fsdp_membership_t *m, unsigned host_rank, uint64_t now,
                                  uint64_t incarnation) {
  fsdp_member_t *p = &m->members[host_rank];
  p->join_in_flight = false;
  p->join_checking = true;
  check_incarnation(m, p, now, incarnation);
}

void fsdp_membership_join_accepted(fsdp_membership_t *m, unsigned host_rank, uint64_t now,
                                   const uint8_t *ucx_address, size_t ucx_address_len) {
  fsdp_member_t *p = &m->members[host_rank];
  int changed = fsdp_address_copy(&p->ucx, &p->ucx_len, ucx_address, ucx_address_len);
  if (changed < 0) {
    set_error(p, "Join: out of memory for its data-plane address");
    join_failed(m, p, now, false);
    return;
  }
  p->join_in_flight = p->join_checking = false;
  p->out = true;
  p->last_heard_ms = now;
  p->backoff_ms = FSDP_MEMBERSHIP_BACKOFF_MIN_MS;
  if (p->state == FSDP_PEER_REFUSED)
    p->state = FSDP_PEER_JOINING;
  if (p->state == FSDP_PEER_JOINED && changed > 0)
    announce_joined(m, p);
  maybe_joined(m, p, now);
}

int fsdp_membership_join_received(fsdp_membership_t *m, unsigned host_rank, uint64_t now,
                                  uint64_t incarnation, const uint8_t *ucx_address,
                                  size_t ucx_address_len) {
  fsdp_member_t *p = &m->members[host_rank];
  check_incarnation(m, p, now, incarnation);
  int changed = fsdp_address_copy(&p->ucx, &p->ucx_len, ucx_address, ucx_address_len);
  if (changed < 0)
    return -ENOMEM;
  p->in = true;
  p->last_heard_ms = now;
  if (p->state == FSDP_PEER_REFUSED)
    p->state = FSDP_PEER_JOINING;
  if (!p->out && !p->join_in_flight && !p->join_checking) {
    /* It is up: join it now rather than at the end of a backoff. */
    p->next_join_ms = now;
    p->backoff_ms = FSDP_MEMBERSHIP_BACKOFF_MIN_MS;
  }
  if (p->state == FSDP_PEER_JOINED && changed > 0)
    announce_joined(m, p);
  maybe_joined(m, p, now);
  return 0;
}

void fsdp_membership_join_refused(fsdp_membership_t *m, unsigned host_rank, const char *from,
                                  const char *msg) {
  fsdp_member_t *p = &m->members[host_rank];
  if (fsdp_membership_first_refusal(m, host_rank, msg))
    log_error("peers: refused the Join of host %u (%s) from %s: %s", p->rank, p->address, from,
              msg);
  if (p->in || p->out) {
    set_error(p, "refused a Join as this host from %s: %s", from, msg);
    return;
  }
  p->state = FSDP_PEER_REFUSED;
  set_error(p, "refused its Join: %s", msg);
}

int fsdp_membership_heartbeat_received(fsdp_membership_t *m, unsigned host_rank, uint64_t now,
                                       uint64_t incarnation, fsdp_status_t *st) {
  fsdp_member_t *p = &m->members[host_rank];
  if (!p->in || incarnation != p->incarnation)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "host %u (incarnation %016llx) has not joined host %u; Join first",
                           host_rank, (unsigned long long)incarnation, m->self);
  p->last_heard_ms = now;
  return 0;
}

void fsdp_membership_heartbeat_answered(fsdp_membership_t *m, unsigned host_rank, uint64_t now,
                                        uint64_t incarnation, uint64_t rtt_us) {
  fsdp_member_t *p = &m->members[host_rank];
  p->heartbeat_in_flight = false;
  if (m->leaving || !p->out)
    return;
  check_incarnation(m, p, now, incarnation);
  if (!p->out)
    return;
  p->last_heard_ms = now;
  p->rtt_us = rtt_us;
}

void fsdp_membership_heartbeat_refused(fsdp_membership_t *m, unsigned host_rank, uint64_t now,
                                       const char *why) {
  fsdp_member_t *p = &m->members[host_rank];
  p->heartbeat_in_flight = false;
  if (m->leaving || !p->out)
    return;
  drop(m, p, now, FSDP_PEER_JOINING, why);
}

void fsdp_membership_heartbeat_failed(fsdp_membership_t *m, unsigned host_rank,
                                      const char *why) {
  fsdp_member_t *p = &m->members[host_rank];
  p->heartbeat_in_flight = false;
  if (m->leaving || !p->out)
    return;
  set_error(p, "%s", why);
}

void fsdp_membership_leave_received(fsdp_membership_t *m, unsigned host_rank, uint64_t now,
                                    uint64_t incarnation, const char *reason) {
  fsdp_member_t *p = &m->members[host_rank];
  /* A Leave from an incarnation we no longer know is old news. */
  if (incarnation != p->incarnation)
    return;
  char why[300];
  snprintf(why, sizeof why, "left: %s", reason[0] ? reason : "no reason given");
  drop(m, p, now, FSDP_PEER_LEFT, why);
}

void fsdp_membership_leave(fsdp_membership_t *m) {
  m->leaving = true;
  /* A reply's address still being checked no longer matters. */
  for (unsigned i = 0; i < m->n; i++)
    m->members[i].join_checking = false;
}

void fsdp_membership_rejoin_all(fsdp_membership_t *m) {
  for (unsigned i = 0; i < m->n; i++)
    if (m->members[i].out)
      m->members[i].rejoin = true;
}

void fsdp_membership_set_error(fsdp_membership_t *m, unsigned host_rank, const char *why) {
  set_error(&m->members[host_rank], "%s", why);
}

bool fsdp_membership_first_refusal(fsdp_membership_t *m, unsigned host_rank, const char *why) {
  fsdp_member_t *p = &m->members[host_rank];
  if (strcmp(p->logged_in_refusal, why) == 0)
    return false;
  snprintf(p->logged_in_refusal, sizeof p->logged_in_refusal, "%s", why);
  return true;
}

void fsdp_membership_describe_missing(const fsdp_membership_t *m, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (unsigned i = 0; i < m->n && used < size; i++) {
    const fsdp_member_t *p = &m->members[i];
    if (i == m->self || p->state == FSDP_PEER_JOINED)
      continue;
    used += (size_t)snprintf(buf + used, size - used, "%shost %u (%s) %s%s%s", used ? "; " : "",
                             p->rank, p->address, fsdp_peer_state_name(p->state),
                             p->last_error[0] ? ": " : "", p->last_error);
  }
}
