/* The CUDA backend module (fsdp-cuda.so): the GPUs, their memory that trainers map, and the
 * daemon's streams and kernels on them. It links the CUDA runtime only; the driver's
 * functions it needs come through the runtime (cudaGetDriverEntryPointByVersion), so the
 * module loads wherever the runtime does and a host without a driver hears so from the
 * probe. */
#include "cuda/module.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include "cuda/kernels.h"
#include "cuda/nccl.h"

/* The driver API version whose cuDeviceGetAttribute signature we call. */
#define DRIVER_API_VERSION 12000

typedef CUresult (*device_attribute_fn)(int *value, CUdevice_attribute attribute, CUdevice dev);

static int cuda_failed(fsdp_status_t *st, const char *call, cudaError_t e) {
  return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "%s: %s (%s)", call, cudaGetErrorString(e),
                         cudaGetErrorName(e));
}

static void versions(char *buf, size_t size) {
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  if (driver)
    snprintf(buf, size, "CUDA runtime %d.%d, driver %d.%d", runtime / 1000, runtime % 1000 / 10,
             driver / 1000, driver % 1000 / 10);
  else
    snprintf(buf, size, "CUDA runtime %d.%d, no driver", runtime / 1000, runtime % 1000 / 10);
}

/* A driver function by name, as of DRIVER_API_VERSION's signature; NULL when the driver has
 * none. */
static void *driver_function(const char *name) {
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &fn, DRIVER_API_VERSION, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    return NULL;
  return fn;
}

static bool driver_attribute(device_attribute_fn get, int ordinal, CUdevice_attribute attribute) {
  int value = 0;
  return get && get(&value, attribute, (CUdevice)ordinal) == CUDA_SUCCESS && value;
}

static int probe(fsdp_cuda_device_t *devices, unsigned max, unsigned *ret_n, fsdp_status_t *st) {
  int count = 0;
  /* Any failure here means no usable GPU: without a driver the runtime says
   * cudaErrorInsufficientDriver, not cudaErrorNoDevice. */
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess)
    return cuda_failed(st, "cudaGetDeviceCount", e);
  /* Without it every driver attribute reads as unsupported. */
  device_attribute_fn get = (device_attribute_fn)driver_function("cuDeviceGetAttribute");
  unsigned n = 0;
  for (int i = 0; i < count && n < max; i++) {
    struct cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, i)) != cudaSuccess)
      return cuda_failed(st, "cudaGetDeviceProperties", e);
    int ipc_events = 0;
    cudaDeviceGetAttribute(&ipc_events, cudaDevAttrIpcEventSupport, i);
    CUdevice_attribute fd_attribute =
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED;
    fsdp_cuda_device_t *d = &devices[n++];
    *d = (fsdp_cuda_device_t){
        .ordinal = i,
        .memory_bytes = prop.totalGlobalMem,
        .major = prop.major,
        .minor = prop.minor,
        .virtual_memory =
            driver_attribute(get, i, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED),
        .fd_export = driver_attribute(get, i, fd_attribute),
        .ipc_events = ipc_events != 0,
    };
    snprintf(d->name, sizeof d->name, "%s", prop.name);
  }
  *ret_n = n;
  return 0;
}

/* The driver's virtual memory management calls, found once. */
static struct {
  bool found;
  CUresult (*get_granularity)(size_t *, const CUmemAllocationProp *,
                              CUmemAllocationGranularity_flags);
  CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                     unsigned long long);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*export_handle)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                            unsigned long long);
  CUresult (*error_string)(CUresult, const char **);
} vmm;

static bool find_vmm(void) {
  if (vmm.found)
    return true;
  vmm.get_granularity = driver_function("cuMemGetAllocationGranularity");
  vmm.create = driver_function("cuMemCreate");
  vmm.release = driver_function("cuMemRelease");
  vmm.reserve = driver_function("cuMemAddressReserve");
  vmm.address_free = driver_function("cuMemAddressFree");
  vmm.map = driver_function("cuMemMap");
  vmm.unmap = driver_function("cuMemUnmap");
  vmm.set_access = driver_function("cuMemSetAccess");
  vmm.export_handle = driver_function("cuMemExportToShareableHandle");
  vmm.error_string = driver_function("cuGetErrorString");
  vmm.found = vmm.get_granularity && vmm.create && vmm.release && vmm.reserve &&
              vmm.address_free && vmm.map && vmm.unmap && vmm.set_access && vmm.export_handle &&
              vmm.error_string;
  return vmm.found;
}

