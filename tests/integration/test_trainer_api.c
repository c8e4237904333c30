/* The trainer API (<fsdp/fsdp_trainer.h>) against a real fsdpd: two local ranks in two
 * processes attach, register a unit, write their master shards, unshard (one through
 * unshard_start and wait), read the whole unit (fp32 exact, bf16 rounded to nearest even),
 * reshard, write their full gradients and reduce-scatter, and each finds the mean of both
 * ranks' gradients in its shard; a NO_SHARD unit goes through AllReduce. Argument errors,
 * daemon errors with their messages, started calls and detaching with one in flight. Short
 * calls from threads at pauses around the daemon's polling window, and replies that come
 * after the trainer fell asleep, each answered within a deadline that only a request or
 * reply left without its wake-up would run out.
 *
 * gRPC and fork() do not mix, and this process uses gRPC: the rank processes are this same
 * binary started with posix_spawn in its child mode (--rank-child), and they report through
 * their exit status and stderr; a pipe pair lets the parent hold both at a barrier until both
 * have written their master shards. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <fsdp/fsdp_client.h>
#include <fsdp/fsdp_trainer.h>

#include "client/client_rpc.h"
#include "common/clock.h"
#include "tests/integration/daemon_fixture.h"
#include "fsdp/v1/trainer.pb-c.h"

extern char **environ;

#define WORLD 2
#define JOB_LIMIT_BYTES (64u << 20)
#define RANKS_TIMEOUT_MS 20000
/* The children's ends of the barrier pipes, well above anything else they inherit. */
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

/* Values whose rounding matters: fractions, near-ties, small offsets. */
static float master_value(uint64_t i, uint64_t numel) {
  if (i >= numel)
    return 0.0f;
  return (float)((int)((i * 7919 + 3) % 2003) - 1001) * 0.0371f + (i % 5 == 0 ? 1e-3f : 0.0f);
}

static float grad_value(uint64_t i, uint64_t numel, unsigned rank) {
  if (i >= numel)
    return 0.0f;
  return (float)((int)((i * 31 + 7 * rank) % 101) - 50) * 0.173f;
}

/* A gradient as the rank stores it in param_type, read back as fp32. */
static float as_param(float v, fsdp_scalar_t type) {
  return type == FSDP_SCALAR_BF16 ? bf16_to_f32(bf16_rne(v)) : v;
}

/* ---- the rank processes ----------------------------------------------------------------- */

typedef struct rank_case {
  const char *name;
  fsdp_scalar_t param_type;
  uint64_t shapes[3][2];
  size_t ndims[3];
  size_t n_params;
} rank_case_t;

static const rank_case_t CASES[] = {
    /* 415 elements: one of padding at world 2. */
    {"fp32", FSDP_SCALAR_FP32, {{37, 11}, {5}, {3}}, {2, 1, 1}, 3},
    {"bf16", FSDP_SCALAR_BF16, {{37, 11}, {5}}, {2, 1}, 2},
};

static unsigned g_rank;

/* One write per message, so that the two ranks' lines do not interleave. */
__attribute__((format(printf, 2, 3))) static void report(int line, const char *fmt, ...) {
  char msg[1024];
  int n = snprintf(msg, sizeof msg, "rank %u, line %d: ", g_rank, line);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg + n, sizeof msg - (size_t)n, fmt, ap);
  va_end(ap);
  fprintf(stderr, "%s\n", msg);
}

#define EXPECT(cond, ...)           \
  do {                              \
    if (!(cond)) {                  \
      report(__LINE__, __VA_ARGS__); \
      goto out;                     \
    }                               \
  } while (0)

#define EXPECT_OK(call, client)                                                              \
  do {                                                                                       \
    int r_ = (call);                                                                         \
    EXPECT(r_ == 0, "%s = %d (%s): %s", #call, r_, fsdp_strerror(r_),                        \
           fsdp_client_last_error(client));                                                  \
  } while (0)

/* The rank's gradient, in the unit's param type, into the full-gradient buffer it was lent. */
static void write_full_grad(const fsdp_unit_view_t *v, fsdp_scalar_t type, uint64_t padded,
                            uint64_t numel, unsigned rank) {
  for (uint64_t i = 0; i < padded; i++) {
    float g = grad_value(i, numel, rank);
    if (type == FSDP_SCALAR_BF16)
      ((uint16_t *)v->full_grad)[i] = bf16_rne(g);
    else
      ((float *)v->full_grad)[i] = g;
  }
}

static int barrier(void) {
  char c = 'r';
  if (write(CHILD_UP_FD, &c, 1) != 1)
    return -1;
  struct pollfd p = {.fd = CHILD_DOWN_FD, .events = POLLIN};
  if (poll(&p, 1, RANKS_TIMEOUT_MS) != 1 || read(CHILD_DOWN_FD, &c, 1) != 1)
    return -1;
  return 0;
}

