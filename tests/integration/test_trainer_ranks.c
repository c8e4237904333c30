/* The trainer API (<fsdp/fsdp_trainer.h>) with one real process per local rank against a real
 * fsdpd (issue 3, item 8).
 *
 * For L = 1 to 4 ranks, each its own session in job "ranks-L", and for the param/reduce type
 * pairs fp32/fp32, bf16/fp32 and bf16/bf16: units whose numel is not a multiple of L. Every
 * rank writes its master shard; after a barrier every rank unshards (some through
 * unshard_start and wait) and finds the whole unit as the reference says (fp32 exact, bf16
 * rounded to nearest even), reshards, writes a full gradient of its own and reduce-scatters;
 * its gradient shard must equal, bit for bit, the reference of kernels/kernels.h (the sum
 * in reduce type rounded after each addition, then times 1/L: the daemon's default factors
 * are pre-divide 1 and post-divide L), and an accumulating step adds to it.
 *
 * Then a trainer killed in the middle of a ReduceScatter: ranks 0 and 1 of three submit,
 * rank 2's process is SIGKILLed without submitting, and the two must fail with
 * FSDP_E_ABORTED naming local rank 2 long before store.collective_timeout (30 s): the
 * session ends when the dead process's memory channel closes. The daemon goes on serving,
 * and the job goes on with a new rank-2 process.
 *
 * Only the rank processes use the trainer API; they are this binary started with
 * posix_spawn in its child mode (gRPC and fork() do not mix), and they talk to the parent
 * through a pipe pair each: fixed-size messages up (at a barrier, or "aborted at t"), a "go"
 * down. The parent watches the daemon through Operator.Status to know when the two
 * ReduceScatters are parked, so that it kills rank 2 neither too early nor after a sleep. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fsdp/fsdp_client.h>
#include <fsdp/fsdp_trainer.h>

#include "client/client_rpc.h"
#include "tests/integration/daemon_fixture.h"
#include "fsdp/v1/operator.pb-c.h"

extern char **environ;

#define MAX_RANKS 4
/* Generous bounds for a slow (sanitized) build; a healthy run takes a fraction. */
#define RUN_TIMEOUT_MS 20000
#define CALL_TIMEOUT_MS 20000
#define ABORT_BOUND_MS 5000
/* The children's ends of their pipes, well above anything else they inherit. */
#define CHILD_UP_FD 100
#define CHILD_DOWN_FD 101

/* ---- references ------------------------------------------------------------------------- */

static uint16_t bf16_rne(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); /* finite inputs */
}

static float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Keeps an fp32 result as fp32: no contraction into an FMA, no wider intermediate. */
static float keep(float x) {
  volatile float v = x;
  return v;
}

/* R of kernels.h: rounds an fp32 value to type (a no-op for fp32). */
static float round_to(float x, fsdp_scalar_t type) {
  return type == FSDP_SCALAR_BF16 ? bf16_to_f32(bf16_rne(x)) : x;
}

static uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static bool same_bits(float a, float b) {
  return memcmp(&a, &b, sizeof a) == 0;
}

/* Values whose rounding matters: fractions, small offsets, and every seventh an exact bf16
 * tie (half of them odd, which round to even upwards). Padding is zero. */
static float master_value(uint64_t i, uint64_t numel) {
  if (i >= numel)
    return 0.0f;
  float f = (float)((int)((i * 7919 + 3) % 2003) - 1001) * 0.0371f + (i % 5 == 0 ? 1e-3f : 0.0f);
  if (i % 7 == 3) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u & 0xFFFF0000u) | 0x8000u;
    memcpy(&f, &u, sizeof f);
  }
  return f;
}

/* Rank r's gradient at step s: a different value on every rank and every step. */
static float grad_value(uint64_t i, uint64_t numel, unsigned rank, uint64_t step) {
  if (i >= numel)
    return 0.0f;
  return (float)((int)((i * 31 + 7 * rank + 13 * step) % 101) - 50) * 0.173f +
         (float)rank * 0.0041f;
}

