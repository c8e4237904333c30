/* fsdp-optim-bench: the daemon's AdamW step (kernels/optim.h) against the memory system, in
 * one run. For each shard size (MiB of fp32 parameters) it times, with 1 thread and with
 * every CPU's worker, a pass of the same traffic as AdamW's (read parameters, gradients and
 * both moments, write parameters and both moments: 16 bytes read and 12 written per
 * element) doing one addition per array, the traffic bound; then the AdamW step itself.
 * Prints the median of the runs in ms, the step's traffic in GB/s, and time / bound.
 * bench/optim_torch.py times torch.optim.AdamW on tensors of the same sizes; `make
 * bench-optim` runs both. Buffers are written before any timing, so no run faults a page.
 *
 *   fsdp-optim-bench [--sizes 1,16,256] [--runs 7] [--json] */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "kernels/optim.h"
#include "kernels/workers.h"

#define MAX_SIZES 8
#define MAX_RUNS 101
#define BYTES_PER_ELEMENT 28.0 /* AdamW: 16 read, 12 written */

typedef struct shard {
  float *p, *g, *m, *v;
  size_t n;
} shard_t;

/* The traffic bound's pass: AdamW's reads and writes, one addition each. */
static void traffic_range(void *arg, size_t begin, size_t end) {
  shard_t *s = arg;
  float *restrict p = s->p, *restrict m = s->m, *restrict v = s->v;
  const float *restrict g = s->g;
  for (size_t i = begin; i < end; i++) {
    p[i] = p[i] + g[i];
    m[i] = m[i] + g[i];
    v[i] = v[i] + g[i];
  }
}

static const fsdp_optim_hyper_t ADAMW = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999,
                                         .eps = 1e-8, .weight_decay = 1e-2};
static uint64_t g_step;

static void adamw_range(void *arg, size_t begin, size_t end) {
  shard_t *s = arg;
  float *state[3] = {s->m + begin, s->v + begin, NULL};
  fsdp_optim_step(FSDP_OPTIM_RULE_ADAMW, &ADAMW, g_step, false, 1.0f, s->p + begin,
                  s->g + begin, state, end - begin);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median over runs of one pass of fn over the shard, in ms. */
static double time_ms(fsdp_workers_t *pool, shard_t *s, void (*fn)(void *, size_t, size_t),
                      unsigned runs) {
  double t[MAX_RUNS];
  for (unsigned r = 0; r < runs; r++) {
    g_step = r + 1;
    uint64_t t0 = fsdp_clock_now_ns();
    fsdp_workers_for(pool, s->n, 16384, fn, s);
    t[r] = (double)(fsdp_clock_now_ns() - t0) / 1e6;
  }
  qsort(t, runs, sizeof *t, cmp_double);
  return t[runs / 2];
}

int main(int argc, char **argv) {
  unsigned sizes[MAX_SIZES] = {1, 16, 256}, n_sizes = 3, runs = 7;
  bool json = false;
  static const struct option opts[] = {{"sizes", required_argument, NULL, 's'},
                                       {"runs", required_argument, NULL, 'r'},
                                       {"json", no_argument, NULL, 'j'},
                                       {NULL, 0, NULL, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    if (c == 's') {
      n_sizes = 0;
      for (char *tok = strtok(optarg, ","); tok && n_sizes < MAX_SIZES; tok = strtok(NULL, ","))
        sizes[n_sizes++] = (unsigned)atoi(tok);
    } else if (c == 'r') {
      runs = (unsigned)atoi(optarg);
    } else if (c == 'j') {
      json = true;
    } else {
      fprintf(stderr, "usage: fsdp-optim-bench [--sizes 1,16,256] [--runs 7] [--json]\n");
      return 2;
    }
  }
  if (runs < 1 || runs > MAX_RUNS || n_sizes == 0) {
    fprintf(stderr, "fsdp-optim-bench: --runs in [1, %d] and at least one size\n", MAX_RUNS);
    return 2;
  }
  unsigned cpus = (unsigned)sysconf(_SC_NPROCESSORS_ONLN);
  fsdp_workers_t *pools[2] = {NULL, NULL}; /* NULL: the caller's thread alone */
  if (cpus > 1 && fsdp_workers_new(cpus - 1, &pools[1]) < 0) {
    fprintf(stderr, "fsdp-optim-bench: cannot start %u worker threads\n", cpus - 1);
    return 1;
  }
  if (!json)
    printf("%8s %8s %12s %12s %10s %12s\n", "MiB", "threads", "bound ms", "AdamW ms", "GB/s",
           "AdamW/bound");
  else
    printf("{\"runs\": %u, \"results\": [", runs);
  for (unsigned k = 0; k < n_sizes; k++) {
    shard_t s = {.n = (size_t)sizes[k] << 18}; /* MiB of fp32 */
    float **arrays[4] = {&s.p, &s.g, &s.m, &s.v};
    for (size_t a = 0; a < 4; a++) {
      if (!(*arrays[a] = aligned_alloc(64, s.n * sizeof(float)))) {
        fprintf(stderr, "fsdp-optim-bench: out of memory for %u MiB\n", sizes[k]);
        return 1;
      }
      for (size_t i = 0; i < s.n; i++)
        (*arrays[a])[i] = a == 3 ? 1e-4f : 0.01f * (float)(i % 97);
    }
    for (size_t t = 0; t < 2; t++) {
      if (t == 1 && !pools[1])
        continue;
      double bound = time_ms(pools[t], &s, traffic_range, runs);
      double step = time_ms(pools[t], &s, adamw_range, runs);
      double gbs = BYTES_PER_ELEMENT * (double)s.n / (step * 1e6);
      unsigned threads = t ? cpus : 1;
      if (json)
        printf("%s{\"mib\": %u, \"threads\": %u, \"bound_ms\": %.3f, \"adamw_ms\": %.3f, "
               "\"gb_per_s\": %.2f, \"adamw_vs_bound\": %.2f}",
               k || t ? ", " : "", sizes[k], threads, bound, step, gbs, step / bound);
      else
        printf("%8u %8u %12.3f %12.3f %10.2f %11.2fx\n", sizes[k], threads, bound, step, gbs,
               step / bound);
    }
    for (size_t a = 0; a < 4; a++)
      free(*arrays[a]);
  }
  if (json)
    printf("]}\n");
  fsdp_workers_free(pools[1]);
  return 0;
}
