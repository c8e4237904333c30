/* fsdp_arena_t: a job's memory, one memfd (or a GPU's memory: options.backend) sub-allocated
 * by offset.
 *
 * Why: trainers on the host share the daemon's buffers (unsharded parameters, gradients,
 * shards) without copies and without names in /dev/shm. A job's memory is one anonymous
 * memfd (memfd_create), sized once to the job's limit, sealed so that nobody holding the
 * descriptor can shrink or grow it (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) and mapped
 * once by the daemon. So that no hot path faults a fresh page, its pages are pre-faulted:
 * all at creation (options.prefault), or, in an arena made without (FSDP_ARENA_PREFAULT_NONE,
 * as the store makes its arenas), range by range when its owner asks
 * (fsdp_arena_prefault_range: the data plane pre-faults a unit's buffers as it allocates
 * them). Trainers receive the descriptor over the unix socket (common/fdpass.h) and map it
 * once; what travels in messages are offsets into the arena.
 *
 * Pages: hugetlb 2 MiB pages when the operator reserved them (vm.nr_hugepages), else
 * 4 KiB shmem pages; fsdp_arena_get_stats() says which and, under AUTO, why not hugetlb.
 * The capacity is rounded up to a whole number of pages.
 *
 * Read-only sharing. Trainers map the unsharded buffers read-only. A PROT_READ mapping of
 * a read-write descriptor can be made writable with mprotect(), so read-only needs a
 * descriptor that cannot be upgraded. Two ways, both offered:
 *  - fsdp_arena_open_readonly(): a new O_RDONLY descriptor for the same memory (reopened
 *    through /proc/self/fd). mmap(PROT_WRITE, MAP_SHARED) and mprotect(PROT_WRITE) on it
 *    fail with EACCES. A receiver could reopen its own /proc/self/fd/N read-write; the
 *    arena's inode has mode 0400 owned by the daemon's user, which stops a trainer of
 *    another user (the intended deployment: trainers in the daemon's group), but not a
 *    trainer running as the daemon's own user (it can fchmod) or as root.
 *  - options.peers_read_only: the arena is sealed F_SEAL_FUTURE_WRITE right after the
 *    daemon's own writable mapping is made (and pre-faulted, when that is at creation).
 *    The kernel then refuses every new writable shared mapping and every write() through
 *    any descriptor (EPERM), root and reopened descriptors included, while the daemon keeps
 *    writing through its mapping. This is the airtight choice: put a job's read-only
 *    buffers (unsharded parameters) in one such arena and its trainer-writable buffers in
 *    another. Such an arena also hands out an O_RDONLY descriptor (fsdp_arena_peer_fd), so
 *    that the seal is not the only guard.
 *
 * Host memory. Whoever holds a descriptor or mapping can make pages resident: fallocate()
 * or writes through a writable one, read faults through any (shmem allocates a page on a
 * read fault too). The sizes are sealed (F_SEAL_SHRINK | F_SEAL_GROW), so an arena never
 * holds more than its capacity, whatever its holders do: the capacity is what a caller
 * must count against a memory limit, not the bytes allocated.
 *
 * Sub-allocation: best-fit over an offset-sorted block list with coalescing on release;
 * O(blocks) per call. Every block starts at a multiple of 64 bytes (a cache line: no false
 * sharing between buffers two ranks write) and its size is a multiple of 64. A block of at
 * least one page (by default) starts on a page boundary and is a whole number of pages, so
 * that a trainer can mmap exactly that block (mmap offsets are page-aligned; 2 MiB under
 * hugetlb) and no page is shared with a neighbour that has other access rights.
 * A released block is reused as it is: its pages stay populated (never MADV_DONTNEED) and
 * its contents are stale; the caller initializes what it allocates.
 *
 * Threads: fsdp_arena_new() blocks while it pre-faults the whole capacity (a few hundred
 * milliseconds per GiB here), so an arena pre-faulted at creation is made off the loop
 * thread and handed over. Made without pre-fault it is quick: the store makes its arenas on
 * the loop thread, and the data plane runs fsdp_arena_prefault_range on a worker. One
 * thread (the loop thread) owns an arena: alloc, release and stats are not synchronised.
 * The memory itself may be read and written by any thread or process; who writes which
 * block when is the caller's protocol.
 *
 * Lifetime: the creator frees the arena with fsdp_arena_free(); that unmaps the daemon's
 * view and closes its descriptors. The memory lives on while a trainer still holds a
 * mapping or a descriptor, so a trainer can never fault on freed memory; it is gone when
 * the last one goes. A read-write arena's pages are punched out at the free, so a holder
 * that outlives it keeps none of them (it reads zeros; what it faults in after is its own,
 * charged to its memory cgroup); a peers_read_only arena cannot be punched (the seal), and
 * a holder keeps its pages until it closes or unmaps. No logging: return codes and status
 * messages; the daemon logs.
 *
 * Names: fsdp_arena_new/fsdp_arena_free make and destroy the arena (the heap-object verbs
 * of STYLE.md); fsdp_arena_alloc/fsdp_arena_release take and give back a block, so that
 * "free" never means a block. */