/* The daemon's default gradient factors (fsdp_unit_gradient_scales in daemon/store/unit_layout.c):
 * pre-divide 1, post-divide L. */
static void default_scales(unsigned world, float *ret_pre, float *ret_post) {
  double pre = 1, post = world / pre;
  *ret_pre = (float)(1 / pre);
  *ret_post = (float)(1 / post);
}

/* Element i of a rank's gradient shard after a non-accumulating reduce of step's gradients,
 * per fsdp_reduce: each rank's gradient as stored (param type), rounded to the reduce type
 * and scaled, summed in rank order with a rounding after each addition, then scaled. */
static float reduce_ref(uint64_t i, uint64_t numel, unsigned world, uint64_t step,
                        fsdp_scalar_t param_type, fsdp_scalar_t reduce_type) {
  float pre, post, sum = 0.0f;
  default_scales(world, &pre, &post);
  for (unsigned k = 0; k < world; k++) {
    float src = round_to(grad_value(i, numel, k, step), param_type);
    float v = round_to(keep(round_to(src, reduce_type) * pre), reduce_type);
    sum = k == 0 ? v : round_to(keep(sum + v), reduce_type);
  }
  return round_to(keep(sum * post), reduce_type);
}

/* ---- the units -------------------------------------------------------------------------- */

typedef struct unit_shape {
  const char *name;
  uint64_t shapes[3][2];
  size_t ndims[3];
  size_t n_params;
} unit_shape_t;

/* 413 and 1001 elements: neither a multiple of 2, 3 or 4. Unit a has a scalar. */
static const unit_shape_t SHAPES[] = {
    {"a", {{37, 11}, {5}, {0}}, {2, 1, 0}, 3},
    {"b", {{1001}}, {1}, 1},
};

typedef struct type_pair {
  const char *name;
  fsdp_scalar_t param, reduce;
} type_pair_t;

static const type_pair_t TYPES[] = {
    {"fp32-fp32", FSDP_SCALAR_FP32, FSDP_SCALAR_FP32},
    {"bf16-fp32", FSDP_SCALAR_BF16, FSDP_SCALAR_FP32},
    {"bf16-bf16", FSDP_SCALAR_BF16, FSDP_SCALAR_BF16},
};

#define N_SHAPES (sizeof SHAPES / sizeof SHAPES[0])
#define N_TYPES (sizeof TYPES / sizeof TYPES[0])
#define N_UNITS (N_SHAPES * N_TYPES)

/* One registered unit in a rank process. */
typedef struct rank_unit {
  char name[32];
  const type_pair_t *types;
  fsdp_unit_handle_t *handle;
  const fsdp_unit_view_t *v;
  uint64_t numel, lo, hi; /* this rank's shard is [lo, hi) */
  bool started;
} rank_unit_t;

/* ---- the rank processes ----------------------------------------------------------------- */

enum { MSG_BARRIER = 'b', MSG_ABORTED = 'a', MSG_GO = 'g' };

/* One write each, well under PIPE_BUF: never split. */
typedef struct msg {
  int32_t kind;
  int32_t pad;
  int64_t value;
} msg_t;

static unsigned g_rank;
static const char *g_mode = "";

/* One write per message, so that the ranks' lines do not interleave. */
__attribute__((format(printf, 2, 3))) static void report(int line, const char *fmt, ...) {
  char text[1024];
  int n = snprintf(text, sizeof text, "%s rank %u, line %d: ", g_mode, g_rank, line);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text + n, sizeof text - (size_t)n, fmt, ap);
  va_end(ap);
  fprintf(stderr, "%s\n", text);
}

#define EXPECT(cond, ...)            \
  do {                               \
    if (!(cond)) {                   \
      report(__LINE__, __VA_ARGS__); \
      goto out;                      \
    }                                \
  } while (0)

#define EXPECT_OK(call, client)                                                              \
  do {                                                                                       \
    int r_ = (call);                                                                         \
    EXPECT(r_ == 0, "%s = %d (%s): %s", #call, r_, fsdp_strerror(r_),                        \
           fsdp_client_last_error(client));                                                  \
  } while (0)

