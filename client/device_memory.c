/* The trainer's side of the CUDA backend's shared memory (client/device_memory.h). The
 * driver is found at run time: dlopen("libcuda.so.1"), then each function by name through
 * cuGetProcAddress at the API version whose signatures cuda.h declares, so neither libfsdp
 * nor its users link CUDA. */
#include "client/device_memory.h"

#include <errno.h>

#include <fsdp/fsdp_version.h>

#if FSDP_HAVE_CUDA

#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#include <cuda.h>

#define DRIVER_API_VERSION 12000

static struct {
  const char *error; /* why the driver cannot be used; NULL once found */
  CUresult (*init)(unsigned);
  CUresult (*device_get)(CUdevice *, int);
  CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*ctx_synchronize)(void);
  CUresult (*import_handle)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
  CUresult (*get_granularity)(size_t *, const CUmemAllocationProp *,
                              CUmemAllocationGranularity_flags);
  CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*error_string)(CUresult, const char **);
  CUresult (*ipc_open_event)(CUevent *, CUipcEventHandle);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_destroy)(CUevent);
} drv;

static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

typedef CUresult (*get_proc_fn)(const char *, void **, int, cuuint64_t,
                                CUdriverProcAddressQueryResult *);

static void *proc(get_proc_fn get, const char *name) {
  void *fn = NULL;
  CUdriverProcAddressQueryResult found;
  if (get(name, &fn, DRIVER_API_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS ||
      found != CU_GET_PROC_ADDRESS_SUCCESS)
    return NULL;
  return fn;
}

static void load_driver(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  get_proc_fn get = lib ? (get_proc_fn)dlsym(lib, "cuGetProcAddress_v2") : NULL;
  if (!get) {
    drv.error = lib ? "libcuda.so.1 has no cuGetProcAddress_v2 (a driver older than CUDA 12)"
                    : "cannot load libcuda.so.1 (no NVIDIA driver on this host)";
    return;
  }
  drv.init = proc(get, "cuInit");
  drv.device_get = proc(get, "cuDeviceGet");
  drv.primary_ctx_retain = proc(get, "cuDevicePrimaryCtxRetain");
  drv.ctx_set_current = proc(get, "cuCtxSetCurrent");
  drv.ctx_synchronize = proc(get, "cuCtxSynchronize");
  drv.import_handle = proc(get, "cuMemImportFromShareableHandle");
  drv.get_granularity = proc(get, "cuMemGetAllocationGranularity");
  drv.reserve = proc(get, "cuMemAddressReserve");
  drv.address_free = proc(get, "cuMemAddressFree");
  drv.map = proc(get, "cuMemMap");
  drv.unmap = proc(get, "cuMemUnmap");
  drv.set_access = proc(get, "cuMemSetAccess");
  drv.release = proc(get, "cuMemRelease");
  drv.error_string = proc(get, "cuGetErrorString");
  drv.ipc_open_event = proc(get, "cuIpcOpenEventHandle");
  drv.event_record = proc(get, "cuEventRecord");
  drv.event_destroy = proc(get, "cuEventDestroy");
  if (!drv.init || !drv.device_get || !drv.primary_ctx_retain || !drv.ctx_set_current ||
      !drv.ctx_synchronize || !drv.import_handle || !drv.get_granularity || !drv.reserve ||
      !drv.address_free || !drv.map || !drv.unmap || !drv.set_access || !drv.release ||
      !drv.error_string || !drv.ipc_open_event || !drv.event_record || !drv.event_destroy)
    drv.error = "the NVIDIA driver lacks the virtual memory management or IPC event calls";
  else if (drv.init(0) != CUDA_SUCCESS)
    drv.error = "cuInit failed: the NVIDIA driver sees no usable GPU";
}

static int driver(fsdp_status_t *st) {
  pthread_once(&drv_once, load_driver);
  return drv.error ? fsdp_status_set(st, FSDP_E_UNAVAILABLE, "GPU memory: %s", drv.error) : 0;
}

static int failed(fsdp_status_t *st, int ordinal, const char *call, CUresult e) {
  const char *what = NULL;
  if (drv.error_string(e, &what) != CUDA_SUCCESS || !what)
    what = "unknown error";
  return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "GPU %d memory: %s: %s (%d)", ordinal, call,
                         what, (int)e);
}

/* The GPU's primary context, the one PyTorch and the runtime use, current on this thread:
 * what the trainer maps is then visible to its kernels. */
static int use_device(int ordinal, fsdp_status_t *st) {
  CUdevice dev;
  CUcontext ctx;
  CUresult e = drv.device_get(&dev, ordinal);
  if (e == CUDA_SUCCESS)
    e = drv.primary_ctx_retain(&ctx, dev);
  if (e == CUDA_SUCCESS)
    e = drv.ctx_set_current(ctx);
  return e == CUDA_SUCCESS ? 0 : failed(st, ordinal, "cuDevicePrimaryCtxRetain", e);
}

static CUmemAllocationProp allocation_prop(int ordinal) {
  return (CUmemAllocationProp){
      .type = CU_MEM_ALLOCATION_TYPE_PINNED,
      .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = ordinal},
  };
}

