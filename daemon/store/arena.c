/* The per-job arena: a sealed memfd, pre-faulted at creation or range by range, and a
 * best-fit block list over it.
 *
 * The block list is one array sorted by offset whose blocks tile [0, capacity) exactly;
 * two free blocks are never neighbours (release merges them), so the list stays as short
 * as the allocation pattern allows and a free block's size is the largest run there.
 *
 * Pre-fault method, measured on this project's machines (2 vCPU VM, kernel 6.18, 4 KiB
 * shmem pages, 1 GiB memfd, median of 5): MADV_POPULATE_WRITE 0.35 s/GiB (~3.0 GB/s);
 * MAP_POPULATE 0.43 s/GiB, and it leaves clean read-faulted PTEs, so the first write pass
 * over the arena afterwards ran at 4.7 GB/s instead of 10 GB/s (the CPU sets each PTE's
 * dirty bit with an assist); touching one byte per page 0.47 s/GiB; fallocate() before
 * either changed nothing that mattered. MADV_POPULATE_WRITE is also the only method that
 * reports a memory limit as an error (-ENOMEM / -EFAULT) instead of a SIGBUS or an OOM
 * kill halfway through, so it is the default, with touching as the fallback for kernels
 * before 5.14. tests/unit/test_arena.c prints the figures for the machine it runs on. */
#include "daemon/store/arena.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/clock.h"

#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21U << 26) /* MFD_HUGE_SHIFT 26, log2(2 MiB) = 21 */
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif

#define SMALL_PAGE ((size_t)4096)
#define HUGE_PAGE FSDP_ARENA_PAGE_MAX
/* Far beyond any host's memory, and small enough that no offset arithmetic can overflow. */
#define CAPACITY_MAX ((size_t)1 << 46)

typedef struct block {
  uint64_t offset;
  uint64_t size;
  bool allocated;
} block_t;

struct fsdp_arena {
  char name[FSDP_ARENA_NAME_MAX + 1];
  const char *capacity_key; /* options->capacity_key, borrowed; NULL: none */
  int fd;
  int peer_fd; /* what trainers receive: fd, or an O_RDONLY one when peers_read_only */
  void *base; /* MAP_FAILED until mapped */
  size_t capacity;
  size_t page_size;
  bool hugetlb;
  int hugetlb_error;
  bool peers_read_only;
  fsdp_arena_prefault_t prefault;
  uint64_t prefault_ns;
  /* A GPU's arena: its backend and memory; fd is the memory's exported descriptor. */
  const fsdp_backend_t *backend;
  fsdp_backend_memory_t device_memory;

  block_t *blocks;
  size_t n_blocks;
  size_t cap_blocks;
  size_t used;
  size_t n_allocated;
};

static uint64_t align_up(uint64_t v, uint64_t align) {
  return (v + align - 1) & ~(align - 1);
}

/* "512 B", "8.0 KiB", "64.0 MiB", "1.0 GiB". */
static const char *format_size(char *buf, size_t len, uint64_t bytes) {
  static const char *const units[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) {
    snprintf(buf, len, "%" PRIu64 " B", bytes);
    return buf;
  }
  double v = (double)bytes / 1024;
  size_t u = 0;
  while (v >= 1024 && u + 1 < sizeof units / sizeof units[0]) {
    v /= 1024;
    u++;
  }
  snprintf(buf, len, "%.1f %s", v, units[u]);
  return buf;
}

const char *fsdp_arena_prefault_name(fsdp_arena_prefault_t method) {
  switch (method) {
  case FSDP_ARENA_PREFAULT_AUTO: return "auto";
  case FSDP_ARENA_PREFAULT_POPULATE_WRITE: return "MADV_POPULATE_WRITE";
  case FSDP_ARENA_PREFAULT_MAP_POPULATE: return "MAP_POPULATE";
  case FSDP_ARENA_PREFAULT_TOUCH: return "touch";
  case FSDP_ARENA_PREFAULT_NONE: return "none";
  }
  return "unknown";
}

