/* fsdp-mpi-collectives: OpenMPI's all-gather and reduce-scatter on the sizes fsdp-ucx-bench
 * times for the ring, as the peer of that comparison. Run under mpirun (fsdp-ucx-bench does,
 * with the transport it compares against); every rank holds a buffer of --sizes MiB of fp32
 * split into one region per rank, exactly as the ring's members do:
 *   all-gather:      MPI_Allgather in place (rank i's region i in, every region out);
 *   reduce-scatter:  MPI_Reduce_scatter_block of the whole buffer into the rank's region.
 * Each iteration rewrites the input outside the clock (as the ring bench does), meets at a
 * barrier, times the call with MPI_Wtime, and checks the result, so a wrong answer cannot
 * pass for a fast one; the iteration's time is the slowest rank's. Rank 0 prints one line
 * per op and size:
 *   result OP BYTES ITERS MEDIAN_MS MIN_MS MAX_MS
 * and "error TEXT" lines for anything that went wrong (exit status 1). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_setaffinity; the project build defines it already */
#endif
#include <errno.h>
#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <mpi.h>

#define MAX_SIZES 16
#define MAX_ITERS 1000

typedef struct {
  size_t mib[MAX_SIZES];
  unsigned n_sizes;
  bool all_gather, reduce_scatter;
  unsigned iters, warmup;
  bool pin;
} options_t;

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Small integers, so that every sum is exact whatever the order of the additions; the
 * iteration is mixed in so that a stale buffer cannot pass the check. */
static float value(unsigned rank, size_t e, unsigned iter) {
  return (float)((e + rank * 3u + iter) & 15u);
}

static void usage(FILE *f) {
  fprintf(f, "usage: mpirun -np N fsdp-mpi-collectives [--sizes MIB,...] "
             "[--op all-gather|reduce-scatter|both] [--iters K] [--warmup W] [--pin]\n");
}

static int parse(int argc, char **argv, options_t *o) {
  *o = (options_t){.mib = {16, 64, 256}, .n_sizes = 3, .all_gather = true,
                   .reduce_scatter = true, .iters = 10, .warmup = 2};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "--pin") == 0) {
      o->pin = true;
      continue;
    }
    if (!v) {
      fprintf(stderr, "fsdp-mpi-collectives: %s needs a value\n", a);
      return -1;
    }
    i++;
    char *end;
    if (strcmp(a, "--sizes") == 0) {
      o->n_sizes = 0;
      const char *p = v;
      while (*p) {
        unsigned long long m = strtoull(p, &end, 10);
        if (end == p || m == 0 || m > 65536 || o->n_sizes == MAX_SIZES ||
            (*end != ',' && *end != '\0')) {
          fprintf(stderr, "fsdp-mpi-collectives: --sizes '%s', expected MiB,MiB,...\n", v);
          return -1;
        }
        o->mib[o->n_sizes++] = (size_t)m;
        p = *end ? end + 1 : end;
      }
    } else if (strcmp(a, "--op") == 0) {
      o->all_gather = strcmp(v, "all-gather") == 0 || strcmp(v, "both") == 0;
      o->reduce_scatter = strcmp(v, "reduce-scatter") == 0 || strcmp(v, "both") == 0;
      if (!o->all_gather && !o->reduce_scatter) {
        fprintf(stderr, "fsdp-mpi-collectives: --op '%s', expected all-gather, "
                        "reduce-scatter or both\n", v);
        return -1;
      }
    } else if (strcmp(a, "--iters") == 0 || strcmp(a, "--warmup") == 0) {
      unsigned long k = strtoul(v, &end, 10);
      bool iters = strcmp(a, "--iters") == 0;
      if (*end || end == v || k > MAX_ITERS || (iters && k == 0)) {
        fprintf(stderr, "fsdp-mpi-collectives: %s '%s', expected %u..%u\n", a, v,
                iters ? 1 : 0, MAX_ITERS);
        return -1;
      }
      *(iters ? &o->iters : &o->warmup) = (unsigned)k;
    } else {
      usage(stderr);
      return -1;
    }
  }
  return 0;
}

static float *map_faulted(size_t bytes) {
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                 -1, 0);
  if (p == MAP_FAILED)
    return NULL;
  memset(p, 0x3c, bytes); /* every page private and resident before the clock starts */
  return p;
}

