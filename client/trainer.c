/* The trainer API (include/fsdp/fsdp_trainer.h) on the client's calls: a session, the memory
 * channel that hands over the job's arena, and unit handles whose views point into the
 * mapping. Protocol-level only: gRPC stays inside client.c, the wire inside proto/. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <fsdp/fsdp_trainer.h>
#include <fsdp/fsdp_version.h>

#include "client/client_rpc.h"
#include "client/device_memory.h"
#include "client/fastpath.h"
#include "common/clock.h"
#include "common/fdpass.h"
#include "fsdp/v1/channel.pb-c.h"
#include "fsdp/v1/operator.pb-c.h"
#include "fsdp/v1/trainer.pb-c.h"
#include "proto/limits.h"
#include "proto/wire.h"

#define TRAINER_PATH(method) "/fsdp.v1.Trainer/" method

/* One unit operation: its name for messages, its gRPC method and fast path kind. */
typedef struct op_kind {
  const char *name; /* "Unshard", "Reshard", "ReduceScatter" */
  const char *path;
  fsdp_fast_kind_t fast;
} op_kind_t;

/* An address range reserved for a unit's lent buffer, and which buffer it maps: the offset in
 * memory 0 (the arena) or 1 (the unsharded buffers); memory -1: none. Accessible only while
 * lent. In a GPU's memory there is no such range: the driver maps an imported allocation only
 * whole, so a lent buffer is where it lies in the memory's one mapping (base is that). */
typedef struct lent_area {
  uint8_t *base;
  int memory;      /* of the buffer mapped there, -1 for none */
  uint64_t offset;
  int prot;        /* its protection now */
} lent_area_t;

struct fsdp_unit_handle {
  fsdp_trainer_t *trainer; /* the owner: a handle of another trainer is a bad argument */
  char *name;
  fsdp_strategy_t strategy;
  uint64_t *param_offsets;
  size_t param_size; /* bytes of a param_type element */
  fsdp_unit_view_t view;
  /* Where the lent buffers appear: address ranges reserved for the unit's life (area_bytes
   * each, PROT_NONE while nothing is lent), onto which the buffer the daemon lends is mapped
   * at each Unshard. A pointer taken once (a tensor autograd saved in the forward) thus
   * stays valid across a Reshard and the backward's Unshard, whichever pool buffer that
   * lends, and reading after a Reshard faults instead of reading another unit's data. Host
   * memory only: on a GPU the view points at the lent buffer itself, wherever it lies. */
  lent_area_t unsharded_area, grad_area;
  size_t area_bytes;
  uint32_t id; /* the daemon's number for it, which fast path requests name */
  /* The operation of fsdp_trainer_unshard_start or fsdp_trainer_reduce_scatter_start, until
   * waited for: a gRPC call, or a fast path request (started_seq). */
  fsdp_client_started_t *started;
  uint64_t started_seq;
  op_kind_t started_kind;
  uint64_t started_step;
  bool started_backward; /* to send it again over gRPC */
  unsigned started_reduce_flags;
};

struct fsdp_trainer {
  fsdp_client_t *client; /* borrowed */
  uint64_t session_id;
  char job[FSDP_JOB_NAME_MAX + 1];
  unsigned local_rank, local_world_size;
  int channel_fd; /* the session's lifeline: open until detach */
  void *memory;   /* the job's arena (memory 0, read-write), or NULL */
  size_t memory_size;
  const void *shared;  /* its unsharded buffers (memory 1, read-only), or NULL */
  size_t shared_size;
  int memory_fd, shared_fd; /* kept to map lent buffers into the units' areas */
  size_t page_bytes;        /* the larger of the two memories' pages */
  /* -1: the memories are host memory; else the CUDA device whose memory they are, imported
   * and mapped whole here (no descriptors kept: a lent buffer is an offset in a mapping). */
  int device;
  fsdp_device_memory_t device_memory[2];
  /* FSDP_FENCES=1: a buffer given back is made inaccessible (PROT_NONE) at once, so that a
   * read of it after its Reshard or ReduceScatter faults. A debugging aid, off by default:
   * each fence is a page-table walk of the whole unit and a TLB shootdown across the
   * process's threads, a fifth of the CPU of a 64 MiB reduce-scatter. */
  bool fences;
  fsdp_unit_handle_t **units;
  size_t n_units, units_cap;
  /* Unit operations through shared memory (client/fastpath.h), where the daemon offers it
   * and FSDP_FAST_PATH is not "off"; NULL: over gRPC. */
  fsdp_fast_client_t *fast;
  /* A job on a GPU: the session's events (ChannelWelcome.cuda_events), opened unless
   * FSDP_CUDA_EVENTS is "off", recorded in turn on cuda_stream before each unit operation
   * once fsdp_trainer_set_cuda_stream named it. */
  void *cuda_events[FSDP_SESSION_CUDA_EVENTS];
  unsigned n_cuda_events, next_cuda_event;
  void *cuda_stream;
  bool cuda_stream_set;
};

static size_t scalar_bytes(fsdp_scalar_t type) {
  return type == FSDP_SCALAR_BF16 || type == FSDP_SCALAR_FP16 ? 2 : 4;
}

/* A GPU memory's one mapping, at `base` (reserved for the memory's whole size). */
static void device_mapping_free(fsdp_device_memory_t *memory, void *base) {
  if (base)
    fsdp_device_unmap(memory, base, memory->bytes);
  fsdp_device_unreserve(base, memory->bytes);
  fsdp_device_memory_release(memory);
}

static void unit_free(fsdp_unit_handle_t *unit) {
  if (!unit)
    return;
  fsdp_client_call_cancel(unit->trainer->client, unit->started);
  if (unit->started_seq)
    fsdp_fast_client_cancel(unit->trainer->fast, unit->started_seq);
  if (unit->trainer->device < 0 && unit->unsharded_area.base)
    munmap(unit->unsharded_area.base, unit->area_bytes);
  if (unit->trainer->device < 0 && unit->grad_area.base)
    munmap(unit->grad_area.base, unit->area_bytes);
  free(unit->param_offsets);
  free(unit->name);
  free(unit);
}

/* Before the Detach, or the channel's end, that frees the daemon's side of them. */
static void close_cuda_events(fsdp_trainer_t *t) {
  for (unsigned i = 0; i < t->n_cuda_events; i++)
    fsdp_device_event_close(t->cuda_events[i]);
  t->n_cuda_events = 0;
}

static void trainer_free(fsdp_trainer_t *t) {
  for (size_t i = 0; i < t->n_units; i++)
    unit_free(t->units[i]);
  free(t->units);
  fsdp_fast_client_close(t->fast);
  close_cuda_events(t);
  if (t->channel_fd >= 0)
    close(t->channel_fd);
  if (t->device >= 0) {
    device_mapping_free(&t->device_memory[0], t->memory);
    device_mapping_free(&t->device_memory[1], (void *)(uintptr_t)t->shared);
  } else {
    if (t->memory)
      munmap(t->memory, t->memory_size);
    if (t->shared)
      munmap((void *)t->shared, t->shared_size);
  }
  if (t->memory_fd >= 0)
    close(t->memory_fd);
  if (t->shared_fd >= 0)
    close(t->shared_fd);
  free(t);
}

/* Ends the session after a failed attach, keeping the failure's code and message. */
static int detach_after_failure(fsdp_trainer_t *t, int code) {
  char why[1024];
  snprintf(why, sizeof why, "%s", fsdp_client_last_error(t->client));
  close_cuda_events(t);
  Fsdp__V1__DetachRequest rq = FSDP__V1__DETACH_REQUEST__INIT;
  rq.session_id = t->session_id;
  ProtobufCMessage *reply = NULL;
  if (fsdp_client_call(t->client, TRAINER_PATH("Detach"), &rq.base,
                       &fsdp__v1__detach_reply__descriptor, 0, &reply) == 0)
    protobuf_c_message_free_unpacked(reply, NULL);
  return fsdp_client_set_last_error(t->client, code, "%s", why);
}

/* Connects to the memory channel. A unix connect does not wait for the daemon to accept,
 * but a full backlog makes it fail with EAGAIN; it is retried until the deadline. */