static int send_up(int kind, int64_t value) {
  msg_t m = {.kind = kind, .value = value};
  return write(CHILD_UP_FD, &m, sizeof m) == (ssize_t)sizeof m ? 0 : -1;
}

/* Reports arrival and waits for the parent's go (or the parent's end). */
static int barrier(void) {
  if (send_up(MSG_BARRIER, 0) < 0)
    return -1;
  struct pollfd p = {.fd = CHILD_DOWN_FD, .events = POLLIN};
  msg_t m;
  if (poll(&p, 1, RUN_TIMEOUT_MS) != 1 || read(CHILD_DOWN_FD, &m, sizeof m) != (ssize_t)sizeof m)
    return -1;
  return m.kind == MSG_GO ? 0 : -1;
}

/* Registers a unit of shape s and types t and checks its view; 0 or -1 (reported). */
static int register_unit(fsdp_client_t *client, fsdp_trainer_t *trainer, unsigned world,
                         const unit_shape_t *s, const type_pair_t *t, rank_unit_t *ret) {
  static const char *const names[] = {"w", "b", "s"};
  fsdp_param_desc_t params[3];
  uint64_t numel = 0, offsets[3];
  for (size_t i = 0; i < s->n_params; i++) {
    params[i] = (fsdp_param_desc_t){names[i], s->shapes[i], s->ndims[i], true};
    offsets[i] = numel;
    uint64_t n = 1;
    for (size_t d = 0; d < s->ndims[i]; d++)
      n *= s->shapes[i][d];
    numel += n;
  }
  snprintf(ret->name, sizeof ret->name, "%s-%s", s->name, t->name);
  fsdp_unit_desc_t desc = {.name = ret->name, .params = params, .n_params = s->n_params,
                           .strategy = FSDP_FULL_SHARD, .param_type = t->param,
                           .reduce_type = t->reduce};
  EXPECT_OK(fsdp_trainer_register_unit(trainer, &desc, &ret->handle), client);
  const fsdp_unit_view_t *v = fsdp_unit_view(ret->handle);
  uint64_t padded = (numel + world - 1) / world * world;
  EXPECT(v->numel == numel && v->padded_numel == padded && v->shard_numel == padded / world &&
             v->shard == g_rank && v->n_params == s->n_params,
         "unit '%s': view numel %llu padded %llu shard %u of %llu elements, expected %llu, "
         "%llu, %u, %llu",
         ret->name, (unsigned long long)v->numel, (unsigned long long)v->padded_numel, v->shard,
         (unsigned long long)v->shard_numel, (unsigned long long)numel,
         (unsigned long long)padded, g_rank, (unsigned long long)(padded / world));
  for (size_t i = 0; i < s->n_params; i++)
    EXPECT(v->param_offsets[i] == offsets[i], "unit '%s': param %zu at %llu, expected %llu",
           ret->name, i, (unsigned long long)v->param_offsets[i],
           (unsigned long long)offsets[i]);
  ret->types = t;
  ret->v = v;
  ret->numel = numel;
  ret->lo = (uint64_t)v->shard * v->shard_numel;
  ret->hi = ret->lo + v->shard_numel;
  ret->started = false;
  return 0;
out:
  return -1;
}

static void write_master(const rank_unit_t *u) {
  for (uint64_t i = u->lo; i < u->hi; i++)
    u->v->master[i] = master_value(i, u->numel);
}

static void write_full_grad(const rank_unit_t *u, uint64_t step) {
  for (uint64_t i = 0; i < u->v->padded_numel; i++) {
    float g = grad_value(i, u->numel, g_rank, step);
    if (u->types->param == FSDP_SCALAR_BF16)
      ((uint16_t *)u->v->full_grad)[i] = bf16_rne(g);
    else
      ((float *)u->v->full_grad)[i] = g;
  }
}

