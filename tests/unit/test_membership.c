/* The membership state machine (daemon/cluster/membership.h) driven by a fake clock: joins
 * both ways, heartbeats keeping a peer joined, loss after the timeout, rejoin with backoff, a
 * Join refused for a setting that differs, and restarts (a new incarnation replaces the old
 * one; the old one's Heartbeats and Leave count no more). Every test checks the states and
 * the exact actions the machine emitted. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include <fsdp/fsdp_version.h>

#include "daemon/cluster/membership.h"
#include "daemon/cluster/peer_check.h"

#define HEARTBEAT_MS 100
#define TIMEOUT_MS 1000
#define INC_SELF 0xa0
#define INC_PEER 0xb1
#define INC_RESTARTED 0xb2
/* When the loss tests join: a peer last heard at 0 would count as never heard. */
#define T0 1000

static const uint8_t ADDR[] = {1, 2, 3};

/* The actions, in order, as one string; send_join and send_heartbeat answer `starts`. */
typedef struct recorder {
  char log[4096];
  bool starts;
} recorder_t;

static void record(recorder_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void record(recorder_t *r, const char *fmt, ...) {
  size_t used = strlen(r->log);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->log + used, sizeof r->log - used, fmt, ap);
  va_end(ap);
}

static bool on_send_join(void *data, unsigned host) {
  record(data, "join %u; ", host);
  return ((recorder_t *)data)->starts;
}

static bool on_send_heartbeat(void *data, unsigned host) {
  record(data, "heartbeat %u; ", host);
  return ((recorder_t *)data)->starts;
}

static void on_joined(void *data, unsigned host, uint64_t incarnation, const uint8_t *ucx,
                      size_t len) {
  record(data, "joined %u inc %llx addr %zu:%u; ", host, (unsigned long long)incarnation, len,
         len ? ucx[0] : 0);
}

static void on_lost(void *data, unsigned host, const char *why) {
  record(data, "lost %u: %s; ", host, why);
}

static void on_ready(void *data) {
  record(data, "ready; ");
}

/* The actions so far, which are then forgotten. */
static void expect(recorder_t *r, const char *actions) {
  assert_string_equal(r->log, actions);
  r->log[0] = '\0';
}

typedef struct fixture {
  recorder_t rec;
  fsdp_membership_t *m;
} fixture_t;

static const char *const HOSTS[] = {"h0:7000", "h1:7000", "h2:7000"};

static fsdp_membership_t *make(fixture_t *f, unsigned n_hosts) {
  memset(f, 0, sizeof *f);
  f->rec.starts = true;
  fsdp_membership_options_t o = {
      .n_hosts = n_hosts, .self = 0, .incarnation = INC_SELF, .addresses = HOSTS,
      .heartbeat_interval_ms = HEARTBEAT_MS, .timeout_ms = TIMEOUT_MS,
      .listener = {.send_join = on_send_join, .send_heartbeat = on_send_heartbeat,
                   .joined = on_joined, .lost = on_lost, .ready = on_ready, .data = &f->rec}};
  assert_int_equal(fsdp_membership_new(&o, &f->m), 0);
  return f->m;
}

static const fsdp_member_t *row(const fixture_t *f, unsigned host) {
  return fsdp_membership_member(f->m, host);
}

/* Host 1 joined both ways at `now`, at incarnation inc: Join out, reply, address, Join in. */
static void join_both(fixture_t *f, uint64_t now, uint64_t inc) {
  fsdp_membership_tick(f->m, now);
  expect(&f->rec, "join 1; ");
  fsdp_membership_join_replied(f->m, 1, now, inc);
  fsdp_membership_join_accepted(f->m, 1, now, ADDR, sizeof ADDR);
  assert_int_equal(fsdp_membership_join_received(f->m, 1, now, inc, ADDR, sizeof ADDR), 0);
}

static void test_one_host_is_ready_alone(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 1);
  assert_true(fsdp_membership_ready(f.m));
  assert_int_equal(row(&f, 0)->state, FSDP_PEER_SELF);
  assert_int_equal(row(&f, 0)->incarnation, INC_SELF);
  fsdp_membership_tick(f.m, 0);
  expect(&f.rec, "");
  fsdp_membership_free(f.m);
}

