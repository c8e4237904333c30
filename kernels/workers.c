/* The worker pool: one job at a time, published under a mutex with a generation number.
 * The caller opens a job, wakes the threads with one broadcast and starts claiming chunks
 * itself from an atomic counter; a thread that wakes joins the job if it is still open and
 * claims chunks too. When the counter runs out the caller closes the job, so a thread
 * that wakes only now stays out, and waits until the threads that did join have finished
 * their chunks. Every chunk is claimed exactly once and finished before its claimer leaves
 * the job, so "closed and no thread inside" means done; the release decrement on leaving
 * and the caller's acquire load make the threads' writes visible to the caller.
 *
 * Waking a sleeping thread costs tens of microseconds here (futex wake, and on a VM an idle
 * vCPU has to be woken by the host), more than a small chunk of work. So both sides poll
 * briefly before they sleep: a thread that leaves a job watches for the next one for
 * SPIN_NS, and the caller watches for the joined threads to leave for SPIN_NS. Back-to-back
 * calls, one per unit, then never sleep; a pool with nothing to do is asleep SPIN_NS after
 * its last call. */
#include "kernels/workers.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/clock.h"

/* Chunks per thread when splitting a range: more than one so that a thread that wakes late
 * or is descheduled leaves its share to the others, few enough that claiming is free. */
#define CHUNKS_PER_THREAD 4

/* How long a thread polls before it sleeps (see above). */
#define SPIN_NS 50000

/* Elements per grain in the wrappers: 16 Ki elements (32-64 KiB) take a few microseconds,
 * the order of a wake-up, and are a multiple of both FSDP_WORKERS_ALIGN_ITEMS and the
 * reduce kernel's block. */
#define KERNEL_GRAIN 16384
_Static_assert(KERNEL_GRAIN % FSDP_WORKERS_ALIGN_ITEMS == 0,
               "chunk boundaries of the kernel wrappers must fall on cache lines");

typedef void (*work_fn)(void *ctx, size_t begin, size_t end);

struct fsdp_workers {
  pthread_mutex_t lock;
  pthread_cond_t work_cv; /* threads wait for a new job or stop */
  pthread_cond_t done_cv; /* the caller waits for joined threads to leave a closed job */
  unsigned n_threads;     /* working on each call, the caller included */
  unsigned n_started;     /* threads actually created (n_threads - 1 once built) */
  atomic_bool busy;       /* a call is in progress */

  /* The current job, written by the caller under lock. generation, stop and joined are
   * atomic only so that the polling side can read them without the lock; every change is
   * made under it. */
  atomic_uint_fast64_t generation;
  atomic_bool stop;
  atomic_uint joined;  /* threads inside the current job */
  bool open;           /* threads may still join */
  bool caller_waiting; /* the caller sleeps on done_cv */
  work_fn fn;
  void *ctx;
  size_t n_items, chunk, n_chunks;
  atomic_size_t next; /* the next chunk to claim */

