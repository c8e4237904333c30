/* The CUDA module's NCCL communicators (cuda/module.h's comm_* and the collectives), built
 * where NCCL's header is (FSDP_HAVE_NCCL). NCCL itself is loaded at the first call
 * (dlopen("libnccl.so.2"), as libfsdp loads the driver): the module loads, and the CUDA
 * backend serves, on a host without NCCL, which only a communicator needs.
 *
 * Every communicator is non-blocking (config.blocking 0), so that no call waits without a
 * deadline: its set-up and each collective are polled until done, and past the deadline the
 * communicator is aborted (ncclCommAbort) and the call fails with DEADLINE_EXCEEDED. A peer
 * that never joins, or never joins a collective, so ends in time, and the caller makes a new
 * communicator for the job's next run. */
#include "cuda/nccl.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "common/clock.h"

_Static_assert(sizeof(ncclUniqueId) == FSDP_CUDA_NCCL_ID_BYTES, "an NCCL unique id");

/* The oldest NCCL whose ncclConfig_t and calls this file uses (non-blocking communicators,
 * ncclCommFinalize, PreMulSum, bf16). */
#define NCCL_LEAST_VERSION 21800

/* NCCL's functions, found once. */
static struct {
  const char *error; /* why NCCL cannot be used; NULL once found */
  ncclResult_t (*get_version)(int *);
  ncclResult_t (*get_unique_id)(ncclUniqueId *);
  ncclResult_t (*comm_init_rank_config)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
  ncclResult_t (*comm_get_async_error)(ncclComm_t, ncclResult_t *);
  ncclResult_t (*comm_abort)(ncclComm_t);
  ncclResult_t (*comm_finalize)(ncclComm_t);
  ncclResult_t (*comm_destroy)(ncclComm_t);
  const char *(*get_error_string)(ncclResult_t);
  const char *(*get_last_error)(ncclComm_t);
  ncclResult_t (*all_gather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t,
                             cudaStream_t);
  ncclResult_t (*reduce_scatter)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                                 ncclComm_t, cudaStream_t);
  ncclResult_t (*all_reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                             ncclComm_t, cudaStream_t);
  ncclResult_t (*red_op_create_pre_mul_sum)(ncclRedOp_t *, void *, ncclDataType_t,
                                            ncclScalarResidence_t, ncclComm_t);
  ncclResult_t (*red_op_destroy)(ncclRedOp_t, ncclComm_t);
  char message[160];
} nccl;

static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;

static void load_nccl(void) {
  void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(nccl.message, sizeof nccl.message, "cannot load libnccl.so.2: %s", dlerror());
    nccl.error = nccl.message;
    return;
  }
  void **fns[] = {(void **)&nccl.get_version,  (void **)&nccl.get_unique_id,
                  (void **)&nccl.comm_init_rank_config, (void **)&nccl.comm_get_async_error,
                  (void **)&nccl.comm_abort,   (void **)&nccl.comm_finalize,
                  (void **)&nccl.comm_destroy, (void **)&nccl.get_error_string,
                  (void **)&nccl.get_last_error, (void **)&nccl.all_gather,
                  (void **)&nccl.reduce_scatter, (void **)&nccl.all_reduce,
                  (void **)&nccl.red_op_create_pre_mul_sum, (void **)&nccl.red_op_destroy};
  static const char *const names[] = {
      "ncclGetVersion",   "ncclGetUniqueId",  "ncclCommInitRankConfig", "ncclCommGetAsyncError",
      "ncclCommAbort",    "ncclCommFinalize", "ncclCommDestroy",        "ncclGetErrorString",
      "ncclGetLastError", "ncclAllGather",    "ncclReduceScatter",      "ncclAllReduce",
      "ncclRedOpCreatePreMulSum", "ncclRedOpDestroy"};
  _Static_assert(sizeof fns / sizeof fns[0] == sizeof names / sizeof names[0], "one name each");
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (!(*fns[i] = dlsym(lib, names[i]))) {
      snprintf(nccl.message, sizeof nccl.message, "libnccl.so.2 has no %s", names[i]);
      nccl.error = nccl.message;
      return;
    }
  int version = 0;
  if (nccl.get_version(&version) != ncclSuccess || version < NCCL_LEAST_VERSION) {
    snprintf(nccl.message, sizeof nccl.message,
             "libnccl.so.2 is NCCL %d, older than the %d this module needs", version,
             NCCL_LEAST_VERSION);
    nccl.error = nccl.message;
  }
}