static int driver_failed(fsdp_status_t *st, int ordinal, size_t bytes, const char *call,
                         CUresult e) {
  const char *what = NULL;
  if (vmm.error_string(e, &what) != CUDA_SUCCESS || !what)
    what = "unknown error";
  return fsdp_status_set(st, e == CUDA_ERROR_OUT_OF_MEMORY ? FSDP_E_RESOURCE_EXHAUSTED
                                                           : FSDP_E_UNAVAILABLE,
                         "GPU %d: %zu bytes of shared memory: %s: %s (%d)", ordinal, bytes, call,
                         what, (int)e);
}

static void memory_free(fsdp_cuda_memory_t *m) {
  if (!m || !m->bytes)
    return;
  CUdeviceptr base = (CUdeviceptr)(uintptr_t)m->base;
  if (m->base) {
    vmm.unmap(base, m->bytes);
    vmm.address_free(base, m->bytes);
  }
  if (m->handle)
    vmm.release(m->handle); /* the memory lives on while a trainer maps it */
  if (m->fd >= 0)
    close(m->fd);
  *m = (fsdp_cuda_memory_t){.fd = -1};
}

/* One physical allocation for the whole memory: a trainer imports and maps it with one
 * descriptor, and the daemon sub-allocates it by offset (daemon/store/arena.h). */
static int memory_new(int ordinal, size_t bytes, fsdp_cuda_memory_t *ret, fsdp_status_t *st) {
  *ret = (fsdp_cuda_memory_t){.ordinal = ordinal, .fd = -1};
  if (!find_vmm())
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE,
                           "GPU %d: the driver lacks the virtual memory management calls",
                           ordinal);
  cudaError_t ce = cudaSetDevice(ordinal); /* the runtime makes the primary context current */
  if (ce == cudaSuccess)
    ce = cudaFree(NULL);
  if (ce != cudaSuccess)
    return cuda_failed(st, "cudaSetDevice", ce);
  CUmemAllocationProp prop = {
      .type = CU_MEM_ALLOCATION_TYPE_PINNED,
      .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = ordinal},
  };
  size_t page = 0;
  CUresult e = vmm.get_granularity(&page, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (e != CUDA_SUCCESS || page == 0)
    return driver_failed(st, ordinal, bytes, "cuMemGetAllocationGranularity", e);
  size_t size = (bytes + page - 1) / page * page;
  ret->page = page;
  ret->bytes = size;
  const char *call = "cuMemCreate";
  CUdeviceptr base = 0;
  int fd = -1;
  if ((e = vmm.create(&ret->handle, size, &prop, 0)) != CUDA_SUCCESS)
    goto fail;
  call = "cuMemAddressReserve";
  if ((e = vmm.reserve(&base, size, page, 0, 0)) != CUDA_SUCCESS)
    goto fail;
  call = "cuMemMap";
  if ((e = vmm.map(base, size, 0, ret->handle, 0)) != CUDA_SUCCESS) {
    vmm.address_free(base, size);
    goto fail;
  }
  ret->base = (void *)(uintptr_t)base;
  CUmemAccessDesc access = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  call = "cuMemSetAccess";
  if ((e = vmm.set_access(base, size, &access, 1)) != CUDA_SUCCESS)
    goto fail;
  call = "cuMemExportToShareableHandle";
  if ((e = vmm.export_handle(&fd, ret->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) !=
      CUDA_SUCCESS)
    goto fail;
  ret->fd = fd;
  /* Fresh host memory reads zero; so does this, whatever the driver left in it. */
  if ((ce = cudaMemset(ret->base, 0, size)) != cudaSuccess ||
      (ce = cudaDeviceSynchronize()) != cudaSuccess) {
    memory_free(ret);
    return cuda_failed(st, "zeroing new shared memory", ce);
  }
  return 0;
fail:
  driver_failed(st, ordinal, size, call, e);
  memory_free(ret);
  return st ? st->code : FSDP_E_UNAVAILABLE;
}

static int host_new(size_t bytes, void **ret, fsdp_status_t *st) {
  cudaError_t e = cudaHostAlloc(ret, bytes, cudaHostAllocPortable);
  if (e == cudaErrorMemoryAllocation)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED,
                           "out of pinned host memory for %zu bytes (cudaHostAlloc)", bytes);
  return e == cudaSuccess ? 0 : cuda_failed(st, "cudaHostAlloc", e);
}

static void host_free(void *memory) {
  if (memory)
    cudaFreeHost(memory);
}

struct fsdp_cuda_stream {
  int ordinal;
  cudaStream_t stream;
  double *partials; /* a sum of squares' parts and result, on the device (FSDP_CUDA_SUM_PARTIALS + 1) */
  double *sum;      /* its result, pinned host memory */
};