static void unmap_and_close(fsdp_arena_t *arena) {
  if (arena->backend) {
    fsdp_backend_memory_free(arena->backend, &arena->device_memory);
    arena->base = MAP_FAILED;
    arena->fd = arena->peer_fd = -1;
    return;
  }
  if (arena->base != MAP_FAILED)
    munmap(arena->base, arena->capacity);
  arena->base = MAP_FAILED;
  if (arena->peer_fd >= 0 && arena->peer_fd != arena->fd)
    close(arena->peer_fd);
  arena->peer_fd = -1;
  if (arena->fd >= 0)
    close(arena->fd);
  arena->fd = -1;
}

static void touch_pages(volatile char *p, size_t len, size_t page) {
  for (size_t off = 0; off < len; off += page)
    p[off] = 0; /* the memory is fresh: zero is what it holds */
}

/* Makes the memfd of `size` bytes in pages of `page`, owner read only and sealed against
 * resizing. Returns NULL, or the call that failed (errno says why). */
static const char *create_memfd(fsdp_arena_t *arena, bool huge, size_t size, size_t page) {
  char memfd_name[FSDP_ARENA_NAME_MAX + 16];
  snprintf(memfd_name, sizeof memfd_name, "fsdp-arena:%s", arena->name);
  unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING | (huge ? MFD_HUGETLB | MFD_HUGE_2MB : 0);
  arena->fd = memfd_create(memfd_name, flags);
  if (arena->fd < 0)
    return "memfd_create";
  arena->capacity = size;
  arena->page_size = page;
  if (ftruncate(arena->fd, (off_t)size) < 0)
    return "ftruncate";
  /* Owner read only: a receiver of another user cannot reopen its descriptor read-write
   * through /proc (see fsdp_arena_open_readonly); descriptors already open keep their mode. */
  if (fchmod(arena->fd, 0400) < 0)
    return "fchmod";
  /* Before anyone else can hold the descriptor: a trainer must not shrink the memory
   * under the daemon's mapping (SIGBUS) nor grow it past the job's limit. */
  if (fcntl(arena->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0)
    return "F_ADD_SEALS";
  return NULL;
}

/* Maps the whole memfd read-write and faults its pages in as `method` says, recording the
 * method used and its time. Returns NULL, or the call that failed (errno says why). */
static const char *map_prefaulted(fsdp_arena_t *arena, bool huge, fsdp_arena_prefault_t method) {
  size_t size = arena->capacity;
  if (method == FSDP_ARENA_PREFAULT_AUTO)
    method = FSDP_ARENA_PREFAULT_POPULATE_WRITE;
  uint64_t t0 = fsdp_clock_now_ns();
  int mmap_flags = MAP_SHARED | (method == FSDP_ARENA_PREFAULT_MAP_POPULATE ? MAP_POPULATE : 0);
  /* A hugetlb mapping reserves its pages here, so a missing reservation fails now with
   * ENOMEM rather than later with SIGBUS on a fault. */
  arena->base = mmap(NULL, size, PROT_READ | PROT_WRITE, mmap_flags, arena->fd, 0);
  if (arena->base == MAP_FAILED)
    return "mmap";
  if (!huge)
    (void)madvise(arena->base, size, MADV_HUGEPAGE); /* used only if shmem THP is "advise" */
  if (method == FSDP_ARENA_PREFAULT_POPULATE_WRITE &&
      madvise(arena->base, size, MADV_POPULATE_WRITE) < 0) {
    if (errno != EINVAL)
      return "madvise(MADV_POPULATE_WRITE)";
    method = FSDP_ARENA_PREFAULT_TOUCH; /* a kernel before 5.14 */
  }
  if (method == FSDP_ARENA_PREFAULT_TOUCH)
    touch_pages(arena->base, size, arena->page_size);
  arena->prefault = method;
  arena->prefault_ns = fsdp_clock_now_ns() - t0;
  return NULL;
}

/* Makes, sizes, seals, maps and pre-faults the memfd with one kind of page. On failure
 * undoes its own steps and returns -errno with st saying which step failed. */
static int map_memfd(fsdp_arena_t *arena, size_t capacity, bool huge,
                     const fsdp_arena_options_t *opt, fsdp_status_t *st) {
  size_t page = huge ? HUGE_PAGE : SMALL_PAGE;
  size_t size = (size_t)align_up(capacity, page);
  const char *step;
  int r;
  if ((step = create_memfd(arena, huge, size, page)) ||
      (step = map_prefaulted(arena, huge, opt->prefault)))
    goto fail;
  unsigned seals = F_SEAL_SEAL; /* and no one adds seals later (F_SEAL_WRITE would block us) */
  if (opt->peers_read_only)
    seals |= F_SEAL_FUTURE_WRITE; /* our mapping exists and stays writable */
  if (fcntl(arena->fd, F_ADD_SEALS, seals) < 0) {
    step = "F_ADD_SEALS";
    goto fail;
  }
  arena->hugetlb = huge;
  arena->peers_read_only = opt->peers_read_only;
  return 0;

fail:
  r = -errno;
  unmap_and_close(arena);
  char cap[32];
  fsdp_status_set(st, r, "job '%s': cannot set up %s of %s memory: %s failed: %s", arena->name,
                  format_size(cap, sizeof cap, size), huge ? "hugetlb 2 MiB" : "4 KiB-page",
                  step, strerror(-r));
  return r;
}

static long hugepages_free(void) {
  FILE *f = fopen("/proc/meminfo", "re");
  if (!f)
    return -1;
  char line[128];
  long n = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "HugePages_Free: %ld", &n) == 1)
      break;
  fclose(f);
  return n;
}