/* The whole unsharded unit against the masters every rank wrote. */
static int check_unsharded(const rank_unit_t *u) {
  for (uint64_t i = 0; i < u->v->padded_numel; i++) {
    float want = master_value(i, u->numel);
    if (u->types->param == FSDP_SCALAR_BF16) {
      uint16_t got = ((const uint16_t *)u->v->unsharded)[i];
      EXPECT(got == bf16_rne(want),
             "unit '%s': unsharded[%llu] = bf16 %#06x, expected %#06x (of %.9g)", u->name,
             (unsigned long long)i, got, bf16_rne(want), want);
    } else {
      float got = ((const float *)u->v->unsharded)[i];
      EXPECT(same_bits(got, want), "unit '%s': unsharded[%llu] = %.9g, expected %.9g",
             u->name, (unsigned long long)i, got, want);
    }
  }
  return 0;
out:
  return -1;
}

/* This rank's gradient shard after step (accumulating onto prev_step's result if given). */
static int check_grad(const rank_unit_t *u, unsigned world, uint64_t step, uint64_t prev_step) {
  for (uint64_t i = u->lo; i < u->hi; i++) {
    float want = reduce_ref(i, u->numel, world, step, u->types->param, u->types->reduce);
    if (prev_step)
      want = keep(reduce_ref(i, u->numel, world, prev_step, u->types->param, u->types->reduce) +
                  want);
    float got = u->v->grad[i];
    EXPECT(same_bits(got, want),
           "unit '%s' step %llu: grad[%llu] = %.9g (%#010x), expected %.9g (%#010x)", u->name,
           (unsigned long long)step, (unsigned long long)i, got, float_bits(got), want,
           float_bits(want));
  }
  return 0;
out:
  return -1;
}

static fsdp_client_t *connect_client(const char *target) {
  fsdp_client_options_t opts = FSDP_CLIENT_OPTIONS_INIT;
  opts.timeout_ms = CALL_TIMEOUT_MS; /* a deadline must not pass for an abort */
  fsdp_client_t *client = NULL;
  if (fsdp_client_connect(target, &opts, &client) < 0)
    return NULL;
  return client;
}

/* Mode "step": every unit through Unshard, ReduceScatter and an accumulating step. */
static int rank_step(fsdp_client_t *client, fsdp_trainer_t *trainer, unsigned world) {
  rank_unit_t units[N_UNITS];
  for (size_t s = 0; s < N_SHAPES; s++)
    for (size_t t = 0; t < N_TYPES; t++)
      if (register_unit(client, trainer, world, &SHAPES[s], &TYPES[t], &units[s * N_TYPES + t]))
        return -1;

  /* Each rank writes its own master shards; nobody unshards before every rank has. */
  for (size_t j = 0; j < N_UNITS; j++)
    write_master(&units[j]);
  EXPECT(barrier() == 0, "barrier after the masters");

  /* Half the units are prefetched (which half differs between ranks), the rest unsharded
   * in the order of use. */
  for (size_t j = 0; j < N_UNITS; j++)
    if ((g_rank + j) % 2 == 1) {
      EXPECT_OK(fsdp_trainer_unshard_start(trainer, units[j].handle, 1, FSDP_PASS_FORWARD),
                client);
      units[j].started = true;
    }
  for (size_t j = 0; j < N_UNITS; j++) {
    if (units[j].started)
      EXPECT_OK(fsdp_trainer_wait(trainer, units[j].handle, 0), client);
    else
      EXPECT_OK(fsdp_trainer_unshard(trainer, units[j].handle, 1, FSDP_PASS_FORWARD), client);
    EXPECT(check_unsharded(&units[j]) == 0, "unsharded");
    EXPECT_OK(fsdp_trainer_reshard(trainer, units[j].handle, 1), client);
  }

  /* The backward: each unit gathered again with its gradient buffer lent, written, reduced. */
  for (size_t j = 0; j < N_UNITS; j++) {
    EXPECT_OK(fsdp_trainer_unshard(trainer, units[j].handle, 1, FSDP_PASS_BACKWARD), client);
    EXPECT(check_unsharded(&units[j]) == 0, "unsharded for the backward");
    write_full_grad(&units[j], 1);
    EXPECT_OK(fsdp_trainer_reduce_scatter(trainer, units[j].handle, 1, false), client);
    EXPECT_OK(fsdp_trainer_reshard(trainer, units[j].handle, 1), client);
    EXPECT(check_grad(&units[j], world, 1, 0) == 0, "reduce-scatter");
  }
  /* A no_sync step: the new mean adds to the shards. */
  for (size_t j = 0; j < N_UNITS; j++) {
    EXPECT_OK(fsdp_trainer_unshard(trainer, units[j].handle, 2, FSDP_PASS_BACKWARD), client);
    write_full_grad(&units[j], 2);
    EXPECT_OK(fsdp_trainer_reduce_scatter(trainer, units[j].handle, 2, true), client);
    EXPECT_OK(fsdp_trainer_reshard(trainer, units[j].handle, 2), client);
    EXPECT(check_grad(&units[j], world, 2, 1) == 0, "accumulating reduce-scatter");
  }
  return 0;
out:
  return -1;
}