static int rank_child(const char *target, const char *job, unsigned rank, const char *case_name) {
  g_rank = rank;
  const rank_case_t *c = NULL;
  for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++)
    if (strcmp(CASES[i].name, case_name) == 0)
      c = &CASES[i];
  if (!c)
    return 2;

  int status = 1;
  fsdp_client_t *client = NULL;
  fsdp_trainer_t *trainer = NULL;
  EXPECT(fsdp_client_connect(target, NULL, &client) == 0, "connect %s", target);
  fsdp_trainer_options_t opts = {.job = job, .local_rank = rank, .local_world_size = WORLD};
  EXPECT_OK(fsdp_trainer_attach(client, &opts, &trainer), client);
  size_t memory_size = 0;
  EXPECT(fsdp_trainer_memory(trainer, &memory_size) && memory_size == JOB_LIMIT_BYTES,
         "mapped %zu bytes", memory_size);

  fsdp_param_desc_t params[3];
  uint64_t numel = 0, offsets[3];
  for (size_t i = 0; i < c->n_params; i++) {
    static const char *const names[] = {"w", "b", "s"};
    params[i] = (fsdp_param_desc_t){names[i], c->shapes[i], c->ndims[i], true};
    offsets[i] = numel;
    uint64_t n = 1;
    for (size_t d = 0; d < c->ndims[i]; d++)
      n *= c->shapes[i][d];
    numel += n;
  }
  fsdp_unit_desc_t desc = {.name = "layer0", .params = params, .n_params = c->n_params,
                           .strategy = FSDP_FULL_SHARD, .param_type = c->param_type,
                           .reduce_type = FSDP_SCALAR_FP32};
  fsdp_unit_handle_t *unit = NULL, *again = NULL;
  EXPECT_OK(fsdp_trainer_register_unit(trainer, &desc, &unit), client);
  EXPECT_OK(fsdp_trainer_register_unit(trainer, &desc, &again), client);
  EXPECT(again == unit, "registering again gave another handle");

  const fsdp_unit_view_t *v = fsdp_unit_view(unit);
  uint64_t padded = (numel + WORLD - 1) / WORLD * WORLD;
  EXPECT(v->numel == numel && v->padded_numel == padded && v->shard_numel == padded / WORLD &&
             v->shard == rank && v->n_params == c->n_params,
         "view numel %llu padded %llu shard %u of %llu", (unsigned long long)v->numel,
         (unsigned long long)v->padded_numel, v->shard, (unsigned long long)v->shard_numel);
  for (size_t i = 0; i < c->n_params; i++)
    EXPECT(v->param_offsets[i] == offsets[i], "param %zu at %llu", i,
           (unsigned long long)v->param_offsets[i]);

  /* Each rank writes its own master shard; nobody unshards before both have. */
  uint64_t lo = (uint64_t)v->shard * v->shard_numel;
  for (uint64_t i = lo; i < lo + v->shard_numel; i++)
    v->master[i] = master_value(i, numel);
  EXPECT(barrier() == 0, "barrier");

  if (rank == 1) {
    EXPECT_OK(fsdp_trainer_unshard_start(trainer, unit, 1, FSDP_PASS_FORWARD), client);
    EXPECT(fsdp_trainer_unshard_start(trainer, unit, 1, FSDP_PASS_FORWARD) == -EBUSY,
           "second start");
    EXPECT_OK(fsdp_trainer_wait(trainer, unit, 0), client);
  } else {
    EXPECT_OK(fsdp_trainer_unshard(trainer, unit, 1, FSDP_PASS_FORWARD), client);
  }
  EXPECT(v->unsharded && !v->full_grad, "a forward Unshard lends the copy alone");
  for (uint64_t i = 0; i < padded; i++) {
    float want = master_value(i, numel);
    if (c->param_type == FSDP_SCALAR_BF16) {
      uint16_t got = ((const uint16_t *)v->unsharded)[i];
      EXPECT(got == bf16_rne(want), "unsharded[%llu] = bf16 %#06x, expected %#06x (of %.9g)",
             (unsigned long long)i, got, bf16_rne(want), want);
    } else {
      float got = ((const float *)v->unsharded)[i];
      EXPECT(memcmp(&got, &want, sizeof got) == 0, "unsharded[%llu] = %.9g, expected %.9g",
             (unsigned long long)i, got, want);
    }
  }
  const void *copy = v->unsharded;
  EXPECT_OK(fsdp_trainer_reshard(trainer, unit, 1), client);
  EXPECT(!v->unsharded, "a Reshard takes the copy off the view");

  /* The backward's Unshard gathers again into the same address, and lends the gradient
   * buffer, which the ReduceScatter takes back. */
  EXPECT_OK(fsdp_trainer_unshard(trainer, unit, 1, FSDP_PASS_BACKWARD), client);
  EXPECT(v->unsharded == copy && v->full_grad, "a backward Unshard lends copy and gradient");
  write_full_grad(v, c->param_type, padded, numel, rank);
  EXPECT_OK(fsdp_trainer_reduce_scatter(trainer, unit, 1, false), client);
  EXPECT(!v->full_grad, "the ReduceScatter takes the gradient buffer back");
  EXPECT_OK(fsdp_trainer_reshard(trainer, unit, 1), client);
  for (uint64_t i = lo; i < lo + v->shard_numel; i++) {
    float want = (as_param(grad_value(i, numel, 0), c->param_type) +
                  as_param(grad_value(i, numel, 1), c->param_type)) *
                 0.5f;
    EXPECT(v->grad[i] == want, "grad[%llu] = %.9g, expected %.9g", (unsigned long long)i,
           v->grad[i], want);
  }
  /* A no_sync step adds to the shards; a lent gradient buffer is stale until written. */
  EXPECT_OK(fsdp_trainer_unshard(trainer, unit, 2, FSDP_PASS_BACKWARD), client);
  write_full_grad(v, c->param_type, padded, numel, rank);
  EXPECT_OK(fsdp_trainer_reduce_scatter(trainer, unit, 2, true), client);
  EXPECT_OK(fsdp_trainer_reshard(trainer, unit, 2), client);
  for (uint64_t i = lo; i < lo + v->shard_numel; i++) {
    float mean = (as_param(grad_value(i, numel, 0), c->param_type) +
                  as_param(grad_value(i, numel, 1), c->param_type)) *
                 0.5f;
    EXPECT(v->grad[i] == mean + mean, "accumulated grad[%llu] = %.9g, expected %.9g",
           (unsigned long long)i, v->grad[i], mean + mean);
  }

  /* NO_SHARD: one whole copy, through AllReduce. */
  uint64_t shape9[] = {9};
  fsdp_param_desc_t rep_param = {"bias", shape9, 1, true};
  fsdp_unit_desc_t rep = {.name = "replicated", .params = &rep_param, .n_params = 1,
                          .strategy = FSDP_NO_SHARD, .param_type = FSDP_SCALAR_FP32};
  fsdp_unit_handle_t *ru = NULL;
  EXPECT_OK(fsdp_trainer_register_unit(trainer, &rep, &ru), client);
  const fsdp_unit_view_t *rv = fsdp_unit_view(ru);
  EXPECT(rv->shard_numel == rv->padded_numel && rv->padded_numel == 9, "NO_SHARD view");
  EXPECT_OK(fsdp_trainer_unshard(trainer, ru, 1, FSDP_PASS_BACKWARD), client);
  for (uint64_t i = 0; i < 9; i++)
    ((float *)rv->full_grad)[i] = grad_value(i, 9, rank);
  EXPECT_OK(fsdp_trainer_reduce_scatter(trainer, ru, 1, false), client);
  for (uint64_t i = 0; i < 9; i++) {
    float want = (grad_value(i, 9, 0) + grad_value(i, 9, 1)) * 0.5f;
    EXPECT(rv->grad[i] == want, "replicated grad[%llu] = %.9g, expected %.9g",
           (unsigned long long)i, rv->grad[i], want);
  }

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
  static const char *const args[] = {"--set", "memory.job_limit=64MiB", NULL};
  return daemon_fixture_start(&g_daemon, "fsdp-trainer", args);
}