#ifndef FSDP_ARENA_H
#define FSDP_ARENA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "daemon/backend/backend.h"

/* Every block's start and size are multiples of this. */
#define FSDP_ARENA_MIN_ALIGN 64
/* The largest page an arena uses (hugetlb): a capacity is rounded up to a multiple of at
 * most this. */
#define FSDP_ARENA_PAGE_MAX ((size_t)2 << 20)
/* Bytes of the name given to memfd_create ("fsdp-arena:<name>", shown in /proc/PID/maps). */
#define FSDP_ARENA_NAME_MAX 200

typedef struct fsdp_arena fsdp_arena_t;

typedef enum fsdp_arena_hugetlb {
  FSDP_ARENA_HUGETLB_AUTO = 0, /* hugetlb 2 MiB pages when the capacity is at least one huge
                                * page and enough are reserved; else 4 KiB, silently */
  FSDP_ARENA_HUGETLB_NEVER,    /* 4 KiB pages */
  FSDP_ARENA_HUGETLB_REQUIRE,  /* hugetlb or fail with RESOURCE_EXHAUSTED */
} fsdp_arena_hugetlb_t;

/* How the arena's pages are faulted in at creation. AUTO is the fastest measured here:
 * MADV_POPULATE_WRITE, or TOUCH on kernels before 5.14. MAP_POPULATE and TOUCH exist to
 * measure. */
typedef enum fsdp_arena_prefault {
  FSDP_ARENA_PREFAULT_AUTO = 0,
  FSDP_ARENA_PREFAULT_POPULATE_WRITE, /* madvise(MADV_POPULATE_WRITE) (Linux 5.14) */
  FSDP_ARENA_PREFAULT_MAP_POPULATE,   /* mmap(MAP_POPULATE): read faults, clean PTEs */
  FSDP_ARENA_PREFAULT_TOUCH,          /* write one byte per page */
  FSDP_ARENA_PREFAULT_NONE,           /* none at creation: the owner pre-faults ranges
                                       * as it allocates them (fsdp_arena_prefault_range);
                                       * the store's arenas */
} fsdp_arena_prefault_t;

typedef struct fsdp_arena_options {
  fsdp_arena_hugetlb_t hugetlb;
  fsdp_arena_prefault_t prefault;
  bool peers_read_only; /* seal F_SEAL_FUTURE_WRITE after the daemon's mapping is made */
  /* NULL or the host backend: a memfd. A GPU's backend: that GPU's memory instead
   * (fsdp_backend_memory_new), in one allocation exported as a file descriptor; hugetlb,
   * prefault and peers_read_only do not apply (the driver's memory is resident and zeroed
   * when made, and a trainer maps it with the access it asks for: the read-only mapping of
   * the unsharded buffers is the trainer library's, not enforced). Borrowed: it must
   * outlive the arena. */
  const fsdp_backend_t *backend;
  /* The setting that sized the capacity ("memory.job_limit"), named with the limit in an
   * allocation's RESOURCE_EXHAUSTED so that the reader knows what to raise; NULL: none.
   * Borrowed: a string that outlives the arena. */
  const char *capacity_key;
} fsdp_arena_options_t;

#define FSDP_ARENA_OPTIONS_INIT                                                              \
  {FSDP_ARENA_HUGETLB_AUTO, FSDP_ARENA_PREFAULT_AUTO, false, NULL, NULL}

typedef struct fsdp_arena_stats {
  size_t capacity;     /* bytes, a whole number of pages */
  size_t used;         /* bytes in allocated blocks (sizes as rounded by alloc) */
  size_t free;         /* capacity - used */
  size_t largest_free; /* the largest block an allocation could get, before alignment */
  size_t n_allocated;  /* blocks allocated */
  size_t n_free;       /* free blocks (fragments) */
  size_t page_size;    /* 4096, or 2 MiB under hugetlb */
  bool hugetlb;
  int hugetlb_error;   /* AUTO without hugetlb: why (-ENOMEM: none reserved; -EINVAL...);
                        * 0 when hugetlb is used, was not asked for or the arena is too small */
  fsdp_arena_prefault_t prefault; /* the method used (never AUTO) */
  uint64_t prefault_ns;           /* time the pre-fault took at creation */
  bool peers_read_only;
  int device; /* the CUDA device ordinal of its memory, -1 for host memory */
} fsdp_arena_stats_t;