static void test_join_ours_first_then_theirs(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 2);
  assert_false(fsdp_membership_ready(f.m));
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINING);
  fsdp_membership_tick(f.m, 0);
  expect(&f.rec, "join 1; ");
  /* A Join out: no second one while it is. */
  fsdp_membership_tick(f.m, 60);
  expect(&f.rec, "");
  assert_true(row(&f, 1)->join_in_flight);

  fsdp_membership_join_replied(f.m, 1, 70, INC_PEER);
  assert_true(row(&f, 1)->join_checking);
  fsdp_membership_tick(f.m, 80); /* its address is being checked: still no other Join */
  expect(&f.rec, "");
  fsdp_membership_join_accepted(f.m, 1, 90, ADDR, sizeof ADDR);
  assert_true(row(&f, 1)->out);
  assert_false(row(&f, 1)->in);
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINING);
  assert_int_equal(row(&f, 1)->incarnation, INC_PEER);
  /* Out only: heartbeats already go. */
  fsdp_membership_tick(f.m, 100);
  expect(&f.rec, "heartbeat 1; ");

  assert_int_equal(fsdp_membership_join_received(f.m, 1, 110, INC_PEER, ADDR, sizeof ADDR), 0);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; ");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINED);
  assert_true(fsdp_membership_ready(f.m));
  assert_string_equal(row(&f, 1)->last_error, "");
  fsdp_membership_free(f.m);
}

static void test_join_theirs_first_then_ours(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 2);
  f.rec.starts = false; /* our first Join cannot start: retried after the backoff */
  fsdp_membership_tick(f.m, 0);
  expect(&f.rec, "join 1; ");
  assert_int_equal(row(&f, 1)->next_join_ms, FSDP_MEMBERSHIP_BACKOFF_MIN_MS);
  f.rec.starts = true;

  /* Its Join: it is up, so ours goes at once rather than after the backoff. */
  assert_int_equal(fsdp_membership_join_received(f.m, 1, 10, INC_PEER, ADDR, sizeof ADDR), 0);
  expect(&f.rec, "");
  assert_true(row(&f, 1)->in);
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINING);
  fsdp_membership_tick(f.m, 10);
  expect(&f.rec, "join 1; ");
  fsdp_membership_join_replied(f.m, 1, 20, INC_PEER);
  fsdp_membership_join_accepted(f.m, 1, 20, ADDR, sizeof ADDR);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; ");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINED);
  fsdp_membership_free(f.m);
}

static void test_ready_needs_every_peer(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 3);
  fsdp_membership_tick(f.m, 0);
  expect(&f.rec, "join 1; join 2; ");
  fsdp_membership_join_replied(f.m, 1, 1, INC_PEER);
  fsdp_membership_join_accepted(f.m, 1, 1, ADDR, sizeof ADDR);
  assert_int_equal(fsdp_membership_join_received(f.m, 1, 1, INC_PEER, ADDR, sizeof ADDR), 0);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ");
  assert_false(fsdp_membership_ready(f.m));
  char missing[512];
  fsdp_membership_describe_missing(f.m, missing, sizeof missing);
  assert_string_equal(missing, "host 2 (h2:7000) JOINING");
  fsdp_membership_join_replied(f.m, 2, 2, 0xc1);
  fsdp_membership_join_accepted(f.m, 2, 2, NULL, 0);
  assert_int_equal(fsdp_membership_join_received(f.m, 2, 2, 0xc1, NULL, 0), 0);
  expect(&f.rec, "joined 2 inc c1 addr 0:0; ready; ");
  assert_true(fsdp_membership_ready(f.m));
  fsdp_membership_free(f.m);
}