static int stop_daemon(void **state) {
  (void)state;
  return daemon_fixture_stop(&g_daemon);
}

/* ---- the parent's side of the two-rank runs --------------------------------------------- */

/* Starts both ranks, releases them from the barrier once both reached it, and returns how
 * many exited 0; a rank that dies early releases nothing and the others are killed. */
static int run_ranks(const char *job, const char *case_name) {
  int up[2], down[2];
  assert_int_equal(pipe2(up, O_CLOEXEC), 0);
  assert_int_equal(pipe2(down, O_CLOEXEC), 0);
  pid_t pids[WORLD];
  for (unsigned r = 0; r < WORLD; r++) {
    char rank[16];
    snprintf(rank, sizeof rank, "%u", r);
    char *argv[] = {"/proc/self/exe", "--rank-child", g_daemon.target, (char *)job, rank,
                    (char *)case_name, NULL};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, up[1], CHILD_UP_FD);
    posix_spawn_file_actions_adddup2(&fa, down[0], CHILD_DOWN_FD);
    assert_int_equal(posix_spawn(&pids[r], "/proc/self/exe", &fa, NULL, argv, environ), 0);
    posix_spawn_file_actions_destroy(&fa);
  }
  close(up[1]);
  close(down[0]);

  int exited[WORLD] = {0}, wstatus[WORLD] = {0};
  size_t arrived = 0;
  bool early_exit = false;
  int64_t deadline = now_ms() + RANKS_TIMEOUT_MS;
  while (arrived < WORLD && !early_exit && now_ms() < deadline) {
    struct pollfd p = {.fd = up[0], .events = POLLIN};
    char c;
    if (poll(&p, 1, 50) == 1 && read(up[0], &c, 1) == 1) {
      arrived++;
      continue;
    }
    for (unsigned r = 0; r < WORLD; r++)
      if (!exited[r] && waitpid(pids[r], &wstatus[r], WNOHANG) == pids[r])
        exited[r] = early_exit = true;
  }
  if (arrived == WORLD) {
    char go[WORLD];
    memset(go, 'g', sizeof go);
    assert_int_equal(write(down[1], go, sizeof go), (ssize_t)sizeof go);
  }
  close(up[0]);
  close(down[1]);

  int ok = 0;
  for (unsigned r = 0; r < WORLD; r++) {
    while (!exited[r] && !early_exit && now_ms() < deadline) {
      if (waitpid(pids[r], &wstatus[r], WNOHANG) == pids[r])
        exited[r] = true;
      else
        poll(NULL, 0, 10);
    }
    if (!exited[r])
      wstatus[r] = stop_process(pids[r], SIGKILL, 1000);
    if (WIFEXITED(wstatus[r]) && WEXITSTATUS(wstatus[r]) == 0)
      ok++;
    else
      fprintf(stderr, "rank %u (%s) ended with wait status %#x\n", r, case_name, wstatus[r]);
  }
  return ok;
}