  pthread_t threads[];
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* Polls until done(pool, arg) or SPIN_NS have passed; returns done's last answer. */
static bool spin_until(bool (*done)(fsdp_workers_t *, uint64_t), fsdp_workers_t *pool,
                       uint64_t arg) {
  uint64_t deadline = 0;
  for (unsigned i = 0;; i++) {
    if (done(pool, arg))
      return true;
    cpu_relax();
    if (i % 64 == 63) {
      uint64_t t = fsdp_clock_now_ns();
      if (deadline == 0)
        deadline = t + SPIN_NS;
      else if (t >= deadline)
        return false;
    }
  }
}

static bool new_job_or_stop(fsdp_workers_t *pool, uint64_t seen) {
  return atomic_load_explicit(&pool->generation, memory_order_relaxed) != seen ||
         atomic_load_explicit(&pool->stop, memory_order_relaxed);
}

static bool all_left(fsdp_workers_t *pool, uint64_t unused) {
  (void)unused;
  return atomic_load_explicit(&pool->joined, memory_order_acquire) == 0;
}

/* Claims and runs chunks of the job until none is left. */
static void run_chunks(fsdp_workers_t *pool, work_fn fn, void *ctx, size_t n_items,
                       size_t chunk, size_t n_chunks) {
  for (;;) {
    size_t c = atomic_fetch_add_explicit(&pool->next, 1, memory_order_relaxed);
    if (c >= n_chunks)
      return;
    size_t begin = c * chunk;
    size_t end = n_items - begin > chunk ? begin + chunk : n_items;
    fn(ctx, begin, end);
  }
}

static void *worker_main(void *arg) {
  fsdp_workers_t *pool = arg;
  uint64_t seen = 0;
  pthread_mutex_lock(&pool->lock);
  for (;;) {
    while (!atomic_load_explicit(&pool->stop, memory_order_relaxed) &&
           !(pool->open && atomic_load_explicit(&pool->generation, memory_order_relaxed) != seen))
      pthread_cond_wait(&pool->work_cv, &pool->lock);
    if (atomic_load_explicit(&pool->stop, memory_order_relaxed))
      break;
    seen = atomic_load_explicit(&pool->generation, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool->joined, 1, memory_order_relaxed);
    work_fn fn = pool->fn;
    void *ctx = pool->ctx;
    size_t n_items = pool->n_items, chunk = pool->chunk, n_chunks = pool->n_chunks;
    pthread_mutex_unlock(&pool->lock);

    run_chunks(pool, fn, ctx, n_items, chunk, n_chunks);

    pthread_mutex_lock(&pool->lock);
    if (atomic_fetch_sub_explicit(&pool->joined, 1, memory_order_release) == 1 &&
        pool->caller_waiting)
      pthread_cond_signal(&pool->done_cv);
    pthread_mutex_unlock(&pool->lock);
    spin_until(new_job_or_stop, pool, seen);
    pthread_mutex_lock(&pool->lock);
  }
  pthread_mutex_unlock(&pool->lock);
  return NULL;
}

/* Tells the started threads to stop and joins them. */
static void stop_threads(fsdp_workers_t *pool) {
  pthread_mutex_lock(&pool->lock);
  atomic_store_explicit(&pool->stop, true, memory_order_relaxed);
  pthread_cond_broadcast(&pool->work_cv);
  pthread_mutex_unlock(&pool->lock);
  for (unsigned i = 0; i < pool->n_started; i++)
    pthread_join(pool->threads[i], NULL);
  pool->n_started = 0;
}

int fsdp_workers_new(unsigned n_threads, fsdp_workers_t **ret_pool) {
  if (n_threads < 1 || n_threads > FSDP_WORKERS_MAX || !ret_pool)
    return -EINVAL;
  int r;
  fsdp_workers_t *pool = calloc(1, sizeof *pool + (n_threads - 1) * sizeof(pthread_t));
  if (!pool)
    return -ENOMEM;
  pool->n_threads = n_threads;
  atomic_init(&pool->busy, false);
  atomic_init(&pool->generation, 0);
  atomic_init(&pool->stop, false);
  atomic_init(&pool->joined, 0);
  atomic_init(&pool->next, 0);
  if ((r = pthread_mutex_init(&pool->lock, NULL)) != 0)
    goto free_pool;
  if ((r = pthread_cond_init(&pool->work_cv, NULL)) != 0)
    goto destroy_lock;
  if ((r = pthread_cond_init(&pool->done_cv, NULL)) != 0)
    goto destroy_work_cv;

  /* The threads start with every signal blocked: signals are the daemon loop's business
   * (uv_signal), and a handler running on a worker would only delay a kernel. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  for (unsigned i = 0; i + 1 < n_threads; i++) {
    if ((r = pthread_create(&pool->threads[i], NULL, worker_main, pool)) != 0)
      break;
    char name[16];
    snprintf(name, sizeof name, "fsdp-worker-%u", i + 1);
    pthread_setname_np(pool->threads[i], name);
    pool->n_started++;
  }
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (r != 0)
    goto stop;

  *ret_pool = pool;
  return 0;

stop:
  stop_threads(pool);
  pthread_cond_destroy(&pool->done_cv);
destroy_work_cv:
  pthread_cond_destroy(&pool->work_cv);
destroy_lock:
  pthread_mutex_destroy(&pool->lock);
free_pool:
  free(pool);
  return -r;
}

void fsdp_workers_free(fsdp_workers_t *pool) {
  if (!pool)
    return;
  stop_threads(pool);
  pthread_cond_destroy(&pool->done_cv);
  pthread_cond_destroy(&pool->work_cv);
  pthread_mutex_destroy(&pool->lock);
  free(pool);
}

unsigned fsdp_workers_count(const fsdp_workers_t *pool) {
  return pool ? pool->n_threads : 1;
}

int fsdp_workers_for(fsdp_workers_t *pool, size_t n_items, size_t grain, work_fn fn, void *ctx) {
  if (n_items == 0)
    return 0;
  if (!fn)
    return -EINVAL;
  if (grain == 0)
    grain = 1;
  if (!pool) {
    fn(ctx, 0, n_items);
    return 0;
  }
  if (atomic_exchange_explicit(&pool->busy, true, memory_order_acquire))
    return -EBUSY;

  /* Chunks of whole grains, about CHUNKS_PER_THREAD per thread. */
  size_t grains = n_items / grain + (n_items % grain != 0);
  size_t want = (size_t)pool->n_threads * CHUNKS_PER_THREAD;
  size_t per = grains / want + (grains % want != 0);
  size_t chunk = per * grain;
  size_t n_chunks = n_items / chunk + (n_items % chunk != 0);

  if (n_chunks <= 1 || pool->n_started == 0) {
    fn(ctx, 0, n_items);
  } else {
    pthread_mutex_lock(&pool->lock);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_items = n_items;
    pool->chunk = chunk;
    pool->n_chunks = n_chunks;
    atomic_store_explicit(&pool->next, 0, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_relaxed);
    pool->open = true;
    pthread_cond_broadcast(&pool->work_cv);
    pthread_mutex_unlock(&pool->lock);

    run_chunks(pool, fn, ctx, n_items, chunk, n_chunks);

    pthread_mutex_lock(&pool->lock);
    pool->open = false;
    pthread_mutex_unlock(&pool->lock);
    if (!spin_until(all_left, pool, 0)) {
      pthread_mutex_lock(&pool->lock);
      pool->caller_waiting = true;
      while (atomic_load_explicit(&pool->joined, memory_order_acquire) > 0)
        pthread_cond_wait(&pool->done_cv, &pool->lock);
      pool->caller_waiting = false;
      pthread_mutex_unlock(&pool->lock);
    }
  }
  atomic_store_explicit(&pool->busy, false, memory_order_release);
  return 0;
}

/* ---- Kernel wrappers: the context of one call, and the per-chunk functions. ---- */

typedef struct {
  void *dst;
  fsdp_dtype_t dst_type;
  const void *src;
  fsdp_dtype_t src_type;
} cast_job_t;

static void cast_chunk(void *arg, size_t begin, size_t end) {
  const cast_job_t *job = arg;
  size_t ds = fsdp_dtype_size(job->dst_type), ss = fsdp_dtype_size(job->src_type);
  /* Arguments were checked before the split; a chunk cannot fail. */
  (void)fsdp_cast((char *)job->dst + begin * ds, job->dst_type,
                  (const char *)job->src + begin * ss, job->src_type, end - begin);
}

int fsdp_cast_parallel(fsdp_workers_t *pool, void *dst, fsdp_dtype_t dst_type, const void *src,
                       fsdp_dtype_t src_type, size_t n) {
  if (!fsdp_dtype_is_valid(dst_type) || !fsdp_dtype_is_valid(src_type))
    return -EINVAL;
  if (n == 0)
    return 0;
  if (!dst || !src)
    return -EINVAL;
  cast_job_t job = {dst, dst_type, src, src_type};
  return fsdp_workers_for(pool, n, KERNEL_GRAIN, cast_chunk, &job);
}

typedef struct {
  float *dst;
  bool accumulate;
  const void *const *srcs;
  unsigned n_srcs;
  fsdp_dtype_t src_type, reduce_type;
  float pre_scale, post_scale;
} reduce_job_t;

static void reduce_chunk(void *arg, size_t begin, size_t end) {
  const reduce_job_t *job = arg;
  (void)fsdp_reduce_range(job->dst, job->accumulate, job->srcs, job->n_srcs, job->src_type,
                          job->reduce_type, job->pre_scale, job->post_scale, begin, end);
}

int fsdp_reduce_parallel(fsdp_workers_t *pool, float *dst, bool accumulate,
                         const void *const *srcs, unsigned n_srcs, fsdp_dtype_t src_type,
                         fsdp_dtype_t reduce_type, float pre_scale, float post_scale, size_t n) {
  /* The checks of fsdp_reduce_range, made once here so that no chunk can fail. */
  if (!fsdp_dtype_is_valid(src_type) || !fsdp_dtype_is_valid(reduce_type) || n_srcs == 0 ||
      !isfinite(pre_scale) || !isfinite(post_scale))
    return -EINVAL;
  if (n == 0)
    return 0;
  if (!dst || !srcs)
    return -EINVAL;
  for (unsigned k = 0; k < n_srcs; k++)
    if (!srcs[k])
      return -EINVAL;
  reduce_job_t job = {dst, accumulate, srcs, n_srcs, src_type, reduce_type, pre_scale,
                      post_scale};
  return fsdp_workers_for(pool, n, KERNEL_GRAIN, reduce_chunk, &job);
}