/* A backend whose memory is not the host's makes the arena's: one allocation with its
 * exported descriptor, resident and zeroed when made, so there is nothing to pre-fault. */
static int use_backend_memory(fsdp_arena_t *arena, const fsdp_backend_t *backend,
                              size_t capacity, fsdp_status_t *st) {
  int r = fsdp_backend_memory_new(backend, capacity, &arena->device_memory, st);
  if (r < 0)
    return fsdp_status_set(st, r, "job '%s': %s", arena->name, st->message);
  arena->backend = backend;
  arena->base = arena->device_memory.base;
  arena->capacity = arena->device_memory.bytes;
  arena->page_size = arena->device_memory.page;
  arena->fd = arena->peer_fd = arena->device_memory.fd;
  arena->prefault = FSDP_ARENA_PREFAULT_NONE;
  return 0;
}

/* The host's memory: a memfd of hugetlb pages where asked and reserved, else of 4 KiB pages,
 * and the descriptor trainers receive. */
static int use_memfd(fsdp_arena_t *arena, size_t capacity, const fsdp_arena_options_t *opt,
                     fsdp_status_t *st) {
  bool try_huge = opt->hugetlb == FSDP_ARENA_HUGETLB_REQUIRE ||
                  (opt->hugetlb == FSDP_ARENA_HUGETLB_AUTO && capacity >= HUGE_PAGE);
  int r = -1;
  if (try_huge) {
    r = map_memfd(arena, capacity, true, opt, st);
    if (r < 0) {
      if (opt->hugetlb == FSDP_ARENA_HUGETLB_REQUIRE) {
        char cap[32];
        return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED,
                               "job '%s': hugetlb pages required for %s but not available "
                               "(HugePages_Free %ld of 2 MiB; see vm.nr_hugepages): %s",
                               arena->name,
                               format_size(cap, sizeof cap, align_up(capacity, HUGE_PAGE)),
                               hugepages_free(), strerror(-r));
      }
      /* AUTO: 4 KiB pages instead, and the reason kept for the daemon to report. */
      arena->hugetlb_error = r;
      if (st)
        fsdp_status_clear(st);
    }
  }
  if (r < 0 && (r = map_memfd(arena, capacity, false, opt, st)) < 0)
    return r;

  /* Trainers get a descriptor that cannot write either: the seal is not the only guard, and
   * fallocate() needs a writable one. */
  arena->peer_fd = arena->fd;
  if (opt->peers_read_only && (r = fsdp_arena_open_readonly(arena, &arena->peer_fd)) < 0)
    return fsdp_status_set(st, r, "job '%s': cannot open the arena read-only: %s", arena->name,
                           strerror(-r));
  return 0;
}

