/* Ring collectives between daemons over fsdp_ucx_t: all-gather, reduce-scatter, all-reduce.
 *
 * n members (1..FSDP_RING_MAX) each hold a buffer of n equal regions, region r being bytes
 * [r * region_bytes, (r + 1) * region_bytes). Member i sends only to its right neighbour
 * (i + 1) % n and receives only from its left (i - 1 + n) % n.
 *   all-gather:      member i owns region i; all members end with every region.
 *   reduce-scatter:  every member contributes its whole buffer; member i ends with region i
 *                    = the elementwise sum over members in the buffer's dtype. The other
 *                    regions of its buffer are overwritten with partial sums.
 *   all-reduce:      reduce-scatter then all-gather: every region is the sum everywhere.
 * Each ring step moves one region in chunks (chunk_bytes, several in flight), and a chunk
 * goes on to the next step as soon as it arrived (and was added, for a sum), so transfers
 * overlap each other and the sums. Sums run on libuv's thread pool (fsdp_add), never on the
 * loop. The sum of region r is accumulated around the ring starting at member r + 1:
 * x[r] + (x[r-1] + (... + (x[r+2] + x[r+1]))), each addition rounded to the dtype, so the
 * result is deterministic and a reference can compute it bit for bit.
 *
 * Making and using the data while the ring runs. A caller whose contribution is computed
 * (a cast, a sum of local gradients) or whose result is consumed (scaled into other
 * buffers) can hand both to the ring chunk by chunk instead of before and after it, so that
 * the local work overlaps the transfers. `produce` writes this member's contribution to one
 * chunk of the buffer; the ring calls it for its own region (all-gather) or for every
 * region (reduce-scatter, all-reduce) in the order the ring needs them, and no chunk is
 * sent or added to before its produce returned. `finalize` reads one chunk of a region this
 * member ends with once the chunk holds its result: its own region (reduce-scatter), every
 * region (all-gather, all-reduce). Each is called once per chunk, on libuv's thread pool
 * (several chunks at once), with the region and the chunk's byte offset and length in it;
 * it returns 0, or a negative errno that fails the collective ("the produce of region r
 * ... failed: ..."). The callback runs after every finalize returned.
 *
 * Messages. A collective's messages are tagged with its op_id (the caller's; the daemon
 * uses the unit and the step), so that collectives running at the same time never mix. The
 * tags and the control messages between members are defined in proto/host/formats.h. An
 * op_id must not be reused while a collective with it may still be running on any member.
 *
 * Failures. The callback runs once, on the loop, with a status whose message names the
 * collective, the member and the peer (by its label) and what happened: a peer failed
 * (UCX reported it, FSDP_E_UNAVAILABLE), a neighbour aborted and passed on its reason, the
 * deadline passed while waiting for a member (FSDP_E_DEADLINE_EXCEEDED), the collective was
 * cancelled (FSDP_E_CANCELLED). A member that fails tells both neighbours, so a failure
 * travels around the ring instead of leaving the others waiting for their deadline. At the
 * deadline a member blames the neighbour it is waiting for, after a short grace (50 ms) in
 * which the members waiting in a chain pass the name of the first one down the ring, so
 * that every member names the one that stopped rather than its own neighbour. Transfers
 * still in flight 200 ms after a failure mean the neighbour does not answer: its
 * connection is then failed (fsdp_ucx_peer_fail) to get the buffers back, and the caller
 * reconnects it.
 *
 * Threads and lifetime. Start, cancel and the callback are on the loop thread of the
 * fsdp_ucx_t. The buffer, the peers and the scratch memory are borrowed until the callback
 * runs; until then UCX or a pool thread may read or write them. After a failure or a cancel
 * the callback still waits until nothing touches them any more. The collective frees
 * itself after its callback returns; the handle is invalid from then on. */
#ifndef FSDP_RING_H
#define FSDP_RING_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "kernels/kernels.h"
#include "transport/ucx.h"

#define FSDP_RING_MAX 16

/* The values are part of the op id the daemons compute alike (fsdp_op_id). */
typedef enum fsdp_ring_kind {
  FSDP_RING_ALL_GATHER = 0,
  FSDP_RING_REDUCE_SCATTER = 1,
  FSDP_RING_ALL_REDUCE = 2,
} fsdp_ring_kind_t;

/* "all-gather", "reduce-scatter", "all-reduce". */
const char *fsdp_ring_kind_name(fsdp_ring_kind_t kind);

typedef struct fsdp_ring fsdp_ring_t;

typedef struct fsdp_ring_args {
  fsdp_ring_kind_t kind;
  unsigned n;    /* members, 1..FSDP_RING_MAX */
  unsigned self; /* this member's index */
  /* n entries; peers[self] is ignored. The neighbours must be connected; any other entry
   * may be NULL and only serves to name that member in messages. */
  fsdp_ucx_peer_t *const *peers;
  void *buf;           /* n * region_bytes bytes */
  size_t region_bytes; /* a multiple of the dtype's size; 0 is allowed (nothing moves) */
  fsdp_dtype_t dtype;
  uint32_t op_id;
  uint64_t deadline_ms; /* absolute, in the loop's clock (uv_now) */
  size_t chunk_bytes;   /* 0: 1 MiB; rounded down to whole elements */
  unsigned window;      /* chunks in flight per direction, 0: 8 */
  /* Memory for window * chunk_bytes received partial sums (reduce-scatter and all-reduce
   * only), so that a collective faults no fresh pages; NULL: allocated per collective. */
  void *scratch;
  size_t scratch_bytes;
  /* Registrations with the transport (fsdp_ucx_mem_register) that hold buf and scratch (the
   * chunks' transfers then skip UCX's registration cache), or NULL. */
  const fsdp_ucx_mem_t *buf_mem, *scratch_mem;
  /* Optional, see the header comment; hook_arg is passed to both. */
  int (*produce)(void *hook_arg, unsigned region, size_t offset, size_t bytes);
  int (*finalize)(void *hook_arg, unsigned region, size_t offset, size_t bytes);
  void *hook_arg;
} fsdp_ring_args_t;

typedef void (*fsdp_ring_cb)(fsdp_ring_t *ring, const fsdp_status_t *status, void *arg);

/* The bytes this member sent to its right neighbour so far (chunks whose send completed),
 * for the callback to count what the collective moved. */
uint64_t fsdp_ring_bytes_sent(const fsdp_ring_t *ring);

/* Starts a collective. Returns 0 and sets *ret_ring (cb will run, never from inside this
 * call), or FSDP_E_INVALID_ARGUMENT / -ENOMEM with st naming the argument and its value
 * (cb will not run). */
int fsdp_ring_start(fsdp_ucx_t *ucx, const fsdp_ring_args_t *args, fsdp_ring_cb cb, void *arg,
                    fsdp_ring_t **ret_ring, fsdp_status_t *st);

/* Ends a running collective: its neighbours are told, and cb runs with FSDP_E_CANCELLED
 * (unless it already failed for another reason) once no transfer or sum touches the memory.
 * Only before cb has run. */
void fsdp_ring_cancel(fsdp_ring_t *ring);

#endif