static int channel_connect(fsdp_trainer_t *t, const char *path, int64_t deadline) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  size_t len = strlen(path);
  if (len == 0 || len >= sizeof addr.sun_path)
    return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                      "Attach: memory_socket '%.200s' is not a unix socket path "
                                      "of 1 to %zu bytes",
                                      path, sizeof addr.sun_path - 1);
  memcpy(addr.sun_path, path, len + 1);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return fsdp_client_set_last_error(t->client, -errno, "memory channel: socket: %s",
                                      strerror(errno));
  for (;;) {
    if (connect(fd, (const struct sockaddr *)&addr, sizeof addr) == 0)
      break;
    int e = errno;
    if (e == EINTR)
      continue;
    if (e == EAGAIN && fsdp_clock_left_ms(deadline) > 0) {
      poll(NULL, 0, 1);
      continue;
    }
    if (e == EINPROGRESS) {
      struct pollfd p = {.fd = fd, .events = POLLOUT};
      int n = poll(&p, 1, fsdp_clock_left_ms(deadline));
      socklen_t elen = sizeof e;
      if (n == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &elen) == 0 && e == 0)
        break;
      if (n == 0)
        e = ETIMEDOUT;
    }
    close(fd);
    if (e == EAGAIN || e == ETIMEDOUT)
      return fsdp_client_set_last_error(t->client, FSDP_E_DEADLINE_EXCEEDED,
                                        "memory channel %s: the daemon's backlog stayed full "
                                        "until the deadline",
                                        path);
    return fsdp_client_set_last_error(t->client, -e, "memory channel %s: connect: %s", path,
                                      strerror(e));
  }
  t->channel_fd = fd;
  return 0;
}

static int channel_io_error(fsdp_trainer_t *t, const char *path, const char *what, int r,
                            int timeout_ms) {
  if (r == -ETIMEDOUT)
    return fsdp_client_set_last_error(t->client, FSDP_E_DEADLINE_EXCEEDED,
                                      "memory channel %s: %s did not complete within %d ms",
                                      path, what, timeout_ms);
  return fsdp_client_set_last_error(t->client, r, "memory channel %s: %s: %s", path, what,
                                    strerror(-r));
}

/* Imports memory i, a GPU's, and maps it whole. */
static int map_device_memory(fsdp_trainer_t *t, const Fsdp__V1__ChannelMemory *m, int fd,
                             size_t i, bool writable, void **ret_base, size_t *ret_size) {
  fsdp_status_t st;
  fsdp_device_memory_t *dm = &t->device_memory[i];
  void *base = NULL;
  int r = fsdp_device_memory_import(fd, (size_t)m->bytes, t->device, dm, &st);
  if (r == 0 && (r = fsdp_device_reserve(dm, &base, &st)) == 0 &&
      (r = fsdp_device_map(dm, base, writable, &st)) < 0) {
    fsdp_device_unreserve(base, dm->bytes);
    base = NULL;
  }
  if (r < 0) {
    device_mapping_free(dm, NULL);
    return fsdp_client_set_last_error(t->client, r, "memory channel: mapping %s: %s", m->name,
                                      st.message);
  }
  *ret_base = base;
  *ret_size = dm->bytes;
  return 0;
}

/* Maps memory i of the welcome, writable or not as it says it must be. */
static int map_memory(fsdp_trainer_t *t, const char *path, const Fsdp__V1__ChannelWelcome *w,
                      const int *fds, size_t i, bool writable, void **ret_base,
                      size_t *ret_size) {
  const Fsdp__V1__ChannelMemory *m = w->memories[i];
  if (m->writable != writable || m->bytes == 0 || m->bytes > SIZE_MAX / 2)
    return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                      "memory channel %s: memory %zu '%s' of %llu bytes is %s, "
                                      "expected the job's %s",
                                      path, i, m->name, (unsigned long long)m->bytes,
                                      m->writable ? "writable" : "read-only",
                                      writable ? "writable arena" : "read-only unsharded buffers");
  if (m->device != (uint32_t)(t->device + 1))
    return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                      "memory channel %s: memory %zu '%s' has device %u, memory 0 "
                                      "%d: a job's memories are on one device",
                                      path, i, m->name, m->device, t->device + 1);
  if (t->device >= 0)
    return map_device_memory(t, m, fds[i], i, writable, ret_base, ret_size);
  void *p = mmap(NULL, (size_t)m->bytes, writable ? PROT_READ | PROT_WRITE : PROT_READ,
                 MAP_SHARED, fds[i], 0);
  if (p == MAP_FAILED)
    return fsdp_client_set_last_error(t->client, -errno,
                                      "memory channel: mapping %s (%llu bytes): %s", m->name,
                                      (unsigned long long)m->bytes, strerror(errno));
  *ret_base = p;
  *ret_size = (size_t)m->bytes;
  return 0;
}

/* Maps the welcome's memories: 0, the job's arena (read-write); 1, its unsharded buffers,
 * which the daemon sealed so that they can only be mapped read-only. */
static int map_arena(fsdp_trainer_t *t, const char *path, const Fsdp__V1__ChannelWelcome *w,
                     const int *fds, size_t n_fds) {
  size_t memories = w->fast_path ? 3 : 2, descriptors = w->fast_path ? 5 : 2;
  if (w->n_memories != memories || n_fds != descriptors ||
      (w->fast_path && w->fast_path->memory != 2))
    return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                      "memory channel %s: welcome lists %zu memories with %zu "
                                      "descriptors, expected %zu and %zu",
                                      path, w->n_memories, n_fds, memories, descriptors);
  void *shared;
  t->device = (int)w->memories[0]->device - 1;
  int r = map_memory(t, path, w, fds, 0, true, &t->memory, &t->memory_size);
  if (r == 0 && (r = map_memory(t, path, w, fds, 1, false, &shared, &t->shared_size)) == 0)
    t->shared = shared;
  if (r < 0)
    return r;
  if (t->device >= 0) { /* lent buffers are offsets in the mappings: the descriptors can go */
    t->page_bytes = t->device_memory[0].page;
    return 0;
  }
  /* Lent buffers start on their arena's pages (hugetlb ones are 2 MiB): the block size a
   * memfd reports. */
  t->page_bytes = (size_t)sysconf(_SC_PAGESIZE);
  for (size_t i = 0; i < 2; i++) {
    struct stat sb;
    if (fstat(fds[i], &sb) == 0 && (size_t)sb.st_blksize > t->page_bytes)
      t->page_bytes = (size_t)sb.st_blksize;
  }
  t->memory_fd = fds[0];
  t->shared_fd = fds[1];
  return 0;
}

/* Takes the fast path the welcome offers (memory 2 and the two doorbells after it), unless
 * FSDP_FAST_PATH=off asks for gRPC; *taken says whether its descriptors are now the fast
 * path's. A fast path of another version is left unused: gRPC serves the same. */
static int open_fast_path(fsdp_trainer_t *t, const Fsdp__V1__ChannelWelcome *w, const int *fds,
                          bool *taken) {
  const char *setting = getenv("FSDP_FAST_PATH");
  *taken = false;
  if (!w->fast_path || w->fast_path->version != FSDP_FASTPATH_VERSION ||
      (setting && strcmp(setting, "off") == 0))
    return 0;
  *taken = true;
  /* Spinning for a reply pays only with a CPU to spare: where the job's ranks on this host
   * outnumber the CPUs, the CPU a rank spins on is one another rank needs. */
  bool spin = t->local_world_size <= (unsigned long)sysconf(_SC_NPROCESSORS_ONLN);
  int r = fsdp_fast_client_open(fds[2], (size_t)w->memories[2]->bytes, fds[3], fds[4],
                                t->channel_fd, spin, &t->fast);
  if (r < 0)
    return fsdp_client_set_last_error(t->client, r, "memory channel: the fast path: %s",
                                      fsdp_strerror(r));
  return 0;
}

/* Opens the session's events that the welcome of a job on a GPU carries, unless
 * FSDP_CUDA_EVENTS=off asks the trainer to synchronize its device before each call instead
 * (what fsdpd.torch then does; the bench compares both). */
static bool cuda_events_off(void) {
  const char *setting = getenv("FSDP_CUDA_EVENTS");
  return setting && strcmp(setting, "off") == 0;
}

