/* Loads fsdp-cuda.so from beside the executable: the same relative place in the build tree
 * and once installed (FSDP_CUDA_MODULE_RELPATH, from CMake), so a copied build/ finds its
 * own module wherever it lies. */
#include "cuda/loader.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static const fsdp_cuda_module_t *loaded;

#ifdef FSDP_CUDA_MODULE_RELPATH
static int module_path(char *buf, size_t size, fsdp_status_t *st) {
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n < 0)
    return fsdp_status_set(st, -errno, "cannot find the CUDA backend module: readlink "
                           "/proc/self/exe: %s", strerror(errno));
  exe[n] = '\0';
  char *slash = strrchr(exe, '/');
  if (slash)
    *slash = '\0';
  if ((size_t)snprintf(buf, size, "%s/%s", exe, FSDP_CUDA_MODULE_RELPATH) >= size)
    return fsdp_status_set(st, -ENAMETOOLONG, "cannot find the CUDA backend module: the path "
                           "of the executable is too long");
  return 0;
}
#endif

int fsdp_cuda_load(const fsdp_cuda_module_t **ret_module, fsdp_status_t *st) {
  if (loaded) {
    *ret_module = loaded;
    return 0;
  }
#ifndef FSDP_CUDA_MODULE_RELPATH
  (void)ret_module;
  return fsdp_status_set(st, FSDP_E_UNAVAILABLE,
                         "this fsdpd was built without the CUDA backend (no CUDA toolkit at "
                         "build time, or FSDP_CUDA=OFF)");
#else
  char path[PATH_MAX];
  int r = module_path(path, sizeof path, st);
  if (r < 0)
    return r;
  void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!handle)
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "cannot load the CUDA backend: %s",
                           dlerror());
  const fsdp_cuda_module_t *(*get)(void) = (const fsdp_cuda_module_t *(*)(void))dlsym(
      handle, FSDP_CUDA_MODULE_SYMBOL);
  const fsdp_cuda_module_t *module = get ? get() : NULL;
  if (!module || module->version != FSDP_CUDA_MODULE_VERSION) {
    dlclose(handle);
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE,
                           "%s is not this fsdpd's CUDA backend module (version %u, expected "
                           "%u)",
                           path, module ? module->version : 0u, FSDP_CUDA_MODULE_VERSION);
  }
  loaded = module; /* kept for the process's life, like the GPUs it drives */
  *ret_module = module;
  return 0;
#endif
}

void fsdp_cuda_device_format(const fsdp_cuda_device_t *d, char *buf, size_t size) {
  snprintf(buf, size, "GPU %d (%s, %.1f GiB, compute %d.%d)", d->ordinal, d->name,
           (double)d->memory_bytes / (1u << 30), d->major, d->minor);
}

int fsdp_cuda_usable_devices(const fsdp_cuda_module_t *module, fsdp_cuda_device_t *devices,
                             unsigned max, unsigned *ret_n, fsdp_status_t *st) {
  fsdp_cuda_device_t seen[FSDP_CUDA_DEVICES_MAX];
  unsigned n_seen = 0;
  int r = module->probe(seen, FSDP_CUDA_DEVICES_MAX, &n_seen, st);
  if (r < 0)
    return fsdp_status_set(st, r, "no usable GPU: %s", st->message);
  if (n_seen == 0)
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "no usable GPU: the CUDA runtime sees none");
  char why[FSDP_STATUS_MESSAGE_MAX] = "";
  size_t used = 0;
  unsigned n = 0;
  for (unsigned i = 0; i < n_seen; i++) {
    const fsdp_cuda_device_t *d = &seen[i];
    /* Trainers map the daemon's memory through file descriptors: nothing else will do. */
    const char *lacks = !d->virtual_memory ? "virtual memory management"
                        : !d->fd_export    ? "memory export as file descriptors"
                                           : NULL;
    if (!lacks) {
      if (n < max)
        devices[n++] = *d;
      continue;
    }
    char name[320];
    fsdp_cuda_device_format(d, name, sizeof name);
    if (used < sizeof why)
      used += (size_t)snprintf(why + used, sizeof why - used, "%s%s lacks %s", used ? "; " : "",
                               name, lacks);
  }
  if (n == 0)
    return fsdp_status_set(st, FSDP_E_UNAVAILABLE, "no usable GPU: %s", why);
  *ret_n = n;
  return 0;
}