static void test_two_ranks_fp32(void **state) {
  (void)state;
  assert_int_equal(run_ranks("two-fp32", "fp32"), WORLD);
}

static void test_two_ranks_bf16(void **state) {
  (void)state;
  assert_int_equal(run_ranks("two-bf16", "bf16"), WORLD);
}

/* ---- errors, in this process ------------------------------------------------------------ */

static fsdp_client_t *connect_daemon(void) {
  fsdp_client_t *client = NULL;
  assert_int_equal(fsdp_client_connect(g_daemon.target, NULL, &client), 0);
  return client;
}

static fsdp_trainer_t *attach(fsdp_client_t *client, const char *job, unsigned rank,
                              unsigned world) {
  fsdp_trainer_options_t opts = {.job = job, .local_rank = rank, .local_world_size = world};
  fsdp_trainer_t *t = NULL;
  int r = fsdp_trainer_attach(client, &opts, &t);
  if (r != 0)
    fail_msg("attach %s rank %u: %d: %s", job, rank, r, fsdp_client_last_error(client));
  return t;
}

static void test_attach_errors(void **state) {
  (void)state;
  fsdp_client_t *client = connect_daemon();
  fsdp_trainer_t *t = NULL;
  fsdp_trainer_options_t opts = {.job = "j", .local_rank = 0, .local_world_size = 1};
  assert_int_equal(fsdp_trainer_attach(NULL, &opts, &t), -EINVAL);
  assert_int_equal(fsdp_trainer_attach(client, NULL, &t), -EINVAL);
  assert_int_equal(fsdp_trainer_attach(client, &opts, NULL), -EINVAL);
  opts.job = NULL;
  assert_int_equal(fsdp_trainer_attach(client, &opts, &t), -EINVAL);
  opts.job = "";
  assert_int_equal(fsdp_trainer_attach(client, &opts, &t), -EINVAL);
  assert_non_null(strstr(fsdp_client_last_error(client), "job is empty"));
  opts = (fsdp_trainer_options_t){.job = "j", .local_rank = 2, .local_world_size = 2};
  assert_int_equal(fsdp_trainer_attach(client, &opts, &t), -EINVAL);
  assert_non_null(strstr(fsdp_client_last_error(client), "local_rank 2 is outside [0, 2)"));
  opts.local_world_size = 0;
  opts.local_rank = 0;
  assert_int_equal(fsdp_trainer_attach(client, &opts, &t), -EINVAL);
  assert_null(t);

  /* The daemon judges the job's name and says why. */
  opts = (fsdp_trainer_options_t){.job = "no spaces!", .local_rank = 0, .local_world_size = 1};
  assert_int_equal(fsdp_trainer_attach(client, &opts, &t), FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(fsdp_client_last_error(client),
                         "field 'job' = 'no spaces!' must be 1 to 64 of [A-Za-z0-9._-]"));
  assert_null(t);

  assert_int_equal(fsdp_trainer_detach(NULL), 0);
  assert_int_equal(fsdp_trainer_session_id(NULL), 0);
  assert_null(fsdp_trainer_memory(NULL, NULL));
  assert_null(fsdp_unit_view(NULL));
  assert_int_equal(fsdp_trainer_keepalive(NULL), -EINVAL);
  fsdp_client_close(client);
}