static int open_cuda_events(fsdp_trainer_t *t, const char *path,
                            const Fsdp__V1__ChannelWelcome *w) {
  if (t->device < 0 || cuda_events_off())
    return 0;
  if (w->n_cuda_events > FSDP_SESSION_CUDA_EVENTS)
    return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                      "memory channel %s: welcome lists %zu CUDA events, at "
                                      "most %d expected", path, w->n_cuda_events,
                                      FSDP_SESSION_CUDA_EVENTS);
  for (size_t i = 0; i < w->n_cuda_events; i++) {
    fsdp_status_t st = FSDP_STATUS_INIT;
    int r = w->cuda_events[i].len != FSDP_CUDA_IPC_EVENT_BYTES
                ? fsdp_status_set(&st, FSDP_E_INTERNAL, "its handle is %zu bytes, not %d",
                                  w->cuda_events[i].len, FSDP_CUDA_IPC_EVENT_BYTES)
                : fsdp_device_event_open(t->device, w->cuda_events[i].data,
                                         &t->cuda_events[i], &st);
    if (r < 0)
      return fsdp_client_set_last_error(t->client, r, "memory channel %s: CUDA event %zu: %s",
                                        path, i, st.message);
    t->n_cuda_events = (unsigned)i + 1;
  }
  return 0;
}

/* The memory channel (proto/fsdp/v1/channel.proto): hello, welcome with the arena's
 * descriptor, mapping. Sets *ret_detach to false when the session must not be detached on
 * failure: ALREADY_EXISTS means another trainer of this process holds it with its channel. */
static int channel_open(fsdp_trainer_t *t, const char *path, bool *ret_detach) {
  int timeout_ms = fsdp_client_default_timeout_ms(t->client);
  int64_t deadline = fsdp_clock_deadline_ms(timeout_ms);
  *ret_detach = true;
  int r = channel_connect(t, path, deadline);
  if (r < 0)
    return r;

  uint8_t frame[FSDP_CHANNEL_FRAME_BYTES];
  Fsdp__V1__ChannelHello hello = FSDP__V1__CHANNEL_HELLO__INIT;
  hello.protocol_version = FSDP_PROTOCOL_VERSION;
  hello.session_id = t->session_id;
  if ((r = fsdp_wire_frame_encode(&hello.base, frame)) < 0)
    return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                      "memory channel: could not encode the hello (%d)", r);
  if ((r = fsdp_fd_send(t->channel_fd, NULL, 0, frame, sizeof frame,
                        fsdp_clock_left_ms(deadline))) < 0)
    return channel_io_error(t, path, "sending the hello", r, timeout_ms);

  int fds[FSDP_FD_MAX];
  size_t n_fds = 0;
  r = fsdp_fd_recv(t->channel_fd, frame, sizeof frame, FSDP_FD_MAX,
                   fsdp_clock_left_ms(deadline), fds, &n_fds);
  if (r < 0)
    return channel_io_error(t, path, "waiting for the welcome", r, timeout_ms);

  Fsdp__V1__ChannelWelcome *w = NULL;
  fsdp_status_t st = FSDP_STATUS_INIT;
  if (fsdp_wire_frame_decode(&fsdp__v1__channel_welcome__descriptor, frame, sizeof frame,
                             (ProtobufCMessage **)&w, &st) < 0) {
    r = fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL, "memory channel %s: %s", path,
                                   st.message);
  } else if (w->status != 0) {
    /* The channel carries a gRPC status code, converted here like an RPC's. */
    r = fsdp_wire_error_from_status((grpc_status_code)w->status);
    *ret_detach = r != FSDP_E_ALREADY_EXISTS;
    fsdp_client_set_last_error(t->client, r, "%s", *w->message ? w->message : fsdp_strerror(r));
  } else {
    r = map_arena(t, path, w, fds, n_fds);
  }
  bool fast_taken = false;
  if (r == 0)
    r = open_fast_path(t, w, fds, &fast_taken);
  if (r == 0)
    r = open_cuda_events(t, path, w);
  /* The trainer keeps the two it maps lent buffers from, and the fast path its own. */
  for (size_t i = 0; i < n_fds; i++)
    if (fds[i] != t->memory_fd && fds[i] != t->shared_fd && !(fast_taken && i >= 2))
      close(fds[i]);
  if (w)
    protobuf_c_message_free_unpacked(&w->base, NULL);
  return r;
}

int fsdp_trainer_attach(fsdp_client_t *client, const fsdp_trainer_options_t *opts,
                        fsdp_trainer_t **ret_trainer) {
  if (!client)
    return -EINVAL;
  if (!opts || !ret_trainer)
    return fsdp_client_set_last_error(client, -EINVAL,
                                      "fsdp_trainer_attach: options and ret_trainer are required");
  if (!opts->job || !*opts->job)
    return fsdp_client_set_last_error(client, -EINVAL, "fsdp_trainer_attach: the job is empty");
  if (opts->local_rank >= opts->local_world_size)
    return fsdp_client_set_last_error(client, -EINVAL,
                                      "fsdp_trainer_attach: local_rank %u is outside [0, %u) "
                                      "(local_world_size)",
                                      opts->local_rank, opts->local_world_size);

  fsdp_trainer_t *t = calloc(1, sizeof *t);
  if (!t)
    return fsdp_client_set_last_error(client, -ENOMEM, "fsdp_trainer_attach: out of memory");
  t->client = client;
  t->local_rank = opts->local_rank;
  t->local_world_size = opts->local_world_size;
  snprintf(t->job, sizeof t->job, "%s", opts->job);
  t->channel_fd = t->memory_fd = t->shared_fd = -1;
  t->device = -1;
  const char *fences = getenv("FSDP_FENCES");
  t->fences = fences && strcmp(fences, "1") == 0;
  bool detach = true;

  /* The daemon checks the job name, so that its message (and its one rule) is what users see. */
  Fsdp__V1__AttachRequest rq = FSDP__V1__ATTACH_REQUEST__INIT;
  rq.protocol_version = FSDP_PROTOCOL_VERSION;
  rq.job = (char *)opts->job;
  rq.local_rank = opts->local_rank;
  rq.local_world_size = opts->local_world_size;
  rq.generation = opts->generation;
  rq.job_token = (char *)(opts->job_token ? opts->job_token : "");
  Fsdp__V1__Launcher launcher = FSDP__V1__LAUNCHER__INIT;
  if (opts->world_size) {
    launcher.world_size = opts->world_size;
    launcher.node_rank = opts->node_rank;
    rq.launcher = &launcher;
  }
  rq.pid = (int32_t)getpid();
  ProtobufCMessage *reply = NULL;
  int r = fsdp_client_call(client, TRAINER_PATH("Attach"), &rq.base,
                           &fsdp__v1__attach_reply__descriptor, 0, &reply);
  if (r < 0)
    goto err_trainer;
  const Fsdp__V1__AttachReply *a = (const void *)reply;
  t->session_id = a->session_id;
  if (a->protocol_version != FSDP_PROTOCOL_VERSION)
    r = fsdp_client_set_last_error(client, FSDP_E_PROTOCOL_VERSION,
                                   "Attach: the daemon answered with protocol %u, this library "
                                   "speaks %u",
                                   a->protocol_version, FSDP_PROTOCOL_VERSION);
  else
    r = channel_open(t, a->memory_socket, &detach);
  protobuf_c_message_free_unpacked(reply, NULL);
  if (r < 0)
    goto err_session;
  *ret_trainer = t;
  return 0;

err_session:
  /* Before the channel closes: its end would end the session too, and Detach then fail. */
  if (detach)
    detach_after_failure(t, r);
err_trainer:
  trainer_free(t);
  return r;
}

int fsdp_trainer_detach(fsdp_trainer_t *trainer) {
  if (!trainer)
    return 0;
  /* Started calls first: the Detach below ends the session they name. */
  for (size_t i = 0; i < trainer->n_units; i++) {
    fsdp_unit_handle_t *u = trainer->units[i];
    fsdp_client_call_cancel(trainer->client, u->started);
    u->started = NULL;
    if (u->started_seq)
      fsdp_fast_client_cancel(trainer->fast, u->started_seq);
    u->started_seq = 0;
  }
  close_cuda_events(trainer);
  Fsdp__V1__DetachRequest rq = FSDP__V1__DETACH_REQUEST__INIT;
  rq.session_id = trainer->session_id;
  ProtobufCMessage *reply = NULL;
  int r = fsdp_client_call(trainer->client, TRAINER_PATH("Detach"), &rq.base,
                           &fsdp__v1__detach_reply__descriptor, 0, &reply);
  if (r == 0)
    protobuf_c_message_free_unpacked(reply, NULL);
  trainer_free(trainer);
  return r;
}