static void test_heartbeats_keep_a_peer_joined(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 2);
  join_both(&f, 0, INC_PEER);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; ");
  /* Ten timeouts long, both ways: ours answered 5 ms later, theirs every interval. */
  char want[4096] = "";
  for (uint64_t now = 0; now <= 10 * TIMEOUT_MS; now += 50) {
    fsdp_membership_tick(f.m, now);
    if (now % HEARTBEAT_MS == 0) {
      strcat(want, "heartbeat 1; ");
      fsdp_membership_heartbeat_answered(f.m, 1, now + 5, INC_PEER, 5000);
      fsdp_status_t st;
      assert_int_equal(fsdp_membership_heartbeat_received(f.m, 1, now + 7, INC_PEER, &st), 0);
    }
  }
  expect(&f.rec, want);
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINED);
  assert_int_equal(row(&f, 1)->rtt_us, 5000);
  assert_int_equal(row(&f, 1)->last_heard_ms, 10 * TIMEOUT_MS + 7);
  assert_true(fsdp_membership_ready(f.m));
  fsdp_membership_free(f.m);
}

static void test_silence_for_the_timeout_loses_a_peer(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 2);
  join_both(&f, T0, INC_PEER);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; ");
  fsdp_membership_tick(f.m, T0);
  expect(&f.rec, "heartbeat 1; ");
  /* Heartbeats that fail keep nothing alive. */
  fsdp_membership_heartbeat_failed(f.m, 1, "Heartbeat: UNAVAILABLE: connection refused");
  fsdp_membership_tick(f.m, T0 + TIMEOUT_MS - 1);
  expect(&f.rec, "heartbeat 1; ");
  fsdp_membership_heartbeat_failed(f.m, 1, "Heartbeat: DEADLINE_EXCEEDED: ");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINED);
  assert_string_equal(row(&f, 1)->last_error, "Heartbeat: DEADLINE_EXCEEDED: ");

  /* One timeout after it was last heard: lost, told once, and joined again at once. */
  fsdp_membership_tick(f.m, T0 + TIMEOUT_MS);
  expect(&f.rec, "lost 1: host 1 (h1:7000) lost: no answer for 1000 ms (peer.timeout 1000 "
                 "ms); join 1; ");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_LOST);
  assert_false(row(&f, 1)->in);
  assert_false(row(&f, 1)->out);
  assert_false(fsdp_membership_ready(f.m));
  assert_string_equal(row(&f, 1)->last_error, "no answer for 1000 ms (peer.timeout 1000 ms)");
  fsdp_membership_tick(f.m, T0 + 3 * TIMEOUT_MS);
  expect(&f.rec, "");
  fsdp_membership_free(f.m);
}

static void test_a_lost_peer_rejoins_with_backoff(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 2);
  join_both(&f, T0, INC_PEER);
  fsdp_membership_tick(f.m, T0 + TIMEOUT_MS);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; lost 1: host 1 (h1:7000) lost: no answer "
                 "for 1000 ms (peer.timeout 1000 ms); join 1; ");

  /* Unreachable: retried after 50, 100, 200, ... ms, up to 1 s; a lost peer keeps saying
   * why it was lost. */
  uint64_t now = T0 + TIMEOUT_MS;
  unsigned backoff = FSDP_MEMBERSHIP_BACKOFF_MIN_MS;
  for (int i = 0; i < 7; i++) {
    fsdp_membership_join_unreachable(f.m, 1, now, "Join: UNAVAILABLE: connection refused");
    fsdp_membership_tick(f.m, now + backoff - 1);
    expect(&f.rec, "");
    now += backoff;
    fsdp_membership_tick(f.m, now);
    expect(&f.rec, "join 1; ");
    backoff = backoff * 2 > FSDP_MEMBERSHIP_BACKOFF_MAX_MS ? FSDP_MEMBERSHIP_BACKOFF_MAX_MS
                                                           : backoff * 2;
  }
  assert_int_equal(backoff, FSDP_MEMBERSHIP_BACKOFF_MAX_MS);
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_LOST);
  assert_string_equal(row(&f, 1)->last_error, "no answer for 1000 ms (peer.timeout 1000 ms)");

  /* It answers again: joined as before, the backoff back to its start. */
  fsdp_membership_join_replied(f.m, 1, now, INC_PEER);
  fsdp_membership_join_accepted(f.m, 1, now, ADDR, sizeof ADDR);
  assert_int_equal(fsdp_membership_join_received(f.m, 1, now, INC_PEER, ADDR, sizeof ADDR), 0);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; ");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINED);
  assert_int_equal(row(&f, 1)->backoff_ms, FSDP_MEMBERSHIP_BACKOFF_MIN_MS);
  fsdp_membership_free(f.m);
}

