/* fsdp_workers_t: a fixed pool of threads for the data plane's parallel loops.
 *
 * A memory-bound kernel on a large buffer needs more than one core to reach the machine's
 * memory bandwidth, and the daemon runs one such kernel per unit per op, so the pool keeps
 * its threads alive between calls and hands them work with one wake-up: no thread is
 * created per call. Idle threads sleep on a condition variable; only right after a call
 * does a thread poll for the next one, for at most 50 us, because waking a sleeping thread
 * costs tens of microseconds (more on a loaded or virtual machine) and calls often come back
 * to back. Costs per call (2 threads, fsdp-kernels-bench): about 0.03 us for a range that
 * runs on the caller alone, about 1 us to split one across threads that are still polling,
 * and a scheduler wake-up (55 us on an idle 2-vCPU VM, milliseconds when the other core is
 * busy) when they sleep; the caller does not wait for a late thread to start but works on,
 * so a late thread costs throughput, not latency beyond its last chunk.
 *
 * fsdp_workers_for() is a blocking parallel for: it splits [0, n_items) into chunks whose
 * boundaries are multiples of `grain`, the calling thread works on chunks together with the
 * pool's threads (claimed dynamically, so a thread that starts late or runs slow takes
 * fewer), and it returns when every chunk is done. A range that fits in one chunk runs on
 * the caller alone, without waking anyone.
 *
 * Threads. A pool is driven by one caller thread at a time; any thread may be that caller,
 * but calls must not overlap (a second concurrent or nested call, from another thread or
 * from inside fn, gets -EBUSY instead of a deadlock). fn runs on the caller and on pool
 * threads concurrently, each time on a disjoint [begin, end).
 *
 * Lifetime. fsdp_workers_new() starts the threads; fsdp_workers_free() stops and joins them
 * and must not race a call in progress. Nothing else is allocated after creation. */
#ifndef FSDP_WORKERS_H
#define FSDP_WORKERS_H

#include <stdbool.h>
#include <stddef.h>

#include "kernels/kernels.h"

typedef struct fsdp_workers fsdp_workers_t;

/* Most threads a pool may have; far above any host's useful count for memory-bound work. */
#define FSDP_WORKERS_MAX 256

/* Elements per chunk boundary in the *_parallel wrappers: 32 elements are 64 or 128 bytes,
 * so with 64-byte-aligned buffers no two threads ever write the same cache line whatever
 * the dtype. */
#define FSDP_WORKERS_ALIGN_ITEMS 32

/* A pool in which n_threads threads work on each call: the caller plus n_threads - 1
 * threads started here (n_threads = 1 starts none and runs everything on the caller).
 * Returns 0 and sets *ret_pool, -EINVAL for n_threads outside [1, FSDP_WORKERS_MAX], or
 * -errno (-ENOMEM, -EAGAIN from pthread_create) with nothing left behind. */
int fsdp_workers_new(unsigned n_threads, fsdp_workers_t **ret_pool);

/* Stops and joins the threads and frees the pool. NULL is a no-op. */
void fsdp_workers_free(fsdp_workers_t *pool);

/* The n_threads the pool was made with (1 for NULL). */
unsigned fsdp_workers_count(const fsdp_workers_t *pool);

/* Calls fn(ctx, begin, end) over disjoint ranges covering [0, n_items) exactly once, on
 * this thread and the pool's, and returns when all have returned. Every begin is a multiple
 * of grain (0 means 1), so every end is too except the last, n_items. The pool chooses
 * chunk sizes (multiples of grain) large enough to amortize a wake-up and small enough to
 * balance; pass a grain of at least the work worth one wake-up (tens of microseconds).
 * pool may be NULL: then fn runs once on this thread. n_items = 0 returns at once.
 * Returns 0, -EINVAL for a NULL fn with n_items > 0, or -EBUSY for an overlapping call. */
int fsdp_workers_for(fsdp_workers_t *pool, size_t n_items, size_t grain,
                     void (*fn)(void *ctx, size_t begin, size_t end), void *ctx);

/* fsdp_cast and fsdp_reduce of kernels.h split over the pool (NULL: this thread only),
 * with the same arguments, results and errors, plus -EBUSY as above. Small buffers run on
 * the caller alone. */
int fsdp_cast_parallel(fsdp_workers_t *pool, void *dst, fsdp_dtype_t dst_type, const void *src,
                       fsdp_dtype_t src_type, size_t n);
int fsdp_reduce_parallel(fsdp_workers_t *pool, float *dst, bool accumulate,
                         const void *const *srcs, unsigned n_srcs, fsdp_dtype_t src_type,
                         fsdp_dtype_t reduce_type, float pre_scale, float post_scale, size_t n);

#endif
