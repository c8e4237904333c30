/* The CUDA backend module (fsdp-cuda.so): what it knows of the GPUs. It links the CUDA
 * runtime only; the driver's functions it needs come through the runtime
 * (cudaGetDriverEntryPointByVersion), so the module loads wherever the runtime does and
 * a host without a driver hears so from the probe. */
#include "cuda/module.h"

#include <stdio.h>
#include <string.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

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
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion("cuDeviceGetAttribute", &fn, DRIVER_API_VERSION,
                                       cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    fn = NULL; /* every driver attribute then reads as unsupported */
  device_attribute_fn get = (device_attribute_fn)fn;
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

static const fsdp_cuda_module_t module = {
    .version = FSDP_CUDA_MODULE_VERSION,
    .versions = versions,
    .probe = probe,
};

__attribute__((visibility("default"))) const fsdp_cuda_module_t *fsdp_cuda_module(void) {
  return &module;
}