static void test_same_rank_twice_in_one_process(void **state) {
  (void)state;
  fsdp_client_t *client = connect_daemon();
  fsdp_trainer_t *t = attach(client, "twice", 0, 1);
  fsdp_trainer_options_t opts = {.job = "twice", .local_rank = 0, .local_world_size = 1};
  fsdp_trainer_t *t2 = NULL;
  /* The first trainer has its memory channel open, so the second is refused at Attach, and
   * must not end the first one's session on its way out. */
  assert_int_equal(fsdp_trainer_attach(client, &opts, &t2), FSDP_E_ALREADY_EXISTS);
  assert_non_null(
      strstr(fsdp_client_last_error(client), "job 'twice' local rank 0 is already attached"));
  assert_null(t2);
  assert_int_equal(fsdp_trainer_keepalive(t), 0);
  assert_int_equal(fsdp_trainer_detach(t), 0);
  /* Detached: a new trainer for the same rank attaches. */
  t = attach(client, "twice", 0, 1);
  assert_int_equal(fsdp_trainer_detach(t), 0);
  fsdp_client_close(client);
}

static void test_unit_errors(void **state) {
  (void)state;
  fsdp_client_t *client = connect_daemon();
  fsdp_trainer_t *t = attach(client, "solo", 0, 1);
  assert_int_not_equal(fsdp_trainer_session_id(t), 0);
  size_t size = 0;
  assert_non_null(fsdp_trainer_memory(t, &size));
  assert_int_equal(size, JOB_LIMIT_BYTES);
  assert_int_equal(fsdp_trainer_keepalive(t), 0);

  uint64_t shape[] = {8, 4};
  fsdp_param_desc_t param = {"w", shape, 2, true};
  fsdp_unit_desc_t desc = {.name = "u", .params = &param, .n_params = 1,
                           .strategy = FSDP_FULL_SHARD};
  fsdp_unit_handle_t *u = NULL;
  assert_int_equal(fsdp_trainer_register_unit(NULL, &desc, &u), -EINVAL);
  assert_int_equal(fsdp_trainer_register_unit(t, NULL, &u), -EINVAL);
  assert_int_equal(fsdp_trainer_register_unit(t, &desc, NULL), -EINVAL);
  fsdp_unit_desc_t bad = desc;
  bad.name = "";
  assert_int_equal(fsdp_trainer_register_unit(t, &bad, &u), -EINVAL);
  bad = desc;
  bad.n_params = 0;
  assert_int_equal(fsdp_trainer_register_unit(t, &bad, &u), -EINVAL);
  bad.n_params = 65537; /* refused before params is read */
  assert_int_equal(fsdp_trainer_register_unit(t, &bad, &u), -EINVAL);
  assert_non_null(strstr(fsdp_client_last_error(client), "65537 parameters, expected 1 to 65536"));
  bad = desc;
  bad.strategy = (fsdp_strategy_t)0;
  assert_int_equal(fsdp_trainer_register_unit(t, &bad, &u), -EINVAL);
  bad = desc;
  bad.param_type = (fsdp_scalar_t)7;
  assert_int_equal(fsdp_trainer_register_unit(t, &bad, &u), -EINVAL);
  fsdp_param_desc_t bad_param = {"w", NULL, 2, true};
  bad = desc;
  bad.params = &bad_param;
  assert_int_equal(fsdp_trainer_register_unit(t, &bad, &u), -EINVAL);
  bad_param = (fsdp_param_desc_t){"w", shape, 65, true};
  assert_int_equal(fsdp_trainer_register_unit(t, &bad, &u), -EINVAL);
  assert_null(u);

  /* The daemon's own refusals carry its message. */
  bad = desc;
  bad.gradient_predivide_factor = -1;
  assert_int_equal(fsdp_trainer_register_unit(t, &bad, &u), FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(fsdp_client_last_error(client), "gradient_predivide_factor = -1"));
  uint64_t huge[] = {4096, 4096};
  fsdp_param_desc_t huge_param = {"h", huge, 2, true};
  bad = desc;
  bad.name = "huge";
  bad.params = &huge_param;
  assert_int_equal(fsdp_trainer_register_unit(t, &bad, &u), FSDP_E_RESOURCE_EXHAUSTED);
  assert_non_null(strstr(fsdp_client_last_error(client), "of the 64.0 MiB limit"));
  assert_null(u);

  assert_int_equal(fsdp_trainer_register_unit(t, &desc, &u), 0);
  assert_string_equal(fsdp_client_last_error(client), "");
  /* Another spec under the same name is refused, and the handle stays as it was. */
  shape[1] = 5;
  fsdp_unit_handle_t *other = NULL;
  assert_int_equal(fsdp_trainer_register_unit(t, &desc, &other), FSDP_E_FAILED_PRECONDITION);
  assert_null(other);
  shape[1] = 4;
  assert_int_equal(fsdp_unit_view(u)->numel, 32);

  /* Unit operations: arguments, and one started operation per unit. */
  assert_int_equal(fsdp_trainer_unshard(NULL, u, 1, FSDP_PASS_FORWARD), -EINVAL);
  assert_int_equal(fsdp_trainer_unshard(t, NULL, 1, FSDP_PASS_FORWARD), -EINVAL);
  assert_int_equal(fsdp_trainer_reshard(t, NULL, 1), -EINVAL);
  assert_int_equal(fsdp_trainer_reduce_scatter(t, NULL, 1, false), -EINVAL);
  assert_int_equal(fsdp_trainer_unshard_start(t, NULL, 1, FSDP_PASS_FORWARD), -EINVAL);
  assert_int_equal(fsdp_trainer_wait(t, u, 0), -EINVAL);
  assert_non_null(strstr(fsdp_client_last_error(client), "no started operation"));
  assert_int_equal(fsdp_trainer_unshard_start(t, u, 1, FSDP_PASS_FORWARD), 0);
  assert_int_equal(fsdp_trainer_unshard_start(t, u, 1, FSDP_PASS_FORWARD), -EBUSY);
  assert_int_equal(fsdp_trainer_reshard(t, u, 1), -EBUSY);
  assert_int_equal(fsdp_trainer_unshard(t, u, 1, FSDP_PASS_FORWARD), -EBUSY);
  assert_int_equal(fsdp_trainer_keepalive(t), 0); /* other calls go on meanwhile */
  assert_int_equal(fsdp_trainer_wait(t, u, 2000), 0);
  assert_int_equal(fsdp_trainer_wait(t, u, 0), -EINVAL);
  assert_int_equal(fsdp_trainer_reshard(t, u, 1), 0);

  /* A handle of another trainer is not this one's. */
  fsdp_trainer_t *t2 = attach(client, "solo2", 0, 1);
  assert_int_equal(fsdp_trainer_unshard(t2, u, 1, FSDP_PASS_FORWARD), -EINVAL);
  assert_non_null(strstr(fsdp_client_last_error(client), "belongs to another trainer"));
  assert_int_equal(fsdp_trainer_detach(t2), 0);

  /* Detaching with a started operation in flight ends it first. */
  assert_int_equal(fsdp_trainer_unshard_start(t, u, 2, FSDP_PASS_FORWARD), 0);
  assert_int_equal(fsdp_trainer_detach(t), 0);
  fsdp_client_close(client);
}