uint64_t fsdp_trainer_session_id(const fsdp_trainer_t *trainer) {
  return trainer ? trainer->session_id : 0;
}

int fsdp_trainer_memory_device(const fsdp_trainer_t *trainer) {
  return trainer ? trainer->device : -1;
}

int fsdp_trainer_set_cuda_stream(fsdp_trainer_t *trainer, void *stream) {
  if (!trainer)
    return -EINVAL;
  if (trainer->n_cuda_events == 0) {
    const char *why = trainer->device < 0 ? "its job's memory is the host's"
                      : cuda_events_off() ? "FSDP_CUDA_EVENTS is off"
                                                  : "the daemon sent none";
    return fsdp_client_set_last_error(trainer->client, FSDP_E_FAILED_PRECONDITION,
                                      "the session has no CUDA events: %s", why);
  }
  trainer->cuda_stream = stream;
  trainer->cuda_stream_set = true;
  return 0;
}

void *fsdp_trainer_memory(const fsdp_trainer_t *trainer, size_t *ret_size) {
  if (!trainer)
    return NULL;
  if (ret_size)
    *ret_size = trainer->memory_size;
  return trainer->memory;
}

int fsdp_trainer_keepalive(fsdp_trainer_t *trainer) {
  if (!trainer)
    return -EINVAL;
  Fsdp__V1__KeepAliveRequest rq = FSDP__V1__KEEP_ALIVE_REQUEST__INIT;
  rq.session_id = trainer->session_id;
  ProtobufCMessage *reply = NULL;
  int r = fsdp_client_call(trainer->client, TRAINER_PATH("KeepAlive"), &rq.base,
                           &fsdp__v1__keep_alive_reply__descriptor, 0, &reply);
  if (r == 0)
    protobuf_c_message_free_unpacked(reply, NULL);
  return r;
}

/* The daemon's limits on a unit (proto/limits.h), checked here too so that a descriptor that
 * cannot be right fails with -EINVAL before anything is encoded. The daemon checks the whole
 * spec again and is the authority. */
static int check_unit_desc(fsdp_client_t *client, const fsdp_unit_desc_t *d) {
  if (!d->name || !*d->name)
    return fsdp_client_set_last_error(client, -EINVAL, "fsdp_trainer_register_unit: the unit "
                                                       "name is empty");
  if (d->n_params == 0 || d->n_params > FSDP_UNIT_MAX_PARAMS || !d->params)
    return fsdp_client_set_last_error(client, -EINVAL,
                                      "fsdp_trainer_register_unit: unit '%.256s' has %zu "
                                      "parameters, expected 1 to %d",
                                      d->name, d->params ? d->n_params : 0, FSDP_UNIT_MAX_PARAMS);
  if (d->strategy < FSDP_FULL_SHARD || d->strategy > FSDP_NO_SHARD ||
      d->param_type < FSDP_SCALAR_DEFAULT || d->param_type > FSDP_SCALAR_FP16 ||
      d->reduce_type < FSDP_SCALAR_DEFAULT || d->reduce_type > FSDP_SCALAR_FP16 ||
      d->layout < FSDP_LAYOUT_FLAT || d->layout > FSDP_LAYOUT_PER_PARAM)
    return fsdp_client_set_last_error(client, -EINVAL,
                                      "fsdp_trainer_register_unit: unit '%.256s': strategy %d, "
                                      "param_type %d, reduce_type %d or layout %d is not one of "
                                      "the enum's",
                                      d->name, (int)d->strategy, (int)d->param_type,
                                      (int)d->reduce_type, (int)d->layout);
  for (size_t i = 0; i < d->n_params; i++) {
    const fsdp_param_desc_t *p = &d->params[i];
    if (!p->name || (p->ndim && !p->shape) || p->ndim > FSDP_UNIT_MAX_DIMS)
      return fsdp_client_set_last_error(client, -EINVAL,
                                        "fsdp_trainer_register_unit: unit '%.256s' params[%zu]: "
                                        "a name, and a shape of 0 to %d sizes, are required",
                                        d->name, i, FSDP_UNIT_MAX_DIMS);
  }
  return 0;
}

/* A buffer of the reply must lie inside its mapping (of `size` bytes), aligned for its
 * elements: the views hand out typed pointers into it. */
static int check_buffer(fsdp_trainer_t *t, const char *call, const char *unit, const char *what,
                        uint64_t offset, uint64_t numel, size_t elem, size_t size) {
  uint64_t bytes;
  if (offset % elem == 0 && !__builtin_mul_overflow(numel, (uint64_t)elem, &bytes) &&
      offset <= size && bytes <= size - offset)
    return 0;
  return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                    "%s of unit '%.256s': the %s buffer at offset %llu, %llu "
                                    "elements of %zu bytes, does not fit the %zu-byte mapping",
                                    call, unit, what, (unsigned long long)offset,
                                    (unsigned long long)numel, elem, size);
}

static int check_layout(fsdp_trainer_t *t, const fsdp_unit_desc_t *d,
                        const Fsdp__V1__RegisterUnitReply *l) {
  if (l->n_param_offsets != d->n_params || l->numel == 0 || l->padded_numel < l->numel ||
      l->shard_numel == 0 || l->padded_numel % l->shard_numel != 0 ||
      l->shard >= l->padded_numel / l->shard_numel || l->host_shards == 0 ||
      l->shard < l->host_first_shard || l->shard - l->host_first_shard >= l->host_shards ||
      (uint64_t)l->host_first_shard + l->host_shards > l->padded_numel / l->shard_numel)
    return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                      "RegisterUnit of unit '%.256s': inconsistent layout "
                                      "(%zu offsets for %zu params, numel %llu, padded %llu, "
                                      "shard %u of %llu elements)",
                                      d->name, l->n_param_offsets, d->n_params,
                                      (unsigned long long)l->numel,
                                      (unsigned long long)l->padded_numel, l->shard,
                                      (unsigned long long)l->shard_numel);
  for (size_t i = 0; i < l->n_param_offsets; i++)
    if (l->param_offsets[i] > l->numel)
      return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                        "RegisterUnit of unit '%.256s': params[%zu] at element "
                                        "%llu, past the unit's %llu",
                                        d->name, i, (unsigned long long)l->param_offsets[i],
                                        (unsigned long long)l->numel);
  size_t pieces = d->layout == FSDP_LAYOUT_PER_PARAM ? d->n_params : 0;
  if (l->n_param_shard_offsets != pieces || l->n_param_rows_per_shard != pieces)
    return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                      "RegisterUnit of unit '%.256s': %zu pieces' offsets and "
                                      "%zu rows for %zu params of layout %d",
                                      d->name, l->n_param_shard_offsets,
                                      l->n_param_rows_per_shard, d->n_params, (int)d->layout);
  for (size_t i = 0; i < pieces; i++)
    if (l->param_shard_offsets[i] > l->shard_numel)
      return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                        "RegisterUnit of unit '%.256s': params[%zu]'s piece at "
                                        "element %llu, past the shard's %llu",
                                        d->name, i, (unsigned long long)l->param_shard_offsets[i],
                                        (unsigned long long)l->shard_numel);
  uint64_t host_numel = (uint64_t)l->host_shards * l->shard_numel;
  int r;
  size_t rw = t->memory_size;
  if ((r = check_buffer(t, "RegisterUnit", d->name, "master", l->master_offset, host_numel, 4,
                        rw)) < 0 ||
      (r = check_buffer(t, "RegisterUnit", d->name, "grad", l->grad_offset, host_numel, 4,
                        rw)) < 0)
    return r;
  return 0;
}

static fsdp_unit_handle_t *find_unit(const fsdp_trainer_t *t, const char *name) {
  for (size_t i = 0; i < t->n_units; i++)
    if (strcmp(t->units[i]->name, name) == 0)
      return t->units[i];
  return NULL;
}

/* An address range of `bytes` (whole pages) starting on a page, with nothing mapped there;
 * NULL when the address space is exhausted. */
static uint8_t *reserve_area(size_t bytes, size_t page) {
  size_t span = bytes + page;
  uint8_t *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return NULL;
  uint8_t *start = (uint8_t *)(((uintptr_t)p + page - 1) & ~(uintptr_t)(page - 1));
  if (start > p)
    munmap(p, (size_t)(start - p));
  munmap(start + bytes, (size_t)(p + span - (start + bytes)));
  return start;
}