/* One op at one size; returns 0, or -1 after rank 0 printed why. */
static int run_one(const options_t *o, bool gather, size_t mib, int rank, int n) {
  size_t total = mib << 20, region_elems = total / (size_t)n / 4, region = region_elems * 4;
  size_t bytes = region * (size_t)n;
  float *buf = map_faulted(bytes), *out = gather ? NULL : map_faulted(region);
  int ok = buf && (gather || out), all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_ok) {
    if (rank == 0)
      printf("error out of memory for %zu bytes on some rank\n", bytes);
    goto fail;
  }
  unsigned total_iters = o->warmup + o->iters;
  double times[MAX_ITERS + MAX_ITERS];
  for (unsigned it = 0; it < total_iters; it++) {
    if (gather) {
      for (size_t e = 0; e < region_elems; e++)
        buf[(size_t)rank * region_elems + e] = value((unsigned)rank, e, it);
    } else {
      for (size_t e = 0; e < region_elems * (size_t)n; e++)
        buf[e] = value((unsigned)rank, e, it);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    int rc = gather ? MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, (int)region_elems,
                                    MPI_FLOAT, MPI_COMM_WORLD)
                    : MPI_Reduce_scatter_block(buf, out, (int)region_elems, MPI_FLOAT, MPI_SUM,
                                               MPI_COMM_WORLD);
    double mine = (MPI_Wtime() - t0) * 1e3, slowest = 0;
    if (rc != MPI_SUCCESS) {
      if (rank == 0)
        printf("error %s of %zu bytes failed: MPI error %d\n",
               gather ? "MPI_Allgather" : "MPI_Reduce_scatter_block", bytes, rc);
      goto fail;
    }
    MPI_Reduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    times[it] = slowest;
    /* The check, outside the clock. */
    size_t first_bad = SIZE_MAX;
    if (gather) {
      for (size_t e = 0; e < region_elems * (size_t)n && first_bad == SIZE_MAX; e++)
        if (buf[e] != value((unsigned)(e / region_elems), e % region_elems, it))
          first_bad = e;
    } else {
      for (size_t e = 0; e < region_elems && first_bad == SIZE_MAX; e++) {
        size_t g = (size_t)rank * region_elems + e;
        float want = 0;
        for (int r = 0; r < n; r++)
          want += value((unsigned)r, g, it);
        if (out[e] != want)
          first_bad = e;
      }
    }
    unsigned long long fb = first_bad, min_bad = 0;
    MPI_Allreduce(&fb, &min_bad, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
    if (min_bad != (unsigned long long)SIZE_MAX) {
      if (rank == 0)
        printf("error %s of %zu bytes, iteration %u: wrong value at element %llu on some rank\n",
               gather ? "all-gather" : "reduce-scatter", bytes, it, min_bad);
      goto fail;
    }
  }
  if (rank == 0) {
    double *t = times + o->warmup;
    qsort(t, o->iters, sizeof *t, cmp_double);
    double med = o->iters % 2 ? t[o->iters / 2] : (t[o->iters / 2 - 1] + t[o->iters / 2]) / 2;
    printf("result %s %zu %u %.4f %.4f %.4f\n", gather ? "all-gather" : "reduce-scatter", bytes,
           o->iters, med, t[0], t[o->iters - 1]);
    fflush(stdout);
  }
  munmap(buf, bytes);
  if (out)
    munmap(out, region);
  return 0;
fail:
  fflush(stdout);
  if (buf)
    munmap(buf, bytes);
  if (out)
    munmap(out, region);
  return -1;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  options_t o;
  if (parse(argc, argv, &o) < 0) {
    MPI_Finalize();
    return 2;
  }
  if (o.pin) {
    /* The same placement as the ring's members: rank i on CPU i modulo the CPUs. */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET((int)(rank % (cpus > 0 ? cpus : 1)), &set);
    sched_setaffinity(0, sizeof set, &set);
  }
  int rc = 0;
  for (int k = 0; k < 2 && rc == 0; k++) {
    bool gather = k == 0;
    if (gather ? !o.all_gather : !o.reduce_scatter)
      continue;
    for (unsigned s = 0; s < o.n_sizes && rc == 0; s++)
      rc = run_one(&o, gather, o.mib[s], rank, n);
  }
  MPI_Finalize();
  return rc == 0 ? 0 : 1;
}
