/* The check of a peer's data-plane (UCX) address, made in a process of its own before the
 * daemon's worker ever sees the address.
 *
 * Why: a peer's address is UCX's packed worker address, which only UCX can unpack, and UCX
 * 1.13 asserts (aborting the whole process) on one it cannot parse; a process that unpacks
 * it and survives is the only complete check there is. The check is this same executable
 * (/proc/self/exe, so the very UCX build, environment and settings of the daemon) started
 * with FSDP_ADDRESS_CHECK_FLAG: it builds the daemon's own transport (fsdp_ucx_new, with the
 * fabric's options), connects to the address with fsdp_ucx_connect, as the fabric would, and
 * exits 0 only if UCX took it. It is started with posix_spawn (no fork of the threaded,
 * large daemon), reads the address from a memfd on its stdin and writes what UCX said to one
 * on its stdout and stderr; the daemon watches it through a pidfd on the loop, and kills it
 * at the deadline.
 *
 * Threads: the loop thread only. Lifetime: fsdp_address_check_start makes a check that frees
 * itself after its callback has run, which happens exactly once and never inside the call
 * that started it. */
#ifndef FSDP_ADDRESS_CHECK_H
#define FSDP_ADDRESS_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/status.h"
#include "transport/ucx.h"

/* How the data plane's worker handles peer failures: the fabric (fabric.h) makes its worker
 * with it, and the check makes its own the same way, so that UCX unpacks a peer's address as
 * the fabric's would. */
#define FSDP_DATA_PLANE_UCX_ERR_MODE FSDP_UCX_ERR_AUTO

/* argv[1] of the checking process; main() hands it to fsdp_address_check_main at once. */
#define FSDP_ADDRESS_CHECK_FLAG "--check-peer-address"

typedef struct fsdp_address_check fsdp_address_check_t;

/* result: 0 when UCX took the address; FSDP_E_INVALID_ARGUMENT when UCX refused it or
 * aborted on it (why says what UCX said); FSDP_E_UNAVAILABLE when the check could not be
 * made or did not end by its deadline (a later check may pass); FSDP_E_CANCELLED after
 * fsdp_address_check_cancel. */
typedef void (*fsdp_address_check_fn)(void *data, int result, const char *why);

/* Starts checking the address bytes (copied into the checking process's stdin). Returns 0
 * and sets *ret_check, or a negative code with st saying why nothing was started (then cb
 * never runs). */
int fsdp_address_check_start(uv_loop_t *loop, const void *bytes, size_t len,
                             uint64_t timeout_ms, fsdp_address_check_fn cb, void *data,
                             fsdp_address_check_t **ret_check, fsdp_status_t *st);

/* Kills the checking process; cb still runs, with FSDP_E_CANCELLED, once it is gone. */
void fsdp_address_check_cancel(fsdp_address_check_t *check);

/* The checking process: reads the address from stdin, exits 0 if UCX takes it, 3 if UCX
 * refuses it, 1 if it cannot check (UCX would not start). */
int fsdp_address_check_main(void);

#endif
