/* The collectives among a job's local ranks on this host: the rendezvous of its L ranks for
 * one collective of one unit (the gather of a step, or its reduce-scatter), and the host sum
 * of their gradients that a reduce across hosts starts from.
 *
 * A collection records who asked for which step, in which run of the job (generation), and
 * by when every rank must have asked; it completes once all L ranks have asked for the same
 * step, and then runs until its owner resets it. It knows nothing of units, jobs or
 * operations: its functions say what happened (fsdp_collection_outcome_t), and the caller
 * answers its waiting operations, names things in the messages, and resets the collection
 * once the collective ended or was aborted. Its fields are read freely; only these
 * functions change them.
 *
 * A collection starts zeroed (or reset) and holds no resources. Single-threaded: the
 * caller's (the daemon's loop). The host sum keeps no state: any thread, on buffers it owns
 * for the call. */
#ifndef FSDP_COLLECTIVES_LOCAL_H
#define FSDP_COLLECTIVES_LOCAL_H

#include <stdbool.h>
#include <stdint.h>

#include "collectives/rank_set.h"
#include "kernels/kernels.h"

typedef struct fsdp_collection {
  fsdp_rank_set_t submitted;
  unsigned count;
  uint64_t step;
  bool regather; /* a gather: the step's second, for the backward of a unit resharded
                    after its forward */
  uint64_t generation;  /* of the ranks' sessions: the job's run (rings among hosts use it) */
  uint64_t deadline_ms; /* loop time by which every rank must have asked */
  uint64_t first_ms;    /* loop time the first rank asked */
  bool running;         /* every rank asked; the collective runs until reset */
} fsdp_collection_t;

/* A rank's request to join; deadline_ms counts only when it is the first. */
typedef struct fsdp_collection_request {
  uint32_t rank;
  uint64_t step;
  bool regather;
  uint64_t generation;
  uint64_t deadline_ms;
  uint64_t now_ms; /* loop time of the request */
} fsdp_collection_request_t;

/* What a join did. The last three leave the collection as it was: nobody can complete it
 * any more, and the caller aborts it for every rank that joined, then resets it. */
typedef enum fsdp_collection_outcome {
  FSDP_COLLECTION_JOINED,           /* counted; other ranks have still to ask */
  FSDP_COLLECTION_COMPLETE,         /* counted, the last: the collection runs now */
  FSDP_COLLECTION_RANKS_GONE,       /* some of the ranks are gone and cannot ask */
  FSDP_COLLECTION_OTHER_GENERATION, /* the ranks that joined are of another run */
  FSDP_COLLECTION_OTHER_STEP,       /* they asked for another step (or regather) */
} fsdp_collection_outcome_t;

/* rq's rank joins c, a collection of `world` ranks that is not running and that the rank
 * has not joined yet. gone: ranks that can never ask (the checks go in this order: gone
 * ranks, generation, step). */
fsdp_collection_outcome_t fsdp_collection_join(fsdp_collection_t *c, uint32_t world,
                                               const fsdp_collection_request_t *rq,
                                               const fsdp_rank_set_t *gone);

/* rank no longer asks (its caller gave up): unless c runs, it stops counting in it. */
void fsdp_collection_withdraw(fsdp_collection_t *c, uint32_t rank);

/* Whether some ranks asked and c waits for the others. */
bool fsdp_collection_is_collecting(const fsdp_collection_t *c);

/* Whether c waits for ranks past its deadline; if so, *ret_missing: those of the `world`
 * ranks that did not ask. */
bool fsdp_collection_expired(const fsdp_collection_t *c, uint32_t world, uint64_t now_ms,
                             fsdp_rank_set_t *ret_missing);

/* Empties c, whether it completed, was aborted or never started: ready for the next. */
void fsdp_collection_reset(fsdp_collection_t *c);

/* Elements [begin, end) of the host sum, the one contribution of this host to a reduce
 * among hosts: the n_srcs local ranks' gradients (src_type), each scaled by pre_scale,
 * summed in reduce_type (fsdp_reduce) into sum_fp32, then cast into sum when reduce_type is
 * narrower than fp32 (otherwise sum is not touched: it is sum_fp32). Every buffer is indexed
 * from its start. Returns 0, or fsdp_reduce_range's -EINVAL. */
int fsdp_host_sum_range(void *sum, float *sum_fp32, const void *const *srcs, unsigned n_srcs,
                        fsdp_dtype_t src_type, fsdp_dtype_t reduce_type, float pre_scale,
                        size_t begin, size_t end);

#endif