/* Creates an arena of at least capacity bytes for the job called name (used in messages
 * and in the memfd's name; truncated to FSDP_ARENA_NAME_MAX bytes). options may be NULL
 * (defaults). Blocking: pre-faults every page, unless options->prefault is NONE. On success
 * *ret owns the arena.
 * Returns 0, or: FSDP_E_INVALID_ARGUMENT (capacity 0 or above 64 TiB),
 * FSDP_E_RESOURCE_EXHAUSTED (hugetlb required and not reserved), -ENOMEM (the pre-fault hit
 * a memory limit: MADV_POPULATE_WRITE reports it instead of a SIGBUS), or another -errno
 * from the step that failed; st names the job, the size and the step. */
int fsdp_arena_new(const char *name, size_t capacity, const fsdp_arena_options_t *options,
                   fsdp_arena_t **ret, fsdp_status_t *st);

/* Unmaps the daemon's view and closes the arena's descriptors; offsets handed out become
 * meaningless. Accepts NULL. Trainers' own mappings and descriptors stay valid; a
 * read-write arena's pages are punched out first (see Lifetime above). */
void fsdp_arena_free(fsdp_arena_t *arena);

/* Takes a block of at least size bytes and returns its offset from the arena's start.
 * align: 0 for the default (the page size when size >= the page size, else 64), or a
 * power of two (raised to 64 when smaller); the block's offset is a multiple of it.
 * size is rounded up to a multiple of 64, and to a whole number of pages when the block is
 * page-aligned and at least a page, so that it can be mapped on its own.
 * *ret_offset is written only on success.
 * Returns 0, or: FSDP_E_RESOURCE_EXHAUSTED when no free block fits, with a message such as
 * "job 'llama': need 64.0 MiB, 12.0 MiB free (largest block 8.0 MiB) of the 1.0 GiB limit";
 * FSDP_E_INVALID_ARGUMENT for size 0 or an align that is not a power of two; -ENOMEM when
 * the block list cannot grow. */
int fsdp_arena_alloc(fsdp_arena_t *arena, size_t size, size_t align, uint64_t *ret_offset,
                     fsdp_status_t *st);

/* Gives back the block that starts at offset; it coalesces with free neighbours and its
 * pages stay populated. Returns 0, or -EINVAL when no allocated block starts at offset
 * (released twice, or never allocated). */
int fsdp_arena_release(fsdp_arena_t *arena, uint64_t offset);

/* The size of the allocated block at offset (as rounded by alloc), or 0 when there is none. */
size_t fsdp_arena_block_size(const fsdp_arena_t *arena, uint64_t offset);

/* The arena's memfd (read-write, O_CLOEXEC); borrowed: valid until fsdp_arena_free(). Send
 * it with fsdp_fd_send(); the receiver's copy is its own. */
int fsdp_arena_fd(const fsdp_arena_t *arena);

/* The descriptor to send trainers: the read-write memfd, or for a peers_read_only arena an
 * O_RDONLY one (mapping it writable and fallocate() fail on it). Borrowed like
 * fsdp_arena_fd(). */
int fsdp_arena_peer_fd(const fsdp_arena_t *arena);

/* A new read-only descriptor (O_RDONLY | O_CLOEXEC) for the arena's memory; the caller owns
 * it (close it after sending). Returns 0 or -errno. */
int fsdp_arena_open_readonly(const fsdp_arena_t *arena, int *ret_fd);

/* Faults in the pages of [offset, offset + len), as creation does for the whole arena when
 * asked to: for an arena made without pre-fault, at buffer allocation, so that no hot path
 * faults a fresh page. Blocking, and it touches only memory, not the block list: call it
 * from a worker thread while the loop thread goes on. Returns 0 or -errno (-ENOMEM: a memory
 * limit was hit). */
int fsdp_arena_prefault_range(const fsdp_arena_t *arena, uint64_t offset, size_t len);

/* The daemon's read-write mapping of the whole arena; offset o is at base + o (a device
 * address for a GPU's arena). Borrowed. */
void *fsdp_arena_base(const fsdp_arena_t *arena);

void fsdp_arena_get_stats(const fsdp_arena_t *arena, fsdp_arena_stats_t *ret_stats);

/* "MADV_POPULATE_WRITE", "MAP_POPULATE", "touch", "none" (or "auto"). */
const char *fsdp_arena_prefault_name(fsdp_arena_prefault_t method);

#endif