int fsdp_arena_new(const char *name, size_t capacity, const fsdp_arena_options_t *options,
                   fsdp_arena_t **ret, fsdp_status_t *st) {
  static const fsdp_arena_options_t defaults = FSDP_ARENA_OPTIONS_INIT;
  const fsdp_arena_options_t *opt = options ? options : &defaults;
  if (!name)
    name = "";
  if (capacity == 0 || capacity > CAPACITY_MAX) {
    char max[32];
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "job '%s': arena capacity %zu bytes, expected 1 B to %s", name,
                           capacity, format_size(max, sizeof max, CAPACITY_MAX));
  }

  fsdp_arena_t *arena = calloc(1, sizeof *arena);
  if (!arena)
    return fsdp_status_set(st, -ENOMEM, "job '%s': out of memory for the arena", name);
  arena->fd = arena->peer_fd = -1;
  arena->base = MAP_FAILED;
  snprintf(arena->name, sizeof arena->name, "%s", name);
  arena->capacity_key = opt->capacity_key;
  arena->cap_blocks = 16;
  arena->blocks = malloc(arena->cap_blocks * sizeof *arena->blocks);
  int r;
  if (!arena->blocks) {
    r = fsdp_status_set(st, -ENOMEM, "job '%s': out of memory for the arena", name);
    goto fail;
  }
  if (opt->backend && !fsdp_backend_memory_is_host(opt->backend))
    r = use_backend_memory(arena, opt->backend, capacity, st);
  else
    r = use_memfd(arena, capacity, opt, st);
  if (r < 0)
    goto fail;

  arena->blocks[0] = (block_t){.offset = 0, .size = arena->capacity, .allocated = false};
  arena->n_blocks = 1;
  *ret = arena;
  return 0;

fail:
  fsdp_arena_free(arena);
  return r;
}

void fsdp_arena_free(fsdp_arena_t *arena) {
  if (!arena)
    return;
  /* A trainer that still holds the descriptor or a mapping would otherwise keep every page
   * there, and they are not counted anywhere any more. The sealed arena refuses this
   * (F_SEAL_FUTURE_WRITE); its holders can only fault pages in by reading. */
  if (arena->fd >= 0 && !arena->peers_read_only && !arena->backend)
    (void)fallocate(arena->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                    (off_t)arena->capacity);
  unmap_and_close(arena);
  free(arena->blocks);
  free(arena);
}

static bool reserve_blocks(fsdp_arena_t *arena, size_t extra) {
  if (arena->n_blocks + extra <= arena->cap_blocks)
    return true;
  size_t cap = arena->cap_blocks * 2;
  while (cap < arena->n_blocks + extra)
    cap *= 2;
  block_t *b = realloc(arena->blocks, cap * sizeof *b);
  if (!b)
    return false;
  arena->blocks = b;
  arena->cap_blocks = cap;
  return true;
}

static uint64_t largest_free(const fsdp_arena_t *arena) {
  uint64_t best = 0;
  for (size_t i = 0; i < arena->n_blocks; i++)
    if (!arena->blocks[i].allocated && arena->blocks[i].size > best)
      best = arena->blocks[i].size;
  return best;
}

/* The RESOURCE_EXHAUSTED of a request of `need` bytes aligned to `align` that no free block
 * holds, with the numbers that say why and the setting to raise. */