/* A started call's wait is bounded: an Unshard that waits for a rank that never comes is
 * cancelled when the wait runs out, and the client goes on. */
static void test_started_call_wait_runs_out(void **state) {
  (void)state;
  fsdp_client_t *client = connect_daemon();
  fsdp_trainer_t *t = attach(client, "pair", 0, 2);
  uint64_t shape[] = {6};
  fsdp_param_desc_t param = {"w", shape, 1, true};
  fsdp_unit_desc_t desc = {.name = "u", .params = &param, .n_params = 1,
                           .strategy = FSDP_FULL_SHARD};
  fsdp_unit_handle_t *u = NULL;
  assert_int_equal(fsdp_trainer_register_unit(t, &desc, &u), 0);

  Fsdp__V1__UnitOpRequest rq = FSDP__V1__UNIT_OP_REQUEST__INIT;
  rq.session_id = fsdp_trainer_session_id(t);
  rq.unit = "u";
  rq.step = 1;
  fsdp_client_started_t *started = NULL;
  assert_int_equal(fsdp_client_call_start(client, "/fsdp.v1.Trainer/Unshard", &rq.base, 0,
                                          &started),
                   0);
  ProtobufCMessage *reply = NULL;
  int64_t t0 = now_ms();
  assert_int_equal(fsdp_client_call_finish(client, started, &fsdp__v1__unit_op_reply__descriptor,
                                           200, &reply),
                   FSDP_E_DEADLINE_EXCEEDED);
  int64_t waited = now_ms() - t0;
  assert_true(waited >= 150 && waited < 2000);
  assert_non_null(strstr(fsdp_client_last_error(client), "within 200 ms"));
  assert_null(reply);

  /* And one cancelled outright. */
  started = NULL;
  assert_int_equal(fsdp_client_call_start(client, "/fsdp.v1.Trainer/Unshard", &rq.base, 0,
                                          &started),
                   0);
  fsdp_client_call_cancel(client, started);
  assert_int_equal(fsdp_trainer_keepalive(t), 0);
  assert_int_equal(fsdp_trainer_detach(t), 0);
  fsdp_client_close(client);
}