/* The settings every host must share, as peer_check.h compares them. */
static Fsdp__V1__Setting setting(const char *key, const char *value) {
  Fsdp__V1__Setting s = FSDP__V1__SETTING__INIT;
  s.key = (char *)key;
  s.value = (char *)value;
  return s;
}

static void test_a_join_with_another_setting_is_refused(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 2);
  Fsdp__V1__Setting ours[] = {setting("cluster.hosts", "h0:7000,h1:7000"),
                              setting("backend", "ucx")};
  fsdp_peer_rules_t rules = {.n_hosts = 2, .self = 0, .settings = ours, .n_settings = 2};
  Fsdp__V1__Setting theirs[] = {setting("cluster.hosts", "h0:7000,h1:7000"),
                                setting("backend", "nccl")};
  Fsdp__V1__Setting *list[] = {&theirs[0], &theirs[1]};
  Fsdp__V1__JoinRequest rq = FSDP__V1__JOIN_REQUEST__INIT;
  rq.protocol_version = FSDP_PROTOCOL_VERSION;
  rq.host_rank = 1;
  rq.incarnation = INC_PEER;
  rq.settings = list;
  rq.n_settings = 2;
  fsdp_status_t st;
  assert_int_equal(fsdp_peer_check_join(&rules, &rq, &st), FSDP_E_FAILED_PRECONDITION);
  assert_string_equal(st.message, "setting 'backend' differs: host 1 has 'nccl', host 0 has "
                                  "'ucx'; every host must use the same value");

  /* The driver hands the refusal to the membership: the row says why, nothing joins. */
  fsdp_membership_join_refused(f.m, 1, "ipv4:10.0.0.2:41234", st.message);
  expect(&f.rec, "");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_REFUSED);
  assert_false(row(&f, 1)->in);
  assert_string_equal(row(&f, 1)->last_error,
                      "refused its Join: setting 'backend' differs: host 1 has 'nccl', host 0 "
                      "has 'ucx'; every host must use the same value");
  /* The same refusal again is not logged again. */
  assert_false(fsdp_membership_first_refusal(f.m, 1, st.message));

  /* Its settings agree again (fixed and restarted): it joins. */
  theirs[1] = setting("backend", "ucx");
  assert_int_equal(fsdp_peer_check_join(&rules, &rq, &st), 0);
  join_both(&f, 0, INC_PEER);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; ");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINED);
  fsdp_membership_free(f.m);
}

static void test_our_join_refused_ends_a_joined_peer(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 2);
  join_both(&f, 0, INC_PEER);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; ");
  /* The local address changed: Join again, and this time it is refused. */
  fsdp_membership_rejoin_all(f.m);
  fsdp_membership_tick(f.m, 10);
  expect(&f.rec, "join 1; heartbeat 1; ");
  fsdp_membership_join_failed(f.m, 1, 20, true,
                              "Join: FAILED_PRECONDITION: setting 'backend' differs");
  expect(&f.rec, "lost 1: host 1 (h1:7000) lost: Join: FAILED_PRECONDITION: setting 'backend' "
                 "differs; ");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_REFUSED);
  assert_false(fsdp_membership_ready(f.m));
  fsdp_membership_free(f.m);
}