/* A new handle for a confirmed layout, filed in the trainer. */
static int add_unit(fsdp_trainer_t *t, const fsdp_unit_desc_t *d,
                    const Fsdp__V1__RegisterUnitReply *l, fsdp_unit_handle_t **ret_unit) {
  if (t->n_units == t->units_cap) {
    size_t cap = t->units_cap ? 2 * t->units_cap : 8;
    fsdp_unit_handle_t **units = realloc(t->units, cap * sizeof *units);
    if (!units)
      goto err_nomem;
    t->units = units;
    t->units_cap = cap;
  }
  fsdp_unit_handle_t *u = calloc(1, sizeof *u);
  if (!u)
    goto err_nomem;
  u->trainer = t;
  u->strategy = d->strategy;
  u->id = l->unit_id;
  u->param_size = scalar_bytes(d->param_type);
  u->name = strdup(d->name);
  /* The parameters' offsets, then (PER_PARAM) their pieces' offsets and rows, in one block. */
  size_t n = l->n_param_offsets, pieces = l->n_param_shard_offsets;
  u->param_offsets = malloc((n + 2 * pieces) * sizeof *u->param_offsets);
  if (!u->name || !u->param_offsets) {
    unit_free(u);
    goto err_nomem;
  }
  memcpy(u->param_offsets, l->param_offsets, n * sizeof *u->param_offsets);
  if (pieces) {
    memcpy(u->param_offsets + n, l->param_shard_offsets, pieces * sizeof *u->param_offsets);
    memcpy(u->param_offsets + n + pieces, l->param_rows_per_shard,
           pieces * sizeof *u->param_offsets);
  }
  size_t bytes = (size_t)l->padded_numel * u->param_size;
  u->area_bytes = (bytes + t->page_bytes - 1) / t->page_bytes * t->page_bytes;
  u->unsharded_area.memory = u->grad_area.memory = -1;
  if (t->device < 0 && (!(u->unsharded_area.base = reserve_area(u->area_bytes, t->page_bytes)) ||
                        !(u->grad_area.base = reserve_area(u->area_bytes, t->page_bytes)))) {
    unit_free(u);
    goto err_nomem;
  }
  uint8_t *base = t->memory;
  u->view = (fsdp_unit_view_t){
      .numel = l->numel,
      .padded_numel = l->padded_numel,
      .shard_numel = l->shard_numel,
      .shard = l->shard,
      .param_offsets = u->param_offsets,
      .n_params = l->n_param_offsets,
      .master = (float *)(void *)(base + l->master_offset),
      .grad = (float *)(void *)(base + l->grad_offset),
      .host_first_shard = l->host_first_shard,
      .host_shards = l->host_shards,
      .gathered_step = l->gathered_step,
      .reduced_step = l->reduced_step,
      .replica = l->replica,
      .layout = d->layout,
      .param_shard_offsets = pieces ? u->param_offsets + n : NULL,
      .param_rows_per_shard = pieces ? u->param_offsets + n + pieces : NULL,
  };
  t->units[t->n_units++] = u;
  *ret_unit = u;
  return 0;

err_nomem:
  return fsdp_client_set_last_error(t->client, -ENOMEM,
                                    "fsdp_trainer_register_unit: out of memory for unit '%.256s'",
                                    d->name);
}

int fsdp_trainer_register_unit(fsdp_trainer_t *trainer, const fsdp_unit_desc_t *desc,
                               fsdp_unit_handle_t **ret_unit) {
  if (!trainer)
    return -EINVAL;
  if (!desc || !ret_unit)
    return fsdp_client_set_last_error(trainer->client, -EINVAL,
                                      "fsdp_trainer_register_unit: desc and ret_unit are "
                                      "required");
  int r = check_unit_desc(trainer->client, desc);
  if (r < 0)
    return r;

  Fsdp__V1__ParamSpec *specs = calloc(desc->n_params, sizeof *specs);
  Fsdp__V1__ParamSpec **spec_ptrs = calloc(desc->n_params, sizeof *spec_ptrs);
  if (!specs || !spec_ptrs) {
    r = fsdp_client_set_last_error(trainer->client, -ENOMEM,
                                   "fsdp_trainer_register_unit: out of memory for %zu "
                                   "parameters",
                                   desc->n_params);
    goto out;
  }
  /* The request borrows the caller's names and shapes; the encoder only reads them. */
  for (size_t i = 0; i < desc->n_params; i++) {
    fsdp__v1__param_spec__init(&specs[i]);
    specs[i].name = (char *)desc->params[i].name;
    specs[i].n_shape = desc->params[i].ndim;
    specs[i].shape = (uint64_t *)desc->params[i].shape;
    specs[i].dtype = FSDP__V1__DTYPE__DTYPE_FP32; /* the trainer's parameters are fp32 */
    specs[i].requires_grad = desc->params[i].requires_grad;
    spec_ptrs[i] = &specs[i];
  }
  Fsdp__V1__RegisterUnitRequest rq = FSDP__V1__REGISTER_UNIT_REQUEST__INIT;
  rq.session_id = trainer->session_id;
  rq.unit = (char *)desc->name;
  rq.n_params = desc->n_params;
  rq.params = spec_ptrs;
  rq.strategy = (Fsdp__V1__ShardingStrategy)desc->strategy;
  rq.param_dtype = (Fsdp__V1__DType)desc->param_type;
  rq.reduce_dtype = (Fsdp__V1__DType)desc->reduce_type;
  rq.gradient_predivide_factor = desc->gradient_predivide_factor;
  rq.gradient_postdivide_factor = desc->gradient_postdivide_factor;
  rq.scratch = desc->scratch;
  rq.layout = (Fsdp__V1__UnitLayout)desc->layout;

  ProtobufCMessage *reply = NULL;
  r = fsdp_client_call(trainer->client, TRAINER_PATH("RegisterUnit"), &rq.base,
                       &fsdp__v1__register_unit_reply__descriptor, 0, &reply);
  if (r < 0)
    goto out;
  /* The daemon accepts a name again only with the spec it first had, so the handle filed
   * under the name describes this layout. */
  fsdp_unit_handle_t *u = find_unit(trainer, desc->name);
  if (u) {
    *ret_unit = u;
  } else {
    const Fsdp__V1__RegisterUnitReply *l = (const void *)reply;
    if ((r = check_layout(trainer, desc, l)) == 0)
      r = add_unit(trainer, desc, l, ret_unit);
  }
  protobuf_c_message_free_unpacked(reply, NULL);

out:
  free(spec_ptrs);
  free(specs);
  return r;
}

const fsdp_unit_view_t *fsdp_unit_view(const fsdp_unit_handle_t *unit) {
  return unit ? &unit->view : NULL;
}

/* A unit operation's arguments: the unit must be this trainer's and have no started
 * operation in flight (its outcome would race with this one). */
static int check_op(fsdp_trainer_t *t, fsdp_unit_handle_t *u, const char *op) {
  if (!t)
    return -EINVAL;
  if (!u || u->trainer != t)
    return fsdp_client_set_last_error(t->client, -EINVAL,
                                      "fsdp_trainer_%s: %s", op,
                                      u ? "the unit belongs to another trainer"
                                        : "the unit is required");
  if (u->started || u->started_seq)
    return fsdp_client_set_last_error(t->client, -EBUSY,
                                      "fsdp_trainer_%s: unit '%.256s' has a %s of step %llu "
                                      "started; wait for it first",
                                      op, u->name, u->started_kind.name,
                                      (unsigned long long)u->started_step);
  return 0;
}

/* The gradient step of a unit: a NO_SHARD unit keeps one whole copy, so it is an all-reduce. */
static const char *reduce_path(const fsdp_unit_handle_t *u) {
  return u->strategy == FSDP_NO_SHARD ? TRAINER_PATH("AllReduce") : TRAINER_PATH("ReduceScatter");
}

static void set_reduce_flags(Fsdp__V1__UnitOpRequest *rq, unsigned flags) {
  rq->accumulate = flags & FSDP_REDUCE_ACCUMULATE;
  rq->defer_all_reduce = flags & FSDP_REDUCE_DEFER_ALL_REDUCE;
  rq->step_optimizer = flags & (FSDP_REDUCE_STEP_OPTIMIZER | FSDP_REDUCE_STEP_ONLY);
  rq->step_only = flags & FSDP_REDUCE_STEP_ONLY;
}

