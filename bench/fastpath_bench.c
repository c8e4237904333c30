/* fsdp-fastpath-bench: a trainer's unit operation round trip through the fast path (shared
 * rings and eventfd doorbells) against the same operation over gRPC, in one run against one
 * fsdpd.
 *
 *   fsdp-fastpath-bench [--iterations N] [--runs R] [--json]
 *
 * One trainer per path (two jobs of one local rank, so neither waits for another rank)
 * registers one fp32 unit of 4096 parameters and repeats Unshard of step 1 and Reshard, each
 * timed alone: with fp32 parameters on one host the masters are the copy, so the daemon
 * does no work and the time is the round trip plus the library's mapping of the lent
 * buffer (Unshard) or its unmapping (Reshard), the same on both paths. The paths take turns
 * within each run, BLOCK rounds at a time (ABAB...), so that drift in the machine's speed
 * falls on both. A trainer's operations come in bursts (a unit's Reshard, the next one's
 * Unshard) between computations: the rounds of a block are the burst, whose fast path
 * requests find the daemon still polling, and each block's first Unshard comes after the
 * other path's block, a pause that outlasts the daemon's polling window, as after a
 * computation: it pays the daemon's wake-up, and is reported on its own ("cold"). Prints,
 * per operation, the median over the runs of each run's p50 and p99 in microseconds, and the
 * ratio gRPC / fast path of the p50s. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/fsdp_client.h>
#include <fsdp/fsdp_trainer.h>

#include "bench/bench_daemon.h"
#include "common/clock.h"

#define NUMEL 4096
#define MAX_RUNS 15
#define BLOCK 20

typedef struct path {
  const char *name; /* "fast", "grpc" */
  fsdp_client_t *client;
  fsdp_trainer_t *trainer;
  fsdp_unit_handle_t *unit;
  double *unshard_us, *reshard_us; /* this run's samples: a block's first Unshard in cold_us */
  double *cold_us;
  size_t n_unshard, n_reshard, n_cold;
  double unshard_p50[MAX_RUNS], unshard_p99[MAX_RUNS];
  double reshard_p50[MAX_RUNS], reshard_p99[MAX_RUNS];
  double cold_p50[MAX_RUNS];
} path_t;

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double quantile(double *v, size_t n, double q) {
  qsort(v, n, sizeof *v, cmp_double);
  return v[(size_t)(q * (double)(n - 1))];
}

/* Attaches a trainer for job with the fast path on or off (FSDP_FAST_PATH, read at attach). */
static int open_path(path_t *p, const char *target, const char *job, bool fast, char *err,
                     size_t err_size) {
  if (fast)
    unsetenv("FSDP_FAST_PATH");
  else
    setenv("FSDP_FAST_PATH", "off", 1);
  int r = fsdp_client_connect(target, NULL, &p->client);
  if (r < 0)
    return bench_set_error(err, err_size, "connect: %s", fsdp_strerror(r));
  fsdp_trainer_options_t opts = {.job = job, .local_rank = 0, .local_world_size = 1};
  if ((r = fsdp_trainer_attach(p->client, &opts, &p->trainer)) < 0)
    return bench_set_error(err, err_size, "attach %s: %s", job, fsdp_client_last_error(p->client));
  uint64_t shape[] = {NUMEL};
  fsdp_param_desc_t param = {.name = "w", .shape = shape, .ndim = 1, .requires_grad = true};
  fsdp_unit_desc_t desc = {.name = "u", .params = &param, .n_params = 1,
                           .strategy = FSDP_FULL_SHARD, .param_type = FSDP_SCALAR_FP32,
                           .reduce_type = FSDP_SCALAR_FP32};
  if ((r = fsdp_trainer_register_unit(p->trainer, &desc, &p->unit)) < 0)
    return bench_set_error(err, err_size, "register: %s", fsdp_client_last_error(p->client));
  return 0;
}

/* One Unshard and one Reshard, timed; cold: the Unshard is a block's first. */
static int one_round(path_t *p, bool cold, char *err, size_t err_size) {
  uint64_t t0 = fsdp_clock_now_ns();
  int r = fsdp_trainer_unshard(p->trainer, p->unit, 1, FSDP_PASS_FORWARD);
  uint64_t t1 = fsdp_clock_now_ns();
  if (r == 0)
    r = fsdp_trainer_reshard(p->trainer, p->unit, 1);
  uint64_t t2 = fsdp_clock_now_ns();
  if (r < 0)
    return bench_set_error(err, err_size, "%s path: %s", p->name,
                           fsdp_client_last_error(p->client));
  if (cold)
    p->cold_us[p->n_cold++] = (double)(t1 - t0) / 1e3;
  else
    p->unshard_us[p->n_unshard++] = (double)(t1 - t0) / 1e3;
  p->reshard_us[p->n_reshard++] = (double)(t2 - t1) / 1e3;
  return 0;
}

static double median_of(double *v, size_t n) {
  return quantile(v, n, 0.5);
}