static int loaded(fsdp_status_t *st) {
  pthread_once(&nccl_once, load_nccl);
  return nccl.error ? fsdp_status_set(st, FSDP_E_UNAVAILABLE, "NCCL: %s", nccl.error) : 0;
}

struct fsdp_cuda_comm {
  ncclComm_t comm;
  int ordinal, nranks, rank;
  bool broken; /* aborted, or failed: only freeing is left */
};

static int nccl_failed(fsdp_status_t *st, const char *call, ncclResult_t e, ncclComm_t comm) {
  const char *last = comm ? nccl.get_last_error(comm) : NULL;
  return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "%s: %s%s%s", call, nccl.get_error_string(e),
                         last && *last ? ": " : "", last && *last ? last : "");
}

static void pause_briefly(void) {
  struct timespec ts = {.tv_nsec = 50 * 1000}; /* 50 us: a collective's own scale */
  nanosleep(&ts, NULL);
}

static void abort_comm(fsdp_cuda_comm_t *c) {
  if (c->comm && !c->broken)
    nccl.comm_abort(c->comm);
  c->broken = true;
}

/* Polls until the communicator's pending call (ncclInProgress) ended and, with a stream,
 * what the stream queued (the collective) ran, at most to deadline_ms: an error the
 * communicator reports, or the deadline, aborts it. */
static int await(fsdp_cuda_comm_t *c, const cudaStream_t *stream, const char *what,
                 int64_t deadline_ms, fsdp_status_t *st) {
  for (;;) {
    ncclResult_t state;
    ncclResult_t e = nccl.comm_get_async_error(c->comm, &state);
    if (e != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      int r = nccl_failed(st, what, e != ncclSuccess ? e : state, c->comm);
      abort_comm(c);
      return r;
    }
    if (state == ncclSuccess) {
      cudaError_t ce = stream ? cudaStreamQuery(*stream) : cudaSuccess;
      if (ce == cudaSuccess)
        return 0;
      if (ce != cudaErrorNotReady)
        return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "%s: %s", what, cudaGetErrorString(ce));
    }
    if (fsdp_clock_now_ms() >= deadline_ms) {
      abort_comm(c);
      return fsdp_status_set(st, FSDP_E_DEADLINE_EXCEEDED,
                             "%s: rank %d of %d on GPU %d: not done by its deadline; the "
                             "communicator was aborted", what, c->rank, c->nranks, c->ordinal);
    }
    pause_briefly();
  }
}

int fsdp_cuda_nccl_id(unsigned char id[FSDP_CUDA_NCCL_ID_BYTES], fsdp_status_t *st) {
  int r = loaded(st);
  if (r < 0)
    return r;
  ncclUniqueId u;
  ncclResult_t e = nccl.get_unique_id(&u);
  if (e != ncclSuccess)
    return nccl_failed(st, "ncclGetUniqueId", e, NULL);
  memcpy(id, &u, sizeof u);
  return 0;
}

int fsdp_cuda_comm_new(int ordinal, int nranks, int rank,
                       const unsigned char id[FSDP_CUDA_NCCL_ID_BYTES], int64_t deadline_ms,
                       fsdp_cuda_comm_t **ret, fsdp_status_t *st) {
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "NCCL communicator: rank %d of %d is not a rank of it", rank, nranks);
  int loaded_r = loaded(st);
  if (loaded_r < 0)
    return loaded_r;
  fsdp_cuda_comm_t *c = calloc(1, sizeof *c);
  if (!c)
    return fsdp_status_set(st, -ENOMEM, "out of memory for an NCCL communicator");
  *c = (fsdp_cuda_comm_t){.ordinal = ordinal, .nranks = nranks, .rank = rank};
  cudaError_t ce = cudaSetDevice(ordinal);
  if (ce != cudaSuccess) {
    free(c);
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "cudaSetDevice(%d): %s", ordinal,
                           cudaGetErrorString(ce));
  }
  ncclUniqueId u;
  memcpy(&u, id, sizeof u);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t e = nccl.comm_init_rank_config(&c->comm, nranks, u, rank, &config);
  int r = 0;
  if (e != ncclSuccess && e != ncclInProgress) {
    r = nccl_failed(st, "ncclCommInitRankConfig", e, c->comm);
    abort_comm(c);
  } else {
    r = await(c, NULL, "ncclCommInitRankConfig", deadline_ms, st);
  }
  if (r < 0) {
    fsdp_cuda_comm_free(c);
    return r;
  }
  *ret = c;
  return 0;
}