static unsigned reduce_flags_of(const Fsdp__V1__UnitOpRequest *rq) {
  return (rq->accumulate ? FSDP_REDUCE_ACCUMULATE : 0u) |
         (rq->defer_all_reduce ? FSDP_REDUCE_DEFER_ALL_REDUCE : 0u) |
         (rq->step_optimizer ? FSDP_REDUCE_STEP_OPTIMIZER : 0u) |
         (rq->step_only ? FSDP_REDUCE_STEP_ONLY : 0u);
}

static void fill_request(const fsdp_trainer_t *t, const fsdp_unit_handle_t *u, uint64_t step,
                         Fsdp__V1__UnitOpRequest *rq) {
  fsdp__v1__unit_op_request__init(rq);
  rq->session_id = t->session_id;
  rq->unit = u->name;
  rq->step = step;
}

/* Maps the lent buffer at `offset` of memory 0 or 1 onto a unit's area. The same buffer as
 * last time (the masters, or a pool buffer lent again) is still mapped there, only
 * inaccessible on the host: opening it again costs no page-table walk. */
static int map_lent(fsdp_trainer_t *t, fsdp_unit_handle_t *u, const char *what, lent_area_t *a,
                    int memory, uint64_t offset, bool writable) {
  size_t size = memory == 0 ? t->memory_size : t->shared_size;
  if (offset % t->page_bytes != 0 || offset > size || u->area_bytes > size - offset)
    return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                      "Unshard of unit '%.256s': the lent %s buffer at offset "
                                      "%llu (%zu bytes) is not on a %zu-byte page inside the "
                                      "%zu-byte memory",
                                      u->name, what, (unsigned long long)offset, u->area_bytes,
                                      t->page_bytes, size);
  if (t->device >= 0) { /* the lent buffer itself, in the memory's one mapping */
    a->base = (uint8_t *)(uintptr_t)(memory == 0 ? t->memory : t->shared) + offset;
    a->memory = memory;
    a->offset = offset;
    return 0;
  }
  int prot = writable ? PROT_READ | PROT_WRITE : PROT_READ;
  if (a->memory == memory && a->offset == offset &&
      (a->prot == prot || mprotect(a->base, u->area_bytes, prot) == 0)) {
    a->prot = prot;
    return 0;
  }
  int fd = memory == 0 ? t->memory_fd : t->shared_fd;
  if (mmap(a->base, u->area_bytes, prot, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd,
           (off_t)offset) == MAP_FAILED) {
    a->memory = -1;
    return fsdp_client_set_last_error(t->client, -errno,
                                      "Unshard of unit '%.256s': mapping the lent %s buffer: %s",
                                      u->name, what, strerror(errno));
  }
  a->memory = memory;
  a->offset = offset;
  a->prot = prot;
  return 0;
}

/* Takes a lent buffer off a unit's view. With FSDP_FENCES=1 a read of its area faults from
 * then on (host memory); otherwise the area keeps its mapping, which the buffer's next
 * lending, the usual case, then costs no system call. */
static void unmap_lent(const fsdp_unit_handle_t *u, lent_area_t *a) {
  /* Fails only for lack of kernel memory for its bookkeeping; the buffer then stays
   * readable, which is harmless. */
  if (u->trainer->device < 0 && u->trainer->fences && a->prot != PROT_NONE &&
      mprotect(a->base, u->area_bytes, PROT_NONE) == 0)
    a->prot = PROT_NONE;
}

/* Points the view at what an operation's outcome lends: after an Unshard the copy (in the
 * read-only copies, or the masters themselves) and, for the backward, the full-gradient
 * buffer. A Reshard, a failed Unshard (the rank let go of its older copy when it asked) and
 * any end of a ReduceScatter (which gives the gradient buffer back) take them off. */
static int apply_outcome(fsdp_trainer_t *t, fsdp_unit_handle_t *u, const char *op, int r,
                         const Fsdp__V1__UnitOpReply *reply) {
  fsdp_unit_view_t *v = &u->view;
  bool unshard = strcmp(op, "Unshard") == 0;
  if (strcmp(op, "ReduceScatter") == 0) {
    unmap_lent(u, &u->grad_area);
    v->full_grad = NULL;
    return r;
  }
  if (!unshard || r < 0) {
    unmap_lent(u, &u->unsharded_area);
    v->unsharded = NULL;
    return r;
  }
  bool masters = reply->unsharded_memory == 0;
  if ((r = map_lent(t, u, "unsharded", &u->unsharded_area, masters ? 0 : 1,
                    reply->unsharded_offset, false)) < 0) {
    v->unsharded = NULL;
    return r;
  }
  v->unsharded = u->unsharded_area.base;
  if (reply->full_grad_bytes) {
    if ((r = map_lent(t, u, "full_grad", &u->grad_area, 0, reply->full_grad_offset, true)) <
        0)
      return r;
    v->full_grad = u->grad_area.base;
  }
  return 0;
}

/* Ends a call: applies its outcome to the view and frees the reply. */
static int finish(fsdp_trainer_t *t, fsdp_unit_handle_t *u, const char *op, int r,
                  ProtobufCMessage *reply) {
  r = apply_outcome(t, u, op, r, (const Fsdp__V1__UnitOpReply *)reply);
  if (reply)
    protobuf_c_message_free_unpacked(reply, NULL);
  return r;
}


static const op_kind_t unshard_op = {"Unshard", TRAINER_PATH("Unshard"), FSDP_FAST_UNSHARD};
static const op_kind_t reshard_op = {"Reshard", TRAINER_PATH("Reshard"), FSDP_FAST_RESHARD};

static op_kind_t reduce_op(const fsdp_unit_handle_t *u) {
  bool all = u->strategy == FSDP_NO_SHARD;
  return (op_kind_t){"ReduceScatter", reduce_path(u),
                     all ? FSDP_FAST_ALL_REDUCE : FSDP_FAST_REDUCE_SCATTER};
}

/* Sends the operation over the fast path; returns its seq, or 0 when it must go over gRPC
 * (no fast path, or every slot in flight). */
static uint64_t fast_send(fsdp_trainer_t *t, const fsdp_unit_handle_t *u, const op_kind_t *kind,
                          const Fsdp__V1__UnitOpRequest *rq) {
  if (!t->fast)
    return 0;
  unsigned flags = (rq->defer_all_reduce ? FSDP_FAST_DEFER_ALL_REDUCE : 0u) |
                   (rq->step_optimizer ? FSDP_FAST_STEP_OPTIMIZER : 0u) |
                   (rq->step_only ? FSDP_FAST_STEP_ONLY : 0u);
  fsdp_fast_request_t fast = {.step = rq->step, .unit_id = u->id, .kind = (uint8_t)kind->fast,
                              .backward = rq->backward, .accumulate = rq->accumulate,
                              .reduce_flags = (uint8_t)flags, .event = (uint16_t)rq->event};
  return fsdp_fast_client_send(t->fast, &fast);
}

static int call_op(fsdp_trainer_t *t, fsdp_unit_handle_t *u, const op_kind_t *kind,
                   Fsdp__V1__UnitOpRequest *rq, int timeout_ms) {
  ProtobufCMessage *reply = NULL;
  int r = fsdp_client_call(t->client, kind->path, &rq->base, &fsdp__v1__unit_op_reply__descriptor,
                           timeout_ms, &reply);
  return finish(t, u, kind->name, r, reply);
}

/* Waits for a fast path operation as for a gRPC call: the same outcome, message and deadline
 * (timeout_ms <= 0: the client's default); a wait that runs out withdraws the operation. When
 * the daemon closed the session's channel, the fast path is over and rq goes over gRPC, whose
 * answer says why (the session is gone, or the daemon). */