int main(int argc, char **argv) {
  size_t iterations = 2000, runs = 5;
  bool json = false;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--iterations") == 0 && i + 1 < argc)
      iterations = strtoul(argv[++i], NULL, 10);
    else if (strcmp(argv[i], "--runs") == 0 && i + 1 < argc)
      runs = strtoul(argv[++i], NULL, 10);
    else if (strcmp(argv[i], "--json") == 0)
      json = true;
    else {
      fprintf(stderr, "usage: fsdp-fastpath-bench [--iterations N] [--runs R] [--json]\n");
      return 2;
    }
  }
  if (iterations < 10 * BLOCK || runs < 1 || runs > MAX_RUNS) {
    fprintf(stderr, "fsdp-fastpath-bench: --iterations >= %d, --runs in [1, %d]\n",
            10 * BLOCK, MAX_RUNS);
    return 2;
  }
  char err[512];
  bench_daemon_t d;
  if (bench_daemon_spawn(&d, "fsdp-fastpath-bench", NULL, err, sizeof err) < 0) {
    fprintf(stderr, "fsdp-fastpath-bench: %s\n", err);
    return 1;
  }
  char target[160];
  snprintf(target, sizeof target, "unix:%s", d.socket_path);
  path_t paths[2] = {{.name = "fast"}, {.name = "grpc"}};
  int rc = 1;
  for (size_t k = 0; k < 2; k++) {
    paths[k].unshard_us = calloc(iterations, sizeof(double));
    paths[k].reshard_us = calloc(iterations, sizeof(double));
    paths[k].cold_us = calloc(iterations / BLOCK + 1, sizeof(double));
  }
  if (open_path(&paths[0], target, "fast", true, err, sizeof err) < 0 ||
      bench_daemon_wait_serving(&d, paths[0].client, d.ready_deadline, err, sizeof err) < 0 ||
      open_path(&paths[1], target, "grpc", false, err, sizeof err) < 0)
    goto out;
  for (size_t run = 0; run < runs && !bench_interrupted; run++) {
    for (size_t k = 0; k < 2; k++)
      paths[k].n_unshard = paths[k].n_reshard = paths[k].n_cold = 0;
    for (size_t i = 0; i < iterations; i += BLOCK)
      for (size_t k = 0; k < 2; k++)
        for (size_t j = i; j < i + BLOCK && j < iterations; j++)
          if (one_round(&paths[k], j == i, err, sizeof err) < 0)
            goto out;
    for (size_t k = 0; k < 2; k++) {
      path_t *p = &paths[k];
      p->unshard_p50[run] = quantile(p->unshard_us, p->n_unshard, 0.5);
      p->unshard_p99[run] = quantile(p->unshard_us, p->n_unshard, 0.99);
      p->reshard_p50[run] = quantile(p->reshard_us, p->n_reshard, 0.5);
      p->reshard_p99[run] = quantile(p->reshard_us, p->n_reshard, 0.99);
      p->cold_p50[run] = quantile(p->cold_us, p->n_cold, 0.5);
    }
  }
  double fig[2][5];
  for (size_t k = 0; k < 2; k++) {
    path_t *p = &paths[k];
    fig[k][0] = median_of(p->unshard_p50, runs);
    fig[k][1] = median_of(p->unshard_p99, runs);
    fig[k][2] = median_of(p->reshard_p50, runs);
    fig[k][3] = median_of(p->reshard_p99, runs);
    fig[k][4] = median_of(p->cold_p50, runs);
  }
  if (json) {
    printf("{\"iterations\": %zu, \"runs\": %zu", iterations, runs);
    for (size_t k = 0; k < 2; k++)
      printf(", \"%s\": {\"unshard_p50_us\": %.2f, \"unshard_p99_us\": %.2f, "
             "\"reshard_p50_us\": %.2f, \"reshard_p99_us\": %.2f, "
             "\"cold_unshard_p50_us\": %.2f}",
             paths[k].name, fig[k][0], fig[k][1], fig[k][2], fig[k][3], fig[k][4]);
    printf(", \"unshard_ratio\": %.1f, \"reshard_ratio\": %.1f, \"cold_unshard_ratio\": %.1f}\n",
           fig[1][0] / fig[0][0], fig[1][2] / fig[0][2], fig[1][4] / fig[0][4]);
  } else {
    printf("%zu x (Unshard + Reshard) per path per run, in blocks of %d, %zu runs; medians "
           "over runs\n",
           iterations, BLOCK, runs);
    printf("%-10s %12s %12s %12s %12s %16s\n", "path", "Unshard p50", "p99", "Reshard p50",
           "p99", "cold Unshard p50");
    for (size_t k = 0; k < 2; k++)
      printf("%-10s %10.1f us %9.1f us %10.1f us %9.1f us %13.1f us\n", paths[k].name,
             fig[k][0], fig[k][1], fig[k][2], fig[k][3], fig[k][4]);
    printf("gRPC / fast path, p50: Unshard %.1fx, Reshard %.1fx, cold Unshard %.1fx\n",
           fig[1][0] / fig[0][0], fig[1][2] / fig[0][2], fig[1][4] / fig[0][4]);
  }
  rc = 0;
out:
  if (rc)
    fprintf(stderr, "fsdp-fastpath-bench: %s\n", err);
  for (size_t k = 0; k < 2; k++) {
    fsdp_trainer_detach(paths[k].trainer);
    fsdp_client_close(paths[k].client);
    free(paths[k].unshard_us);
    free(paths[k].reshard_us);
    free(paths[k].cold_us);
  }
  char stop_err[512];
  if (bench_daemon_stop(&d, stop_err, sizeof stop_err) < 0) {
    fprintf(stderr, "fsdp-fastpath-bench: %s\n", stop_err);
    rc = 1;
  }
  return rc;
}