int fsdp_device_memory_import(int fd, size_t bytes, int ordinal, fsdp_device_memory_t *ret,
                              fsdp_status_t *st) {
  int r = driver(st);
  if (r < 0 || (r = use_device(ordinal, st)) < 0)
    return r;
  CUmemAllocationProp prop = allocation_prop(ordinal);
  size_t page = 0;
  CUresult e = drv.get_granularity(&page, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (e != CUDA_SUCCESS || page == 0)
    return failed(st, ordinal, "cuMemGetAllocationGranularity", e);
  if (bytes == 0 || bytes % page != 0)
    return fsdp_status_set(st, FSDP_E_INTERNAL,
                           "GPU %d memory: %zu bytes is not a whole number of %zu-byte pages",
                           ordinal, bytes, page);
  CUmemGenericAllocationHandle handle;
  e = drv.import_handle(&handle, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (e != CUDA_SUCCESS)
    return failed(st, ordinal, "cuMemImportFromShareableHandle", e);
  *ret = (fsdp_device_memory_t){.ordinal = ordinal, .handle = handle, .bytes = bytes,
                                .page = page};
  return 0;
}

void fsdp_device_memory_release(fsdp_device_memory_t *m) {
  if (m && m->handle)
    drv.release(m->handle);
}

int fsdp_device_reserve(const fsdp_device_memory_t *m, void **ret, fsdp_status_t *st) {
  CUdeviceptr p = 0;
  CUresult e = drv.reserve(&p, m->bytes, m->page, 0, 0);
  if (e != CUDA_SUCCESS)
    return failed(st, m->ordinal, "cuMemAddressReserve", e);
  *ret = (void *)(uintptr_t)p;
  return 0;
}

void fsdp_device_unreserve(void *p, size_t bytes) {
  if (p)
    drv.address_free((CUdeviceptr)(uintptr_t)p, bytes);
}

int fsdp_device_map(const fsdp_device_memory_t *m, void *p, bool writable,
                    fsdp_status_t *st) {
  CUdeviceptr at = (CUdeviceptr)(uintptr_t)p;
  size_t bytes = m->bytes;
  CUresult e = drv.map(at, bytes, 0, m->handle, 0);
  if (e != CUDA_SUCCESS)
    return failed(st, m->ordinal, "cuMemMap", e);
  CUmemAccessDesc access = {
      .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = m->ordinal},
      .flags = writable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ,
  };
  e = drv.set_access(at, bytes, &access, 1);
  if (e != CUDA_SUCCESS && !writable) {
    /* A driver that maps device memory read-write only: read-only is then the trainer
     * library's promise alone, as on the host without the seal. */
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    e = drv.set_access(at, bytes, &access, 1);
  }
  if (e != CUDA_SUCCESS) {
    drv.unmap(at, bytes);
    return failed(st, m->ordinal, "cuMemSetAccess", e);
  }
  return 0;
}

void fsdp_device_unmap(const fsdp_device_memory_t *m, void *p, size_t bytes) {
  if (use_device(m->ordinal, NULL) == 0)
    drv.ctx_synchronize();
  drv.unmap((CUdeviceptr)(uintptr_t)p, bytes);
}

int fsdp_device_event_open(int ordinal, const uint8_t handle[64], void **ret,
                           fsdp_status_t *st) {
  _Static_assert(sizeof(CUipcEventHandle) == 64, "an IPC event handle is 64 bytes");
  int r = driver(st);
  if (r < 0 || (r = use_device(ordinal, st)) < 0)
    return r;
  CUipcEventHandle h;
  memcpy(&h, handle, sizeof h);
  CUevent event;
  CUresult e = drv.ipc_open_event(&event, h);
  if (e != CUDA_SUCCESS)
    return failed(st, ordinal, "cuIpcOpenEventHandle", e);
  *ret = event;
  return 0;
}

int fsdp_device_event_record(void *event, void *stream, fsdp_status_t *st) {
  CUresult e = drv.event_record((CUevent)event, (CUstream)stream);
  if (e == CUDA_SUCCESS)
    return 0;
  const char *what = NULL;
  if (drv.error_string(e, &what) != CUDA_SUCCESS || !what)
    what = "unknown error";
  return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "cuEventRecord of the session's event on "
                         "stream %p: %s (%d)", stream, what, (int)e);
}

void fsdp_device_event_close(void *event) {
  if (event)
    drv.event_destroy((CUevent)event);
}

#else /* no CUDA at build time */

static int unavailable(fsdp_status_t *st) {
  return fsdp_status_set(st, FSDP_E_UNAVAILABLE,
                         "GPU memory: this libfsdp was built without CUDA (the daemon's jobs "
                         "live on a GPU)");
}

int fsdp_device_memory_import(int fd, size_t bytes, int ordinal, fsdp_device_memory_t *ret,
                              fsdp_status_t *st) {
  (void)fd, (void)bytes, (void)ordinal, (void)ret;
  return unavailable(st);
}

void fsdp_device_memory_release(fsdp_device_memory_t *m) {
  (void)m;
}

int fsdp_device_reserve(const fsdp_device_memory_t *m, void **ret, fsdp_status_t *st) {
  (void)m, (void)ret;
  return unavailable(st);
}

void fsdp_device_unreserve(void *p, size_t bytes) {
  (void)p, (void)bytes;
}

int fsdp_device_map(const fsdp_device_memory_t *m, void *p, bool writable,
                    fsdp_status_t *st) {
  (void)m, (void)p, (void)writable;
  return unavailable(st);
}

void fsdp_device_unmap(const fsdp_device_memory_t *m, void *p, size_t bytes) {
  (void)m, (void)p, (void)bytes;
}

int fsdp_device_event_open(int ordinal, const uint8_t handle[64], void **ret,
                           fsdp_status_t *st) {
  (void)ordinal, (void)handle, (void)ret;
  return unavailable(st);
}

int fsdp_device_event_record(void *event, void *stream, fsdp_status_t *st) {
  (void)event, (void)stream;
  return unavailable(st);
}

void fsdp_device_event_close(void *event) {
  (void)event;
}

#endif