static int fast_finish(fsdp_trainer_t *t, fsdp_unit_handle_t *u, const op_kind_t *kind,
                       Fsdp__V1__UnitOpRequest *rq, uint64_t seq, int timeout_ms) {
  if (timeout_ms <= 0)
    timeout_ms = fsdp_client_default_timeout_ms(t->client);
  fsdp_fast_reply_t fr;
  /* No fast path any more: another operation found the channel closed. */
  int r = t->fast ? fsdp_fast_client_wait(t->fast, seq, fsdp_clock_deadline_ms(timeout_ms), &fr)
                  : -EPIPE;
  if (r == -EPIPE) {
    fsdp_fast_client_close(t->fast);
    t->fast = NULL;
    return call_op(t, u, kind, rq, timeout_ms);
  }
  if (r == -ETIMEDOUT) {
    fsdp_fast_client_cancel(t->fast, seq);
    r = fsdp_client_set_last_error(t->client, FSDP_E_DEADLINE_EXCEEDED,
                                   "no reply from fsdpd's fast path within %d ms", timeout_ms);
    return apply_outcome(t, u, kind->name, r, NULL);
  }
  if (r < 0) {
    r = fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                   "%s of unit '%.256s': the fast path lost operation %llu",
                                   kind->name, u->name, (unsigned long long)seq);
    return apply_outcome(t, u, kind->name, r, NULL);
  }
  if (fr.code < 0)
    r = fsdp_client_set_last_error(t->client, fr.code, "%s", fr.message);
  Fsdp__V1__UnitOpReply reply = FSDP__V1__UNIT_OP_REPLY__INIT;
  reply.unsharded_offset = fr.unsharded_offset;
  reply.unsharded_memory = fr.unsharded_memory;
  reply.full_grad_offset = fr.full_grad_offset;
  reply.full_grad_bytes = fr.full_grad_bytes;
  return apply_outcome(t, u, kind->name, r, &reply);
}

static int unit_op(fsdp_trainer_t *t, fsdp_unit_handle_t *u, const op_kind_t *kind,
                   Fsdp__V1__UnitOpRequest *rq) {
  uint64_t seq = fast_send(t, u, kind, rq);
  return seq ? fast_finish(t, u, kind, rq, seq, 0) : call_op(t, u, kind, rq, 0);
}

static int start(fsdp_trainer_t *t, fsdp_unit_handle_t *u, const op_kind_t *kind,
                 Fsdp__V1__UnitOpRequest *rq) {
  int r = 0;
  if (!(u->started_seq = fast_send(t, u, kind, rq)))
    r = fsdp_client_call_start(t->client, kind->path, &rq->base, 0, &u->started);
  if (r == 0) {
    u->started_kind = *kind;
    u->started_step = rq->step;
    u->started_backward = rq->backward;
    u->started_reduce_flags = reduce_flags_of(rq);
  }
  return r;
}

/* Orders the daemon's work for rq after what the trainer's stream queued so far: the
 * session's next event recorded there, named in rq (UnitOpRequest.event). */
_Static_assert(FSDP_SESSION_CUDA_EVENTS >= FSDP_FASTPATH_MAX_INFLIGHT,
               "an event is recorded again only once the operation that named it was answered");

static int record_cuda_event(fsdp_trainer_t *t, const fsdp_unit_handle_t *u, const char *api,
                             Fsdp__V1__UnitOpRequest *rq) {
  if (!t->cuda_stream_set)
    return 0;
  unsigned i = t->next_cuda_event++ % t->n_cuda_events;
  fsdp_status_t st = FSDP_STATUS_INIT;
  if (fsdp_device_event_record(t->cuda_events[i], t->cuda_stream, &st) < 0)
    return fsdp_client_set_last_error(t->client, st.code, "%s of unit '%.256s': %s", api,
                                      u->name, st.message);
  rq->event = i + 1;
  return 0;
}

/* A unit operation of the API (api: its name for messages), run now or started to be
 * waited for. */
static int unit_request(fsdp_trainer_t *t, fsdp_unit_handle_t *u, const char *api,
                        const op_kind_t *kind, uint64_t step, bool backward, unsigned reduce_flags,
                        bool started) {
  int r = check_op(t, u, api);
  if (r < 0)
    return r;
  Fsdp__V1__UnitOpRequest rq;
  fill_request(t, u, step, &rq);
  if ((r = record_cuda_event(t, u, api, &rq)) < 0)
    return r;
  rq.backward = backward;
  set_reduce_flags(&rq, reduce_flags);
  return started ? start(t, u, kind, &rq) : unit_op(t, u, kind, &rq);
}

int fsdp_trainer_unshard(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit, uint64_t step,
                         fsdp_pass_t pass) {
  return unit_request(trainer, unit, "unshard", &unshard_op, step, pass == FSDP_PASS_BACKWARD,
                      0, false);
}

int fsdp_trainer_unshard_start(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit,
                               uint64_t step, fsdp_pass_t pass) {
  return unit_request(trainer, unit, "unshard_start", &unshard_op, step,
                      pass == FSDP_PASS_BACKWARD, 0, true);
}

int fsdp_trainer_wait(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit, int timeout_ms) {
  if (!trainer)
    return -EINVAL;
  if (!unit || unit->trainer != trainer || (!unit->started && !unit->started_seq))
    return fsdp_client_set_last_error(trainer->client, -EINVAL,
                                      "fsdp_trainer_wait: %s",
                                      !unit ? "the unit is required"
                                      : unit->trainer != trainer
                                          ? "the unit belongs to another trainer"
                                          : "the unit has no started operation");
  if (unit->started_seq) {
    uint64_t seq = unit->started_seq;
    unit->started_seq = 0; /* fast_finish ends it, whatever the outcome */
    Fsdp__V1__UnitOpRequest rq;
    fill_request(trainer, unit, unit->started_step, &rq);
    rq.backward = unit->started_backward;
    set_reduce_flags(&rq, unit->started_reduce_flags);
    return fast_finish(trainer, unit, &unit->started_kind, &rq, seq, timeout_ms);
  }
  fsdp_client_started_t *started = unit->started;
  unit->started = NULL; /* finish ends it, whatever the outcome */
  ProtobufCMessage *reply = NULL;
  int r = fsdp_client_call_finish(trainer->client, started, &fsdp__v1__unit_op_reply__descriptor,
                                  timeout_ms, &reply);
  return finish(trainer, unit, unit->started_kind.name, r, reply);
}

int fsdp_trainer_reshard(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit, uint64_t step) {
  return unit_request(trainer, unit, "reshard", &reshard_op, step, false, 0, false);
}

/* A reduce, run now or started (api: its name for messages). */
static int reduce_request(fsdp_trainer_t *t, fsdp_unit_handle_t *u, const char *api,
                          uint64_t step, unsigned flags, bool started) {
  const unsigned known =
      FSDP_REDUCE_ACCUMULATE | FSDP_REDUCE_DEFER_ALL_REDUCE | FSDP_REDUCE_STEP_OPTIMIZER |
      FSDP_REDUCE_STEP_ONLY;
  if (t && (flags & ~known))
    return fsdp_client_set_last_error(t->client, -EINVAL,
                                      "fsdp_trainer_%s: flags 0x%x hold bits that are not "
                                      "FSDP_REDUCE_* flags (0x%x)",
                                      api, flags, flags & ~known);
  op_kind_t kind = u ? reduce_op(u) : unshard_op; /* check_op refuses a NULL unit */
  return unit_request(t, u, api, &kind, step, false, flags, started);
}

int fsdp_trainer_reduce_scatter(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit,
                                uint64_t step, unsigned flags) {
  return reduce_request(trainer, unit, "reduce_scatter", step, flags, false);
}

int fsdp_trainer_reduce_scatter_start(fsdp_trainer_t *trainer, fsdp_unit_handle_t *unit,
                                      uint64_t step, unsigned flags) {
  return reduce_request(trainer, unit, "reduce_scatter_start", step, flags, true);
}