static void stream_free(fsdp_cuda_stream_t *s);

static int stream_new(int ordinal, fsdp_cuda_stream_t **ret, fsdp_status_t *st) {
  fsdp_cuda_stream_t *s = calloc(1, sizeof *s);
  if (!s)
    return fsdp_status_set(st, -ENOMEM, "GPU %d: out of memory for a stream", ordinal);
  s->ordinal = ordinal;
  cudaError_t e = cudaSetDevice(ordinal);
  /* Non-blocking: the daemon's work never waits behind the legacy default stream. */
  const char *call = "cudaStreamCreateWithFlags";
  if (e == cudaSuccess)
    e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking);
  if (e == cudaSuccess) {
    call = "cudaMalloc";
    e = cudaMalloc((void **)&s->partials, (FSDP_CUDA_SUM_PARTIALS + 1) * sizeof(double));
  }
  if (e == cudaSuccess) {
    call = "cudaHostAlloc";
    e = cudaHostAlloc((void **)&s->sum, sizeof(double), cudaHostAllocDefault);
  }
  if (e != cudaSuccess) {
    stream_free(s);
    return cuda_failed(st, call, e);
  }
  *ret = s;
  return 0;
}

static void stream_free(fsdp_cuda_stream_t *s) {
  if (!s)
    return;
  if (s->stream)
    cudaStreamDestroy(s->stream);
  if (s->partials)
    cudaFree(s->partials);
  if (s->sum)
    cudaFreeHost(s->sum);
  free(s);
}

/* The runtime's current device is per thread, and the daemon's work runs on a pool's. */
static int on_device(fsdp_cuda_stream_t *s, fsdp_status_t *st) {
  cudaError_t e = cudaSetDevice(s->ordinal);
  return e == cudaSuccess ? 0 : cuda_failed(st, "cudaSetDevice", e);
}

static int cast(fsdp_cuda_stream_t *s, void *dst, fsdp_dtype_t dst_type, const void *src,
                fsdp_dtype_t src_type, size_t n, fsdp_status_t *st) {
  int r = on_device(s, st);
  return r < 0 ? r : fsdp_cuda_cast(dst, dst_type, src, src_type, n, s->stream, st);
}

static int reduce(fsdp_cuda_stream_t *s, float *dst, bool accumulate, const void *const *srcs,
                  unsigned n_srcs, fsdp_dtype_t src_type, fsdp_dtype_t reduce_type,
                  float pre_scale, float post_scale, size_t n, fsdp_status_t *st) {
  int r = on_device(s, st);
  return r < 0 ? r
               : fsdp_cuda_reduce(dst, accumulate, srcs, n_srcs, src_type, reduce_type,
                                  pre_scale, post_scale, n, s->stream, st);
}

static int optim_step(fsdp_cuda_stream_t *s, const fsdp_optim_step_t *step, float *p, float *g,
                      float *const state[3], size_t n, fsdp_status_t *st) {
  int r = on_device(s, st);
  return r < 0 ? r : fsdp_cuda_optim_step(step, p, g, state, n, s->stream, st);
}

static int synchronize(fsdp_cuda_stream_t *s, fsdp_status_t *st);

static int sum_squares(fsdp_cuda_stream_t *s, const float *x, size_t n, double *ret,
                       fsdp_status_t *st) {
  int r = on_device(s, st);
  if (r == 0)
    r = fsdp_cuda_sum_squares(x, n, s->partials, s->stream, st);
  if (r < 0)
    return r;
  cudaError_t e = cudaMemcpyAsync(s->sum, s->partials + FSDP_CUDA_SUM_PARTIALS, sizeof(double),
                                  cudaMemcpyDeviceToHost, s->stream);
  if (e != cudaSuccess)
    return cuda_failed(st, "cudaMemcpyAsync", e);
  if ((r = synchronize(s, st)) < 0)
    return r;
  *ret = *s->sum;
  return 0;
}

static int zero(int ordinal, void *dst, size_t bytes, fsdp_status_t *st) {
  cudaError_t e = cudaSetDevice(ordinal);
  if (e == cudaSuccess)
    e = cudaMemset(dst, 0, bytes);
  if (e == cudaSuccess)
    e = cudaStreamSynchronize(cudaStreamLegacy);
  return e == cudaSuccess ? 0 : cuda_failed(st, "zeroing memory", e);
}

static int copy(fsdp_cuda_stream_t *s, void *dst, const void *src, size_t bytes,
                fsdp_status_t *st) {
  int r = on_device(s, st);
  if (r < 0)
    return r;
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s->stream);
  return e == cudaSuccess ? 0 : cuda_failed(st, "cudaMemcpyAsync", e);
}