/* Modes "kill" (ranks 0 and 1 are aborted; rank 2 waits to be killed) and "rejoin" (the new
 * rank 2). One unit; after the abort, step 2 with every rank. */
static int rank_kill(fsdp_client_t *client, fsdp_trainer_t *trainer, unsigned world,
                     bool rejoin) {
  rank_unit_t u;
  if (register_unit(client, trainer, world, &SHAPES[0], &TYPES[1], &u))
    return -1;
  if (!rejoin) {
    write_master(&u);
    EXPECT_OK(fsdp_trainer_unshard(trainer, u.handle, 1, FSDP_PASS_BACKWARD), client);
    write_full_grad(&u, 1);
    EXPECT(barrier() == 0, "barrier before the reduce-scatter");
    if (g_rank == 2) {
      /* Never submits; the parent kills it here. */
      struct pollfd p = {.fd = CHILD_DOWN_FD, .events = POLLIN};
      poll(&p, 1, RUN_TIMEOUT_MS);
      EXPECT(false, "rank 2 was not killed");
    }
    int r = fsdp_trainer_reduce_scatter(trainer, u.handle, 1, false);
    int64_t at = now_ms();
    EXPECT(r == FSDP_E_ABORTED, "reduce-scatter with rank 2 killed = %d (%s), expected %s: %s",
           r, fsdp_strerror(r), fsdp_strerror(FSDP_E_ABORTED), fsdp_client_last_error(client));
    EXPECT(strstr(fsdp_client_last_error(client), "local rank 2") != NULL,
           "the abort does not name local rank 2: %s", fsdp_client_last_error(client));
    if (g_rank == 0)
      fprintf(stderr, "rank 0 aborted: %s\n", fsdp_client_last_error(client));
    EXPECT(send_up(MSG_ABORTED, at) == 0, "report the abort");
  } else {
    /* The daemon kept the job's memory: the dead rank's master shard is as it wrote it. */
    for (uint64_t i = u.lo; i < u.hi; i++)
      EXPECT(same_bits(u.v->master[i], master_value(i, u.numel)),
             "rejoined: master[%llu] = %.9g, expected %.9g", (unsigned long long)i,
             u.v->master[i], master_value(i, u.numel));
  }
  EXPECT(barrier() == 0, "barrier before step 2");
  EXPECT_OK(fsdp_trainer_unshard(trainer, u.handle, 2, FSDP_PASS_BACKWARD), client);
  write_full_grad(&u, 2);
  EXPECT_OK(fsdp_trainer_reduce_scatter(trainer, u.handle, 2, false), client);
  EXPECT(check_grad(&u, world, 2, 0) == 0, "reduce-scatter after the abort");
  return 0;
out:
  return -1;
}