static int no_block_fits(const fsdp_arena_t *arena, uint64_t need, size_t align,
                         fsdp_status_t *st) {
  char need_s[32], free_s[32], largest_s[32], cap_s[32], align_s[32];
  uint64_t largest = largest_free(arena);
  char aligned[64] = "";
  if (largest >= need) /* it is the alignment that does not fit: say so */
    snprintf(aligned, sizeof aligned, " aligned to %s",
             format_size(align_s, sizeof align_s, align));
  return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED,
                         "job '%s': need %s%s, %s free (largest block %s) of the %s limit%s%s%s",
                         arena->name, format_size(need_s, sizeof need_s, need), aligned,
                         format_size(free_s, sizeof free_s, arena->capacity - arena->used),
                         format_size(largest_s, sizeof largest_s, largest),
                         format_size(cap_s, sizeof cap_s, arena->capacity),
                         arena->capacity_key ? " (" : "",
                         arena->capacity_key ? arena->capacity_key : "",
                         arena->capacity_key ? ")" : "");
}

/* Splits free block `i` into [head free][`need` allocated at start][tail free]; the
 * neighbours of a free block are allocated, so the pieces need no merging. The block list
 * has room for two more. */
static void take_block(fsdp_arena_t *arena, size_t i, uint64_t start, uint64_t need) {
  block_t b = arena->blocks[i];
  uint64_t head = start - b.offset;
  uint64_t tail = b.offset + b.size - (start + need);
  block_t pieces[3];
  size_t n = 0;
  if (head > 0)
    pieces[n++] = (block_t){.offset = b.offset, .size = head, .allocated = false};
  pieces[n++] = (block_t){.offset = start, .size = need, .allocated = true};
  if (tail > 0)
    pieces[n++] = (block_t){.offset = start + need, .size = tail, .allocated = false};
  memmove(&arena->blocks[i + n], &arena->blocks[i + 1],
          (arena->n_blocks - i - 1) * sizeof(block_t));
  memcpy(&arena->blocks[i], pieces, n * sizeof(block_t));
  arena->n_blocks += n - 1;
  arena->used += need;
  arena->n_allocated++;
}

int fsdp_arena_alloc(fsdp_arena_t *arena, size_t size, size_t align, uint64_t *ret_offset,
                     fsdp_status_t *st) {
  if (size == 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "job '%s': allocation of 0 bytes, expected at least 1", arena->name);
  if (align != 0 && (align & (align - 1)) != 0)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "job '%s': alignment %zu is not a power of two", arena->name, align);

  /* Sizes beyond the capacity skip the rounding, which could overflow. */
  uint64_t need = size;
  if (size <= arena->capacity) {
    if (align == 0)
      align = size >= arena->page_size ? arena->page_size : FSDP_ARENA_MIN_ALIGN;
    if (align < FSDP_ARENA_MIN_ALIGN)
      align = FSDP_ARENA_MIN_ALIGN;
    need = align_up(size, align >= arena->page_size && size >= arena->page_size
                              ? arena->page_size
                              : FSDP_ARENA_MIN_ALIGN);
  }

  /* Best fit: the smallest free block that holds the aligned request; the lowest offset
   * among equals. Leaving big blocks whole is what keeps a long-lived job from fragmenting. */
  size_t best = SIZE_MAX;
  uint64_t best_start = 0;
  if (need <= arena->capacity && align <= arena->capacity) {
    for (size_t i = 0; i < arena->n_blocks; i++) {
      const block_t *b = &arena->blocks[i];
      if (b->allocated || b->size < need)
        continue;
      uint64_t start = align_up(b->offset, align);
      if (start + need > b->offset + b->size)
        continue;
      if (best == SIZE_MAX || b->size < arena->blocks[best].size) {
        best = i;
        best_start = start;
      }
    }
  }
  if (best == SIZE_MAX)
    return no_block_fits(arena, need, align, st);
  if (!reserve_blocks(arena, 2))
    return fsdp_status_set(st, -ENOMEM, "job '%s': out of memory for the block list",
                           arena->name);
  take_block(arena, best, best_start, need);
  *ret_offset = best_start;
  return 0;
}