int fsdp_trainer_set_schedule(fsdp_trainer_t *trainer, const fsdp_schedule_t *schedule) {
  if (!trainer)
    return -EINVAL;
  if (!schedule || (schedule->n_units && !schedule->units) ||
      (schedule->n_forward_order && !schedule->forward_order))
    return fsdp_client_set_last_error(trainer->client, -EINVAL,
                                      "fsdp_trainer_set_schedule: a schedule, and its units and "
                                      "forward order when it counts some, are required");
  for (size_t i = 0; i < schedule->n_forward_order; i++) {
    const fsdp_unit_handle_t *u = schedule->forward_order[i];
    if (!u || u->trainer != trainer)
      return fsdp_client_set_last_error(trainer->client, -EINVAL,
                                        "fsdp_trainer_set_schedule: forward_order[%zu]: %s", i,
                                        u ? "the unit belongs to another trainer"
                                          : "the unit is required");
  }
  for (size_t i = 0; i < schedule->n_units; i++) {
    const fsdp_unit_handle_t *u = schedule->units[i].unit;
    if (!u || u->trainer != trainer)
      return fsdp_client_set_last_error(trainer->client, -EINVAL,
                                        "fsdp_trainer_set_schedule: units[%zu]: %s", i,
                                        u ? "the unit belongs to another trainer"
                                          : "the unit is required");
  }
  Fsdp__V1__UnitSchedule *units = calloc(schedule->n_units, sizeof *units);
  Fsdp__V1__UnitSchedule **unit_ptrs = calloc(schedule->n_units, sizeof *unit_ptrs);
  char **order = calloc(schedule->n_forward_order, sizeof *order);
  int r;
  if ((schedule->n_units && (!units || !unit_ptrs)) || (schedule->n_forward_order && !order)) {
    r = fsdp_client_set_last_error(trainer->client, -ENOMEM,
                                   "fsdp_trainer_set_schedule: out of memory for %zu units",
                                   schedule->n_units);
    goto out;
  }
  for (size_t i = 0; i < schedule->n_units; i++) {
    fsdp__v1__unit_schedule__init(&units[i]);
    units[i].unit = schedule->units[i].unit->name;
    units[i].reshard_after_forward = schedule->units[i].reshard_after_forward;
    unit_ptrs[i] = &units[i];
  }
  Fsdp__V1__SetScheduleRequest rq = FSDP__V1__SET_SCHEDULE_REQUEST__INIT;
  rq.session_id = trainer->session_id;
  rq.max_inflight = schedule->max_inflight;
  rq.n_units = schedule->n_units;
  rq.units = unit_ptrs;
  for (size_t i = 0; i < schedule->n_forward_order; i++)
    order[i] = schedule->forward_order[i]->name;
  rq.n_forward_order = schedule->n_forward_order;
  rq.forward_order = order;
  rq.forward_prefetch = schedule->forward_prefetch;
  rq.backward_prefetch = schedule->backward_prefetch;
  ProtobufCMessage *reply = NULL;
  r = fsdp_client_call(trainer->client, TRAINER_PATH("SetSchedule"), &rq.base,
                       &fsdp__v1__set_schedule_reply__descriptor, 0, &reply);
  if (r == 0)
    protobuf_c_message_free_unpacked(reply, NULL);
out:
  free(order);
  free(unit_ptrs);
  free(units);
  return r;
}

/* Points the unit's view at its optimizer state, once the daemon said where it is; an offset
 * outside the mapping is a daemon the trainer cannot trust. */
static int show_optimizer_state(fsdp_trainer_t *t, fsdp_unit_handle_t *u,
                                const Fsdp__V1__OptimizerUnitState *m) {
  uint64_t numel = (uint64_t)u->view.host_shards * u->view.shard_numel;
  uint64_t end = m->arrays_offset + (m->arrays ? (m->arrays - 1) * m->array_stride : 0) +
                 numel * 4;
  if (m->arrays > 3 || m->array_stride < numel * 4 || m->steps_offset + 8 > t->memory_size ||
      end > t->memory_size || m->steps_offset % 8 || m->arrays_offset % 4 ||
      m->array_stride % 4)
    return fsdp_client_set_last_error(t->client, FSDP_E_INTERNAL,
                                      "fsdp_trainer_set_optimizer: the daemon placed unit "
                                      "'%.256s''s optimizer state outside the job's memory",
                                      u->name);
  uint8_t *base = t->memory;
  u->view.optimizer_steps = (uint64_t *)(void *)(base + m->steps_offset);
  u->view.optimizer_arrays = m->arrays;
  for (unsigned a = 0; a < m->arrays; a++)
    u->view.optimizer_state[a] = (float *)(void *)(base + m->arrays_offset + a * m->array_stride);
  return 0;
}

/* A checkpoint writes or reads the job's whole state: minutes for a large one. */
#define CHECKPOINT_TIMEOUT_MS (30 * 60 * 1000)

static int checkpoint_call(fsdp_trainer_t *t, const char *method, const char *dir,
                           uint64_t step, uint64_t *ret_step) {
  if (!t)
    return -EINVAL;
  if (!dir || dir[0] != '/')
    return fsdp_client_set_last_error(t->client, -EINVAL,
                                      "fsdp_trainer_%s_checkpoint: dir '%.256s' is not an "
                                      "absolute path",
                                      strcmp(method, "SaveCheckpoint") ? "load" : "save",
                                      dir ? dir : "(null)");
  Fsdp__V1__CheckpointRequest rq = FSDP__V1__CHECKPOINT_REQUEST__INIT;
  rq.job = t->job;
  rq.path = (char *)dir;
  rq.session_id = t->session_id;
  rq.step = step;
  char path[96];
  snprintf(path, sizeof path, "/fsdp.v1.Operator/%s", method);
  ProtobufCMessage *reply = NULL;
  int r = fsdp_client_call(t->client, path, &rq.base, &fsdp__v1__checkpoint_reply__descriptor,
                           CHECKPOINT_TIMEOUT_MS, &reply);
  if (r < 0)
    return r;
  if (ret_step)
    *ret_step = ((const Fsdp__V1__CheckpointReply *)reply)->step;
  protobuf_c_message_free_unpacked(reply, NULL);
  return 0;
}

int fsdp_trainer_save_checkpoint(fsdp_trainer_t *trainer, const char *dir, uint64_t step,
                                 uint64_t *ret_step) {
  return checkpoint_call(trainer, "SaveCheckpoint", dir, step, ret_step);
}

int fsdp_trainer_load_checkpoint(fsdp_trainer_t *trainer, const char *dir, uint64_t *ret_step) {
  return checkpoint_call(trainer, "LoadCheckpoint", dir, 0, ret_step);
}

int fsdp_trainer_set_optimizer(fsdp_trainer_t *trainer, const fsdp_optim_t *optim) {
  if (!trainer)
    return -EINVAL;
  if (!optim || (optim->n_groups && !optim->groups))
    return fsdp_client_set_last_error(trainer->client, -EINVAL,
                                      "fsdp_trainer_set_optimizer: an optimizer, and its groups "
                                      "when it counts some, are required");
  Fsdp__V1__OptimizerGroup *groups = calloc(optim->n_groups + 1, sizeof *groups);
  Fsdp__V1__OptimizerGroup **group_ptrs = calloc(optim->n_groups + 1, sizeof *group_ptrs);
  if (!groups || !group_ptrs) {
    free(groups);
    free(group_ptrs);
    return fsdp_client_set_last_error(trainer->client, -ENOMEM,
                                      "fsdp_trainer_set_optimizer: out of memory");
  }
  for (size_t i = 0; i < optim->n_groups; i++) {
    const fsdp_param_group_t *g = &optim->groups[i];
    fsdp__v1__optimizer_group__init(&groups[i]);
    groups[i].params = (char **)g->params;
    groups[i].n_params = g->n_params;
    groups[i].lr = g->lr;
    groups[i].weight_decay = g->weight_decay;
    groups[i].maximize = g->maximize;
    groups[i].beta1 = g->beta1;
    groups[i].beta2 = g->beta2;
    groups[i].eps = g->eps;
    groups[i].amsgrad = g->amsgrad;
    groups[i].momentum = g->momentum;
    groups[i].dampening = g->dampening;
    groups[i].nesterov = g->nesterov;
    group_ptrs[i] = &groups[i];
  }
  Fsdp__V1__SetOptimizerRequest rq = FSDP__V1__SET_OPTIMIZER_REQUEST__INIT;
  rq.session_id = trainer->session_id;
  rq.kind = (Fsdp__V1__OptimizerKind)optim->kind;
  rq.n_groups = optim->n_groups;
  rq.groups = group_ptrs;
  rq.max_grad_norm = optim->max_grad_norm;
  ProtobufCMessage *reply = NULL;
  int r = fsdp_client_call(trainer->client, TRAINER_PATH("SetOptimizer"), &rq.base,
                           &fsdp__v1__set_optimizer_reply__descriptor, 0, &reply);
  free(group_ptrs);
  free(groups);
  if (r < 0)
    return r;
  const Fsdp__V1__SetOptimizerReply *states = (const void *)reply;
  for (size_t i = 0; i < states->n_units && r == 0; i++) {
    fsdp_unit_handle_t *u = find_unit(trainer, states->units[i]->unit);
    if (u) /* a unit this rank has not registered yet learns it at its next set */
      r = show_optimizer_state(trainer, u, states->units[i]);
  }
  protobuf_c_message_free_unpacked(reply, NULL);
  return r;
}