static void test_a_new_incarnation_replaces_the_old(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 2);
  join_both(&f, 0, INC_PEER);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; ");

  /* It restarted: its new Join ends the old relationship and starts the new one. */
  const uint8_t new_addr[] = {9, 9};
  assert_int_equal(
      fsdp_membership_join_received(f.m, 1, 50, INC_RESTARTED, new_addr, sizeof new_addr), 0);
  expect(&f.rec, "lost 1: host 1 (h1:7000) lost: restarted (incarnation 00000000000000b2, "
                 "before 00000000000000b1); ");
  assert_int_equal(row(&f, 1)->incarnation, INC_RESTARTED);
  assert_true(row(&f, 1)->in);
  assert_false(row(&f, 1)->out);
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINING);

  /* The old incarnation counts no more: its Heartbeat is refused, its Leave ignored. */
  fsdp_status_t st;
  assert_int_equal(fsdp_membership_heartbeat_received(f.m, 1, 60, INC_PEER, &st),
                   FSDP_E_FAILED_PRECONDITION);
  assert_string_equal(st.message, "host 1 (incarnation 00000000000000b1) has not joined host 0; "
                                  "Join first");
  fsdp_membership_leave_received(f.m, 1, 60, INC_PEER, "stopping");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINING);
  assert_int_equal(fsdp_membership_heartbeat_received(f.m, 1, 60, INC_RESTARTED, &st), 0);

  /* Our Join to it completes the new relationship, with its new address. */
  fsdp_membership_tick(f.m, 60);
  expect(&f.rec, "join 1; ");
  fsdp_membership_join_replied(f.m, 1, 70, INC_RESTARTED);
  fsdp_membership_join_accepted(f.m, 1, 70, new_addr, sizeof new_addr);
  expect(&f.rec, "joined 1 inc b2 addr 2:9; ready; ");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINED);
  fsdp_membership_free(f.m);
}

static void test_a_restart_seen_in_a_heartbeat_reply(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 2);
  join_both(&f, 0, INC_PEER);
  fsdp_membership_tick(f.m, 0);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; heartbeat 1; ");
  fsdp_membership_heartbeat_answered(f.m, 1, 5, INC_RESTARTED, 100);
  expect(&f.rec, "lost 1: host 1 (h1:7000) lost: restarted (incarnation 00000000000000b2, "
                 "before 00000000000000b1); ");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINING);
  assert_int_equal(row(&f, 1)->incarnation, INC_RESTARTED);
  fsdp_membership_tick(f.m, 5);
  expect(&f.rec, "join 1; ");
  fsdp_membership_free(f.m);
}

static void test_a_heartbeat_refused_starts_over(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 2);
  join_both(&f, 0, INC_PEER);
  fsdp_membership_tick(f.m, 0);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; heartbeat 1; ");
  fsdp_membership_heartbeat_refused(f.m, 1, 5, "it no longer counts this host as joined");
  expect(&f.rec, "lost 1: host 1 (h1:7000) lost: it no longer counts this host as joined; ");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_JOINING);
  fsdp_membership_tick(f.m, 5);
  expect(&f.rec, "join 1; ");
  fsdp_membership_free(f.m);
}

static void test_leaves(void **state) {
  (void)state;
  fixture_t f;
  make(&f, 2);
  join_both(&f, 0, INC_PEER);
  expect(&f.rec, "joined 1 inc b1 addr 3:1; ready; ");
  /* Theirs: LEFT at once, not after the timeout. */
  fsdp_membership_leave_received(f.m, 1, 10, INC_PEER, "");
  expect(&f.rec, "lost 1: host 1 (h1:7000) left: left: no reason given; ");
  assert_int_equal(row(&f, 1)->state, FSDP_PEER_LEFT);
  /* Ours: nothing more is sent. */
  fsdp_membership_leave(f.m);
  assert_true(fsdp_membership_leaving(f.m));
  fsdp_membership_tick(f.m, 10 * TIMEOUT_MS);
  expect(&f.rec, "");
  fsdp_membership_free(f.m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_one_host_is_ready_alone),
      cmocka_unit_test(test_join_ours_first_then_theirs),
      cmocka_unit_test(test_join_theirs_first_then_ours),
      cmocka_unit_test(test_ready_needs_every_peer),
      cmocka_unit_test(test_heartbeats_keep_a_peer_joined),
      cmocka_unit_test(test_silence_for_the_timeout_loses_a_peer),
      cmocka_unit_test(test_a_lost_peer_rejoins_with_backoff),
      cmocka_unit_test(test_a_join_with_another_setting_is_refused),
      cmocka_unit_test(test_our_join_refused_ends_a_joined_peer),
      cmocka_unit_test(test_a_new_incarnation_replaces_the_old),
      cmocka_unit_test(test_a_restart_seen_in_a_heartbeat_reply),
      cmocka_unit_test(test_a_heartbeat_refused_starts_over),
      cmocka_unit_test(test_leaves),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