static int synchronize(fsdp_cuda_stream_t *s, fsdp_status_t *st) {
  cudaError_t e = cudaStreamSynchronize(s->stream);
  return e == cudaSuccess ? 0 : cuda_failed(st, "cudaStreamSynchronize", e);
}

struct fsdp_cuda_event {
  cudaEvent_t event;
};

static int event_new(int ordinal, fsdp_cuda_event_t **ret, unsigned char handle[64],
                     fsdp_status_t *st) {
  _Static_assert(sizeof(cudaIpcEventHandle_t) == 64, "an IPC event handle is 64 bytes");
  fsdp_cuda_event_t *ev = calloc(1, sizeof *ev);
  if (!ev)
    return fsdp_status_set(st, -ENOMEM, "GPU %d: out of memory for an event", ordinal);
  const char *call = "cudaSetDevice";
  cudaError_t e = cudaSetDevice(ordinal);
  if (e == cudaSuccess) {
    call = "cudaEventCreateWithFlags";
    e = cudaEventCreateWithFlags(&ev->event, cudaEventInterprocess | cudaEventDisableTiming);
  }
  cudaIpcEventHandle_t h;
  if (e == cudaSuccess) {
    call = "cudaIpcGetEventHandle";
    if ((e = cudaIpcGetEventHandle(&h, ev->event)) != cudaSuccess)
      cudaEventDestroy(ev->event);
  }
  if (e != cudaSuccess) {
    free(ev);
    return cuda_failed(st, call, e);
  }
  memcpy(handle, &h, sizeof h);
  *ret = ev;
  return 0;
}

static void event_free(fsdp_cuda_event_t *ev) {
  if (!ev)
    return;
  cudaEventDestroy(ev->event); /* waits queued on it still complete */
  free(ev);
}

static int stream_wait(fsdp_cuda_stream_t *s, fsdp_cuda_event_t *ev, fsdp_status_t *st) {
  int r = on_device(s, st);
  if (r < 0)
    return r;
  cudaError_t e = cudaStreamWaitEvent(s->stream, ev->event, 0);
  return e == cudaSuccess ? 0 : cuda_failed(st, "cudaStreamWaitEvent", e);
}

#if FSDP_HAVE_NCCL
/* The table's NCCL entries: the module's streams hold the cudaStream_t NCCL queues on. */
static int all_gather(fsdp_cuda_comm_t *c, fsdp_cuda_stream_t *s, const void *send, void *recv,
                      size_t count, fsdp_dtype_t type, int64_t deadline_ms, fsdp_status_t *st) {
  return fsdp_cuda_all_gather(c, s->stream, send, recv, count, type, deadline_ms, st);
}

static int reduce_scatter(fsdp_cuda_comm_t *c, fsdp_cuda_stream_t *s, const void *send,
                          void *recv, size_t count, fsdp_dtype_t type, float pre_scale,
                          int64_t deadline_ms, fsdp_status_t *st) {
  return fsdp_cuda_reduce_scatter(c, s->stream, send, recv, count, type, pre_scale,
                                  deadline_ms, st);
}

static int all_reduce(fsdp_cuda_comm_t *c, fsdp_cuda_stream_t *s, const void *send, void *recv,
                      size_t count, fsdp_dtype_t type, float pre_scale, int64_t deadline_ms,
                      fsdp_status_t *st) {
  return fsdp_cuda_all_reduce(c, s->stream, send, recv, count, type, pre_scale, deadline_ms,
                              st);
}
#endif

static const fsdp_cuda_module_t module = {
    .version = FSDP_CUDA_MODULE_VERSION,
    .versions = versions,
    .probe = probe,
    .memory_new = memory_new,
    .memory_free = memory_free,
    .host_new = host_new,
    .host_free = host_free,
    .stream_new = stream_new,
    .stream_free = stream_free,
    .cast = cast,
    .reduce = reduce,
    .optim_step = optim_step,
    .sum_squares = sum_squares,
    .zero = zero,
    .copy = copy,
    .synchronize = synchronize,
    .event_new = event_new,
    .event_free = event_free,
    .stream_wait = stream_wait,
#if FSDP_HAVE_NCCL
    .nccl_id = fsdp_cuda_nccl_id,
    .comm_new = fsdp_cuda_comm_new,
    .comm_free = fsdp_cuda_comm_free,
    .all_gather = all_gather,
    .reduce_scatter = reduce_scatter,
    .all_reduce = all_reduce,
#endif
};

__attribute__((visibility("default"))) const fsdp_cuda_module_t *fsdp_cuda_module(void) {
  return &module;
}