void fsdp_cuda_comm_free(fsdp_cuda_comm_t *c) {
  if (!c)
    return;
  /* An aborted one is gone already (ncclCommAbort frees it); a healthy one is finalized,
   * its pending work flushed (a barrier with the other ranks) within ten seconds, then
   * destroyed, or else aborted. */
  if (c->comm && !c->broken) {
    ncclResult_t e = nccl.comm_finalize(c->comm);
    fsdp_status_t ignored;
    if ((e == ncclSuccess || e == ncclInProgress) &&
        await(c, NULL, "ncclCommFinalize", fsdp_clock_deadline_ms(10000), &ignored) == 0)
      nccl.comm_destroy(c->comm);
    else
      abort_comm(c);
  }
  free(c);
}

static ncclDataType_t nccl_type(fsdp_dtype_t type) {
  switch (type) {
  case FSDP_DTYPE_BF16:
    return ncclBfloat16;
  case FSDP_DTYPE_FP16:
    return ncclFloat16;
  default:
    return ncclFloat32;
  }
}

static int usable(const fsdp_cuda_comm_t *c, const char *what, fsdp_status_t *st) {
  if (c->broken)
    return fsdp_status_set(st, FSDP_E_FAILED_PRECONDITION,
                           "%s: the communicator was aborted: make a new one", what);
  cudaError_t ce = cudaSetDevice(c->ordinal);
  return ce == cudaSuccess ? 0
                           : fsdp_status_set(st, FSDP_E_UNAVAILABLE, "cudaSetDevice(%d): %s",
                                             c->ordinal, cudaGetErrorString(ce));
}

int fsdp_cuda_all_gather(fsdp_cuda_comm_t *c, void *stream, const void *send, void *recv,
                         size_t count, fsdp_dtype_t type, int64_t deadline_ms,
                         fsdp_status_t *st) {
  int r = usable(c, "ncclAllGather", st);
  if (r < 0)
    return r;
  ncclResult_t e = nccl.all_gather(send, recv, count, nccl_type(type), c->comm, stream);
  if (e != ncclSuccess && e != ncclInProgress) {
    r = nccl_failed(st, "ncclAllGather", e, c->comm);
    abort_comm(c);
    return r;
  }
  return await(c, &(cudaStream_t){stream}, "ncclAllGather", deadline_ms, st);
}

/* reduce_scatter and all_reduce: the sum of every rank's send, each times pre_scale (the
 * daemon's pre-divide), by NCCL's PreMulSum. */
static int reduce(fsdp_cuda_comm_t *c, void *stream, const void *send, void *recv,
                  size_t count, fsdp_dtype_t type, float pre_scale, bool scatter,
                  int64_t deadline_ms, fsdp_status_t *st) {
  const char *what = scatter ? "ncclReduceScatter" : "ncclAllReduce";
  int r = usable(c, what, st);
  if (r < 0)
    return r;
  /* PreMulSum's scalar is of the data's type: the daemon reduces in fp32 (reduce_dtype). */
  if (type != FSDP_DTYPE_FP32)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "%s: element type %d: the reductions are in fp32", what, (int)type);
  ncclRedOp_t op;
  ncclResult_t e = nccl.red_op_create_pre_mul_sum(&op, &pre_scale, ncclFloat32,
                                                  ncclScalarHostImmediate, c->comm);
  if (e != ncclSuccess)
    return nccl_failed(st, "ncclRedOpCreatePreMulSum", e, c->comm);
  e = scatter ? nccl.reduce_scatter(send, recv, count, nccl_type(type), op, c->comm, stream)
              : nccl.all_reduce(send, recv, count, nccl_type(type), op, c->comm, stream);
  if (e != ncclSuccess && e != ncclInProgress) {
    r = nccl_failed(st, what, e, c->comm);
    abort_comm(c);
  } else {
    r = await(c, &(cudaStream_t){stream}, what, deadline_ms, st);
  }
  if (!c->broken)
    nccl.red_op_destroy(op, c->comm);
  return r;
}

int fsdp_cuda_reduce_scatter(fsdp_cuda_comm_t *c, void *stream, const void *send, void *recv,
                             size_t count, fsdp_dtype_t type, float pre_scale,
                             int64_t deadline_ms, fsdp_status_t *st) {
  return reduce(c, stream, send, recv, count, type, pre_scale, true, deadline_ms, st);
}

int fsdp_cuda_all_reduce(fsdp_cuda_comm_t *c, void *stream, const void *send, void *recv,
                         size_t count, fsdp_dtype_t type, float pre_scale, int64_t deadline_ms,
                         fsdp_status_t *st) {
  return reduce(c, stream, send, recv, count, type, pre_scale, false, deadline_ms, st);
}