/* The daemon's optimizer through the C API: bad arguments, then SGD (lr 0.5) stepping a
 * one-rank unit on values where every operation is exact; the view shows its state. */
static void test_optimizer_in_the_daemon(void **state) {
  (void)state;
  fsdp_client_t *client = connect_daemon();
  fsdp_trainer_t *t = attach(client, "optim", 0, 1);
  uint64_t shape[] = {8};
  fsdp_param_desc_t param = {"w", shape, 1, true};
  fsdp_unit_desc_t desc = {.name = "u", .params = &param, .n_params = 1,
                           .strategy = FSDP_FULL_SHARD};
  fsdp_unit_handle_t *u = NULL;
  assert_int_equal(fsdp_trainer_register_unit(t, &desc, &u), 0);
  const fsdp_unit_view_t *v = fsdp_unit_view(u);
  assert_null(v->optimizer_steps);

  assert_int_equal(fsdp_trainer_set_optimizer(t, NULL), -EINVAL);
  const char *names[] = {"w"};
  fsdp_param_group_t group = {.params = names, .n_params = 1, .lr = -1};
  fsdp_optim_t optim = {.kind = FSDP_OPTIM_SGD, .groups = &group, .n_groups = 1};
  assert_int_equal(fsdp_trainer_set_optimizer(t, &optim), FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(fsdp_client_last_error(client), "groups[0].lr = -1 is outside"));
  assert_int_equal(fsdp_trainer_reduce_scatter(t, u, 1, 1u << 7), -EINVAL);
  assert_non_null(strstr(fsdp_client_last_error(client), "not FSDP_REDUCE_* flags (0x80)"));

  group.lr = 0.5;
  assert_int_equal(fsdp_trainer_set_optimizer(t, &optim), 0);
  assert_non_null(v->optimizer_steps);
  assert_int_equal(v->optimizer_arrays, 1); /* SGD's momentum buffer, unused without momentum */
  for (int i = 0; i < 8; i++)
    v->master[i] = (float)i;
  assert_int_equal(fsdp_trainer_unshard(t, u, 1, FSDP_PASS_BACKWARD), 0);
  for (int i = 0; i < 8; i++)
    ((float *)v->full_grad)[i] = (float)(2 * i);
  assert_int_equal(fsdp_trainer_reduce_scatter(t, u, 1, FSDP_REDUCE_STEP_OPTIMIZER), 0);
  for (int i = 0; i < 8; i++) /* i - 0.5 * 2i, as torch.optim.SGD computes it */
    assert_true(v->master[i] == 0.0f);
  assert_int_equal(*v->optimizer_steps, 1);
  assert_int_equal(fsdp_trainer_detach(t), 0);
  fsdp_client_close(client);
}

/* ---- the fast path's doorbells, from threads of this process ----------------------------- */

/* An answer takes microseconds, rung or polled; a request or reply that nobody woke for is
 * found when the wait's deadline (the client's default, 5 s) runs out, if at all. */
#define WAKE_SLOW_MS 1000
#define WAKE_ROUNDS 1000

/* Pauses between calls: dense about the end of the daemon's polling window (50 us after its
 * reply), where a request may come while the daemon stops polling, and beyond it. */
static const unsigned PAUSES_US[] = {0,  10, 30, 40, 44, 46, 48, 49, 50, 51,
                                     52, 54, 56, 60, 70, 100, 300, 1000};
#define N_PAUSES (sizeof PAUSES_US / sizeof PAUSES_US[0])

static const unsigned NO_PAUSE_US[] = {0};
static const unsigned LAG_US[] = {1000};

typedef struct wake_worker {
  const char *job;
  unsigned rank, world;
  unsigned rounds;
  const unsigned *pauses; /* before each call, in turn from pause_from */
  size_t n_pauses, pause_from;
  pthread_t thread;
  char error[640]; /* empty while every call succeeds */
} wake_worker_t;

/* Short pauses spin, since sleeping rounds them up to the kernel's timer slack. */
static void pause_for(unsigned us) {
  if (us >= 300) {
    nanosleep(&(struct timespec){.tv_nsec = (long)us * 1000}, NULL);
    return;
  }
  uint64_t until = fsdp_clock_now_ns() + us * 1000ull;
  while (fsdp_clock_now_ns() < until)
    ;
}