static int rank_child(const char *mode, const char *target, const char *job, unsigned rank,
                      unsigned world) {
  g_rank = rank;
  g_mode = mode;
  int status = 1;
  fsdp_trainer_t *trainer = NULL;
  fsdp_client_t *client = connect_client(target);
  EXPECT(client, "connect %s", target);
  fsdp_trainer_options_t opts = {.job = job, .local_rank = rank, .local_world_size = world};
  EXPECT_OK(fsdp_trainer_attach(client, &opts, &trainer), client);

  int r;
  if (strcmp(mode, "step") == 0)
    r = rank_step(client, trainer, world);
  else if (strcmp(mode, "kill") == 0 || strcmp(mode, "rejoin") == 0)
    r = rank_kill(client, trainer, world, strcmp(mode, "rejoin") == 0);
  else
    r = -1;
  EXPECT(r == 0, "mode %s failed", mode);

  fsdp_trainer_t *t = trainer;
  trainer = NULL;
  EXPECT_OK(fsdp_trainer_detach(t), client);
  status = 0;
out:
  fsdp_trainer_detach(trainer);
  fsdp_client_close(client);
  return status;
}

/* ---- the daemon ------------------------------------------------------------------------- */

static daemon_fixture_t g_daemon;

static int start_daemon(void **state) {
  (void)state;
  /* store.collective_timeout stays at its default (30 s): the abort must not need it. */
  static const char *const args[] = {"--set", "memory.job_limit=64MiB", NULL};
  return daemon_fixture_start(&g_daemon, "fsdp-ranks", args);
}

static int stop_daemon(void **state) {
  (void)state;
  return daemon_fixture_stop(&g_daemon);
}

/* ---- the parent's side ------------------------------------------------------------------ */

typedef struct rank_proc {
  pid_t pid; /* 0: none, or reaped */
  int up, down;
  unsigned rank;
} rank_proc_t;

/* Every process a test started, so that a failed assertion's teardown ends them. */
static rank_proc_t g_procs[2 * MAX_RANKS];
static size_t g_n_procs;

static rank_proc_t *spawn_rank(const char *mode, const char *job, unsigned rank,
                               unsigned world) {
  assert_true(g_n_procs < sizeof g_procs / sizeof g_procs[0]);
  rank_proc_t *p = &g_procs[g_n_procs++];
  int up[2], down[2];
  assert_int_equal(pipe2(up, O_CLOEXEC), 0);
  assert_int_equal(pipe2(down, O_CLOEXEC), 0);
  char rank_s[16], world_s[16];
  snprintf(rank_s, sizeof rank_s, "%u", rank);
  snprintf(world_s, sizeof world_s, "%u", world);
  char *argv[] = {"/proc/self/exe", "--rank-child", (char *)mode, g_daemon.target, (char *)job,
                  rank_s, world_s, NULL};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, up[1], CHILD_UP_FD);
  posix_spawn_file_actions_adddup2(&fa, down[0], CHILD_DOWN_FD);
  int r = posix_spawn(&p->pid, "/proc/self/exe", &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(up[1]);
  close(down[0]);
  p->up = up[0];
  p->down = down[1];
  p->rank = rank;
  if (r != 0) {
    p->pid = 0;
    fail_msg("posix_spawn: %s", strerror(r));
  }
  return p;
}

/* Waits until every one of procs has sent a message of kind (its value in ret_values[i] if
 * given), or one ends or sends something else (fails), or the deadline passes (fails). */
static void gather(rank_proc_t *const *procs, size_t n, int kind, int64_t deadline,
                   int64_t *ret_values) {
  bool got[2 * MAX_RANKS] = {false};
  for (size_t left = n; left > 0;) {
    struct pollfd fds[2 * MAX_RANKS];
    size_t idx[2 * MAX_RANKS], nfds = 0;
    for (size_t i = 0; i < n; i++)
      if (!got[i]) {
        fds[nfds] = (struct pollfd){.fd = procs[i]->up, .events = POLLIN};
        idx[nfds++] = i;
      }
    int64_t wait = deadline - now_ms();
    if (wait <= 0)
      fail_msg("waiting for message '%c': %zu of %zu ranks did not send it in time", kind, left,
               n);
    int r = poll(fds, nfds, (int)wait);
    assert_true(r >= 0 || errno == EINTR);
    for (size_t k = 0; k < nfds && r > 0; k++) {
      if (!fds[k].revents)
        continue;
      size_t i = idx[k];
      msg_t m;
      ssize_t got_bytes = read(procs[i]->up, &m, sizeof m);
      if (got_bytes != (ssize_t)sizeof m)
        fail_msg("rank %u ended while its parent waited for message '%c'", procs[i]->rank,
                 kind);
      if (m.kind != kind)
        fail_msg("rank %u sent '%c', expected '%c'", procs[i]->rank, m.kind, kind);
      if (ret_values)
        ret_values[i] = m.value;
      got[i] = true;
      left--;
    }
  }
}