/* The index of the block that starts at offset, or SIZE_MAX. */
static size_t find_block(const fsdp_arena_t *arena, uint64_t offset) {
  size_t lo = 0, hi = arena->n_blocks;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (arena->blocks[mid].offset < offset)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < arena->n_blocks && arena->blocks[lo].offset == offset ? lo : SIZE_MAX;
}

int fsdp_arena_release(fsdp_arena_t *arena, uint64_t offset) {
  size_t i = find_block(arena, offset);
  if (i == SIZE_MAX || !arena->blocks[i].allocated)
    return -EINVAL;
  block_t *b = arena->blocks;
  b[i].allocated = false;
  arena->used -= b[i].size;
  arena->n_allocated--;
  /* Merge with the next, then with the previous: at most two free neighbours. */
  size_t first = i, last = i;
  if (i + 1 < arena->n_blocks && !b[i + 1].allocated)
    last = i + 1;
  if (i > 0 && !b[i - 1].allocated)
    first = i - 1;
  if (last > first) {
    for (size_t j = first + 1; j <= last; j++)
      b[first].size += b[j].size;
    memmove(&b[first + 1], &b[last + 1], (arena->n_blocks - last - 1) * sizeof(block_t));
    arena->n_blocks -= last - first;
  }
  return 0;
}

size_t fsdp_arena_block_size(const fsdp_arena_t *arena, uint64_t offset) {
  size_t i = find_block(arena, offset);
  return i != SIZE_MAX && arena->blocks[i].allocated ? (size_t)arena->blocks[i].size : 0;
}

int fsdp_arena_fd(const fsdp_arena_t *arena) {
  return arena->fd;
}

int fsdp_arena_peer_fd(const fsdp_arena_t *arena) {
  return arena->peer_fd;
}

void *fsdp_arena_base(const fsdp_arena_t *arena) {
  return arena->base;
}

int fsdp_arena_open_readonly(const fsdp_arena_t *arena, int *ret_fd) {
  if (arena->backend)
    return -EOPNOTSUPP; /* the driver's descriptor has no access mode */
  /* Reopening the magic link opens the same memory afresh with the access mode asked for;
   * dup() would share the read-write open file. */
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", arena->fd);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return -errno;
  *ret_fd = fd;
  return 0;
}

int fsdp_arena_prefault_range(const fsdp_arena_t *arena, uint64_t offset, size_t len) {
  if (offset > arena->capacity || len > arena->capacity - offset)
    return -EINVAL;
  if (arena->backend)
    return 0; /* device memory is resident from the start */
  uint64_t begin = offset / arena->page_size * arena->page_size;
  size_t span = (size_t)(offset + len - begin);
  char *start = (char *)arena->base + begin;
  if (madvise(start, span, MADV_POPULATE_WRITE) == 0)
    return 0;
  if (errno != EINVAL)
    return -errno;
  touch_pages(start, span, arena->page_size); /* a kernel before 5.14 */
  return 0;
}

void fsdp_arena_get_stats(const fsdp_arena_t *arena, fsdp_arena_stats_t *ret_stats) {
  size_t n_free = 0;
  for (size_t i = 0; i < arena->n_blocks; i++)
    n_free += !arena->blocks[i].allocated;
  *ret_stats = (fsdp_arena_stats_t){
      .capacity = arena->capacity,
      .used = arena->used,
      .free = arena->capacity - arena->used,
      .largest_free = (size_t)largest_free(arena),
      .n_allocated = arena->n_allocated,
      .n_free = n_free,
      .page_size = arena->page_size,
      .hugetlb = arena->hugetlb,
      .hugetlb_error = arena->hugetlb_error,
      .prefault = arena->prefault,
      .prefault_ns = arena->prefault_ns,
      .peers_read_only = arena->peers_read_only,
      .device = arena->backend ? fsdp_backend_device(arena->backend) : -1,
  };
}