/* Unshards and reshards one unit round after round, step after step. */
static void *wake_worker_run(void *arg) {
  wake_worker_t *w = arg;
  fsdp_client_t *client = NULL;
  fsdp_trainer_t *t = NULL;
  if (fsdp_client_connect(g_daemon.target, NULL, &client) < 0) {
    snprintf(w->error, sizeof w->error, "%s rank %u: connect", w->job, w->rank);
    return NULL;
  }
  fsdp_trainer_options_t opts = {.job = w->job, .local_rank = w->rank,
                                 .local_world_size = w->world};
  uint64_t shape[] = {64};
  fsdp_param_desc_t param = {"w", shape, 1, true};
  fsdp_unit_desc_t desc = {.name = "u", .params = &param, .n_params = 1,
                           .strategy = FSDP_FULL_SHARD};
  fsdp_unit_handle_t *u = NULL;
  if (fsdp_trainer_attach(client, &opts, &t) < 0 ||
      fsdp_trainer_register_unit(t, &desc, &u) < 0) {
    snprintf(w->error, sizeof w->error, "%s rank %u: %s", w->job, w->rank,
             fsdp_client_last_error(client));
    goto out;
  }
  for (unsigned round = 0; round < w->rounds; round++)
    for (unsigned call = 0; call < 2; call++) {
      pause_for(w->pauses[(w->pause_from + 2 * round + call) % w->n_pauses]);
      int64_t t0 = now_ms();
      int r = call == 0 ? fsdp_trainer_unshard(t, u, round + 1, FSDP_PASS_FORWARD)
                        : fsdp_trainer_reshard(t, u, round + 1);
      int64_t took_ms = now_ms() - t0;
      if (r < 0 || took_ms >= WAKE_SLOW_MS) {
        snprintf(w->error, sizeof w->error, "%s rank %u, step %u: %s = %d after %lld ms: %s",
                 w->job, w->rank, round + 1, call == 0 ? "Unshard" : "Reshard", r,
                 (long long)took_ms, fsdp_client_last_error(client));
        goto out;
      }
    }
out:
  fsdp_trainer_detach(t);
  fsdp_client_close(client);
  return NULL;
}

static void run_wake_workers(wake_worker_t *w, size_t n) {
  for (size_t i = 0; i < n; i++)
    assert_int_equal(pthread_create(&w[i].thread, NULL, wake_worker_run, &w[i]), 0);
  for (size_t i = 0; i < n; i++)
    assert_int_equal(pthread_join(w[i].thread, NULL), 0);
  for (size_t i = 0; i < n; i++)
    if (w[i].error[0])
      fail_msg("%s", w[i].error);
}

/* Two sessions send short calls, each at pauses that fall before, around and after the
 * daemon's polling window: each request pushed while the daemon stops polling is either
 * seen by its last look or rung. */
static void test_fast_path_requests_wake_daemon(void **state) {
  (void)state;
  wake_worker_t w[2] = {
      {.job = "wake-a", .world = 1, .rounds = WAKE_ROUNDS, .pauses = PAUSES_US,
       .n_pauses = N_PAUSES},
      {.job = "wake-b", .world = 1, .rounds = WAKE_ROUNDS, .pauses = PAUSES_US,
       .n_pauses = N_PAUSES, .pause_from = 3},
  };
  run_wake_workers(w, 2);
}

/* Rank 0's Unshard waits a millisecond for rank 1's, long past its spin: the daemon must
 * ring it once the reply is there, and be rung for rank 1's request, its own window over.
 * Rank 0's Reshard follows its wake-up, which takes about as long as that window. */
static void test_fast_path_replies_wake_trainer(void **state) {
  (void)state;
  wake_worker_t w[2] = {
      {.job = "wake-pair", .rank = 0, .world = 2, .rounds = 200, .pauses = NO_PAUSE_US,
       .n_pauses = 1},
      {.job = "wake-pair", .rank = 1, .world = 2, .rounds = 200, .pauses = LAG_US,
       .n_pauses = 1},
  };
  run_wake_workers(w, 2);
}

int main(int argc, char **argv) {
  if (argc == 6 && strcmp(argv[1], "--rank-child") == 0)
    return rank_child(argv[2], argv[3], (unsigned)atoi(argv[4]), argv[5]);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_attach_errors),
      cmocka_unit_test(test_two_ranks_fp32),
      cmocka_unit_test(test_two_ranks_bf16),
      cmocka_unit_test(test_same_rank_twice_in_one_process),
      cmocka_unit_test(test_unit_errors),
      cmocka_unit_test(test_started_call_wait_runs_out),
      cmocka_unit_test(test_optimizer_in_the_daemon),
      cmocka_unit_test(test_fast_path_requests_wake_daemon),
      cmocka_unit_test(test_fast_path_replies_wake_trainer),
  };
  return cmocka_run_group_tests(tests, start_daemon, stop_daemon);
}