static void release(rank_proc_t *const *procs, size_t n) {
  msg_t go = {.kind = MSG_GO};
  for (size_t i = 0; i < n; i++)
    assert_int_equal(write(procs[i]->down, &go, sizeof go), (ssize_t)sizeof go);
}

static void close_proc(rank_proc_t *p) {
  if (p->up >= 0)
    close(p->up);
  if (p->down >= 0)
    close(p->down);
  p->up = p->down = -1;
}

/* Reaps every one of procs by the deadline; fails unless each exited 0. */
static void reap(rank_proc_t *const *procs, size_t n, int64_t deadline) {
  int failed = 0;
  for (size_t i = 0; i < n; i++) {
    rank_proc_t *p = procs[i];
    int wstatus = 0;
    bool exited = false;
    while (!(exited = waitpid(p->pid, &wstatus, WNOHANG) == p->pid) && now_ms() < deadline)
      poll(NULL, 0, 5);
    if (!exited)
      wstatus = stop_process(p->pid, SIGKILL, 1000);
    p->pid = 0;
    close_proc(p);
    if (!exited || !WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
      fprintf(stderr, "rank %u ended with wait status %#x%s\n", p->rank, wstatus,
              exited ? "" : " (killed: it did not end in time)");
      failed++;
    }
  }
  assert_int_equal(failed, 0);
}

static int end_procs(void **state) {
  (void)state;
  for (size_t i = 0; i < g_n_procs; i++) {
    if (g_procs[i].pid > 0)
      stop_process(g_procs[i].pid, SIGKILL, 1000);
    g_procs[i].pid = 0;
    close_proc(&g_procs[i]);
  }
  g_n_procs = 0;
  return 0;
}

static void run_world(unsigned world) {
  char job[32];
  snprintf(job, sizeof job, "ranks-%u", world);
  int64_t t0 = now_ms(), deadline = t0 + RUN_TIMEOUT_MS;
  rank_proc_t *procs[MAX_RANKS];
  for (unsigned r = 0; r < world; r++)
    procs[r] = spawn_rank("step", job, r, world);
  gather(procs, world, MSG_BARRIER, deadline, NULL);
  release(procs, world);
  reap(procs, world, deadline);
  fprintf(stderr, "L = %u: %zu units through two steps in %lld ms\n", world, N_UNITS,
          (long long)(now_ms() - t0));
}

static void test_one_rank(void **state) {
  (void)state;
  run_world(1);
}

static void test_two_ranks(void **state) {
  (void)state;
  run_world(2);
}

static void test_three_ranks(void **state) {
  (void)state;
  run_world(3);
}

static void test_four_ranks(void **state) {
  (void)state;
  run_world(4);
}

/* Polls Operator.ListUnits until at least n ranks of job wait in a unit's reduce-scatter,
 * by the deadline (whichever path, gRPC or the fast path, their requests came by). */
static void await_ranks_reducing(const char *job, unsigned n, int64_t deadline) {
  fsdp_client_options_t opts = FSDP_CLIENT_OPTIONS_INIT;
  opts.timeout_ms = 2000;
  fsdp_client_t *client = NULL;
  assert_int_equal(fsdp_client_connect(g_daemon.target, &opts, &client), 0);
  size_t seen = 0;
  for (;;) {
    Fsdp__V1__ListUnitsRequest rq = FSDP__V1__LIST_UNITS_REQUEST__INIT;
    rq.job = (char *)job;
    ProtobufCMessage *reply = NULL;
    int r = fsdp_client_call(client, "/fsdp.v1.Operator/ListUnits", &rq.base,
                             &fsdp__v1__list_units_reply__descriptor, 0, &reply);
    if (r < 0)
      fail_msg("Operator.ListUnits: %s: %s", fsdp_strerror(r), fsdp_client_last_error(client));
    const Fsdp__V1__ListUnitsReply *units = (const void *)reply;
    seen = 0;
    for (size_t u = 0; u < units->n_units; u++)
      for (size_t c = 0; c < units->units[u]->n_collectives; c++) {
        const Fsdp__V1__CollectiveInfo *ci = units->units[u]->collectives[c];
        if (ci->kind == FSDP__V1__COLLECTIVE_INFO__KIND__REDUCE_SCATTER && ci->n_ranks > seen)
          seen = ci->n_ranks;
      }
    protobuf_c_message_free_unpacked(reply, NULL);
    if (seen >= n || now_ms() > deadline)
      break;
    poll(NULL, 0, 2);
  }
  fsdp_client_close(client);
  if (seen < n)
    fail_msg("%zu ranks of job '%s' wait in a reduce-scatter, expected %u", seen, job, n);
}

static void test_rank_killed_in_reduce_scatter(void **state) {
  (void)state;
  const char *job = "ranks-kill";
  int64_t deadline = now_ms() + RUN_TIMEOUT_MS;
  rank_proc_t *procs[3];
  for (unsigned r = 0; r < 3; r++)
    procs[r] = spawn_rank("kill", job, r, 3);
  gather(procs, 3, MSG_BARRIER, deadline, NULL);
  release(procs, 3);

  /* Ranks 0 and 1 are parked in their ReduceScatter; rank 2 waits for nothing. */
  await_ranks_reducing(job, 2, now_ms() + ABORT_BOUND_MS);
  int64_t killed_at = now_ms();
  assert_int_equal(kill(procs[2]->pid, SIGKILL), 0);
  int wstatus = 0;
  assert_int_equal(waitpid(procs[2]->pid, &wstatus, 0), procs[2]->pid);
  procs[2]->pid = 0;
  close_proc(procs[2]);
  assert_true(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL);

  int64_t aborted_at[2];
  gather(procs, 2, MSG_ABORTED, killed_at + ABORT_BOUND_MS + 1000, aborted_at);
  int64_t worst = aborted_at[0] > aborted_at[1] ? aborted_at[0] : aborted_at[1];
  fprintf(stderr,
          "ABORTED %lld ms after the SIGKILL (rank 0: %lld ms, rank 1: %lld ms; "
          "store.collective_timeout is 30 s)\n",
          (long long)(worst - killed_at), (long long)(aborted_at[0] - killed_at),
          (long long)(aborted_at[1] - killed_at));
  assert_true(worst - killed_at < ABORT_BOUND_MS);

  /* The daemon still serves, and the job goes on with a new rank 2. */
  assert_true(daemon_fixture_is_serving(&g_daemon));
  procs[2] = spawn_rank("rejoin", job, 2, 3);
  gather(procs, 3, MSG_BARRIER, deadline, NULL);
  release(procs, 3);
  reap(procs, 3, deadline);
}

int main(int argc, char **argv) {
  if (argc == 7 && strcmp(argv[1], "--rank-child") == 0)
    return rank_child(argv[2], argv[3], argv[4], (unsigned)atoi(argv[5]),
                      (unsigned)atoi(argv[6]));
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_teardown(test_one_rank, end_procs),
      cmocka_unit_test_teardown(test_two_ranks, end_procs),
      cmocka_unit_test_teardown(test_three_ranks, end_procs),
      cmocka_unit_test_teardown(test_four_ranks, end_procs),
      cmocka_unit_test_teardown(test_rank_killed_in_reduce_scatter, end_procs),
  };
  return cmocka_run_group_tests(tests, start_daemon, stop_daemon);
}
