/* fsdp-ucx-bench: the ring collectives between hosts (collectives/ring.h), timed between n
 * member processes on this machine, with UCX's own point-to-point bandwidth and OpenMPI's
 * collectives measured in the same run as the peers.
 *
 * Members. The bench forks n members per UCX_TLS setting; each has its own libuv loop and
 * fsdp_ucx_t, as a daemon has, and the members swap their address bytes through the parent
 * over socketpairs made before the fork (the daemon carries them in Peer.Join). For each op
 * and size the parent tells every member to run; a member maps its buffer (size bytes, n
 * regions) and the ring's scratch pre-faulted, then for each iteration rewrites its input
 * outside the clock, meets the others at a barrier (a small ring all-gather), times one
 * collective from its start to its callback, and checks the result, so that a wrong answer
 * cannot pass for a fast one. An iteration's time is the slowest member's; the table gives
 * the median over the timed iterations (after the warm-up ones) and the fastest.
 *
 * Figures (the NCCL conventions): algorithm bandwidth = size / time; bus bandwidth =
 * size * (n - 1) / n / time, the bytes each member sends (and receives) over its time, which
 * is what one link of a ring carries and so compares with a link's point-to-point bandwidth.
 *
 * Peers, each bounded by --timeout and killed (its process group) when it overruns:
 *   - ucx_perftest (ucx-utils) tag_bw between a server and a client with the same UCX_TLS,
 *     one message of the same size at a time; ratio = ring bus bandwidth / that bandwidth.
 *     Then n such streams at once in the ring's pattern (member i's client sends to member
 *     i + 1's server), each member's processes on its CPU under --pin: what UCX's own
 *     protocol gives one link of the ring when all n links share this machine, as the
 *     ring's do; ratio = ring bus bandwidth / one stream's bandwidth then.
 *   - fsdp-mpi-collectives (built next to this binary when CMake found MPI) under mpirun
 *     with the same number of ranks, over OpenMPI's tcp transport (btl tcp,self, pml ob1)
 *     and over its shared memory (btl vader,self); ratio = ring time / MPI time.
 * A missing peer is reported as skipped with the reason; the ring's figures still print.
 * Results and the commands that produce them are in docs/PERFORMANCE.md. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <uv.h>

#include "collectives/ring.h"
#include "common/clock.h"
#include "kernels/kernels.h"
#include "transport/ucx.h"

#ifndef FSDP_BENCH_MPI
#define FSDP_BENCH_MPI 0
#endif

enum { EXIT_OK = 0, EXIT_FAILED = 1, EXIT_USAGE = 2 };

#define MAX_MEMBERS 3
#define MAX_SIZES 8
#define MAX_ITERS 1000
#define MAX_TLS 4
#define N_OPS 2
#define BLOB_MAX 65536
#define SETUP_TIMEOUT_MS 30000
#define BARRIER_OP_BASE 0x40000000u

/* The UCX_TLS settings of --tls: shared memory names UCX's shm transports explicitly, so
 * that UCX cannot fall back to tcp on the same host. */
static const struct {
  const char *name, *ucx_tls, *mpi_btl;
} TLS_PRESETS[] = {
    {"tcp", "tcp", "tcp,self"},
    {"shm", "posix,sysv,cma,self", "vader,self"},
};

typedef struct {
  unsigned members;
  size_t mib[MAX_SIZES];
  unsigned n_sizes;
  bool ops[N_OPS]; /* all-gather, reduce-scatter */
  unsigned iters, warmup;
  size_t chunk;
  unsigned window;
  const char *tls[MAX_TLS]; /* UCX_TLS values */
  unsigned n_tls;
  bool pin;
  bool p2p, mpi;
  unsigned p2p_iters;
  unsigned timeout_s;
} options_t;

static const fsdp_ring_kind_t OP_KIND[N_OPS] = {FSDP_RING_ALL_GATHER, FSDP_RING_REDUCE_SCATTER};

/* ---- Time, small I/O ---- */

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, unsigned n) {
  qsort(v, n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static int io_full(int fd, void *buf, size_t len, bool writing, int64_t deadline) {
  char *p = buf;
  while (len > 0) {
    struct pollfd pfd = {.fd = fd, .events = writing ? POLLOUT : POLLIN};
    int left = fsdp_clock_left_ms(deadline);
    if (left == 0)
      return -ETIMEDOUT;
    int pr = poll(&pfd, 1, left);
    if (pr < 0 && errno == EINTR)
      continue;
    if (pr <= 0)
      return pr == 0 ? -ETIMEDOUT : -errno;
    ssize_t n = writing ? write(fd, p, len) : read(fd, p, len);
    if (n == 0)
      return -EPIPE;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN)
        continue;
      return -errno;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int send_blob(int fd, const void *p, uint32_t len, int timeout_ms) {
  int64_t deadline = fsdp_clock_deadline_ms(timeout_ms);
  int r = io_full(fd, &len, sizeof len, true, deadline);
  return r < 0 ? r : io_full(fd, (void *)p, len, true, deadline);
}

/* One blob into buf (cap bytes, NUL-terminated: at most cap - 1 bytes of text). */
static int recv_blob(int fd, void *buf, uint32_t cap, uint32_t *ret_len, int timeout_ms) {
  int64_t deadline = fsdp_clock_deadline_ms(timeout_ms);
  uint32_t len;
  int r = io_full(fd, &len, sizeof len, false, deadline);
  if (r < 0)
    return r;
  if (len >= cap)
    return -EMSGSIZE;
  r = io_full(fd, buf, len, false, deadline);
  if (r < 0)
    return r;
  ((char *)buf)[len] = '\0';
  *ret_len = len;
  return 0;
}

__attribute__((format(printf, 2, 3))) static void send_text(int fd, const char *fmt, ...) {
  char text[BLOB_MAX];
  va_list ap;
  va_start(ap, fmt);
  int len = vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  if (len >= (int)sizeof text)
    len = (int)sizeof text - 1;
  send_blob(fd, text, (uint32_t)len, SETUP_TIMEOUT_MS);
}

static void pin_to(unsigned index) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET((int)(index % (unsigned)(cpus > 0 ? cpus : 1)), &set);
  sched_setaffinity(0, sizeof set, &set);
}

static void *map_faulted(size_t bytes) {
  void *p = mmap(NULL, bytes ? bytes : 1, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED)
    return NULL;
  /* MAP_POPULATE may leave the shared zero page behind reads; writing makes every page
   * private and resident before any clock starts. */
  memset(p, 0x3c, bytes);
  return p;
}

/* ---- Children we must not leave behind ---- */

/* Process groups (members, ucx_perftest, mpirun) alive now, for the signal handler. */
static volatile sig_atomic_t g_children[16];

static void child_track(pid_t pid) {
  for (size_t i = 0; i < sizeof g_children / sizeof g_children[0]; i++)
    if (g_children[i] == 0) {
      g_children[i] = pid;
      return;
    }
}

static void child_untrack(pid_t pid) {
  for (size_t i = 0; i < sizeof g_children / sizeof g_children[0]; i++)
    if (g_children[i] == pid)
      g_children[i] = 0;
}

static void on_fatal_signal(int sig) {
  for (size_t i = 0; i < sizeof g_children / sizeof g_children[0]; i++)
    if (g_children[i] > 0)
      kill(-(pid_t)g_children[i], SIGKILL);
  signal(sig, SIG_DFL);
  raise(sig);
}

/* Whether the child has exited, leaving it to be reaped. */
static bool has_exited(pid_t pid) {
  siginfo_t info = {0};
  return waitid(P_PID, (id_t)pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid;
}

/* Waits for a child until the deadline, then kills its group: SIGTERM, a second's grace
 * (mpirun takes its ranks down on SIGTERM), SIGKILL. Returns the wait status, or -1 when it
 * had to be killed. */
static int reap(pid_t pid, int64_t deadline) {
  int status = 0;
  pid_t r;
  while ((r = waitpid(pid, &status, WNOHANG)) == 0 && fsdp_clock_now_ms() < deadline)
    usleep(2000);
  if (r == pid) {
    child_untrack(pid);
    return status;
  }
  if (r < 0) { /* not ours to wait for any more */
    child_untrack(pid);
    return -1;
  }
  kill(-pid, SIGTERM);
  int64_t grace = fsdp_clock_deadline_ms(1000);
  while ((r = waitpid(pid, &status, WNOHANG)) == 0 && fsdp_clock_now_ms() < grace)
    usleep(2000);
  if (r == 0) {
    kill(-pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  kill(-pid, SIGKILL); /* anything it left in its group */
  child_untrack(pid);
  return -1;
}

/* ---- A spawned program with its output collected ---- */

typedef struct {
  pid_t pid;
  int out; /* its stdout and stderr */
  char *text;
  size_t len, cap;
} proc_t;

static int proc_spawn(proc_t *p, char *const argv[], const char *ucx_tls, unsigned pin_cpu) {
  memset(p, 0, sizeof *p);
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) < 0)
    return -errno;
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return -errno;
  }
  if (pid == 0) {
    setpgid(0, 0);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    if (ucx_tls) {
      setenv("UCX_TLS", ucx_tls, 1);
      /* The tcp segments and socket buffers fsdp_ucx_new gives the ring (transport/ucx.c),
       * unless the environment sets them for both: the peer runs on the same settings. */
      setenv("UCX_TCP_TX_SEG_SIZE", "512k", 0);
      setenv("UCX_TCP_RX_SEG_SIZE", "512k", 0);
      setenv("UCX_TCP_SNDBUF", "8m", 0);
      setenv("UCX_TCP_RCVBUF", "8m", 0);
    }
    if (pin_cpu != UINT_MAX)
      pin_to(pin_cpu);
    execvp(argv[0], argv);
    fprintf(stderr, "cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);
  child_track(pid);
  close(fds[1]);
  p->pid = pid;
  p->out = fds[0];
  fcntl(p->out, F_SETFL, O_NONBLOCK);
  p->cap = 4096;
  p->text = malloc(p->cap);
  p->text[0] = '\0';
  return 0;
}

/* Reads its output until needle appears (NULL: until EOF) or the deadline. */
static bool proc_read(proc_t *p, const char *needle, int64_t deadline) {
  for (;;) {
    if (needle && strstr(p->text, needle))
      return true;
    if (p->out < 0)
      return needle == NULL;
    int left = fsdp_clock_left_ms(deadline);
    if (left == 0)
      return false;
    struct pollfd pfd = {.fd = p->out, .events = POLLIN};
    if (poll(&pfd, 1, left) <= 0)
      continue;
    if (p->cap - p->len < 4096) {
      p->cap *= 2;
      p->text = realloc(p->text, p->cap);
    }
    ssize_t n = read(p->out, p->text + p->len, p->cap - p->len - 1);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
      continue;
    if (n <= 0) {
      close(p->out);
      p->out = -1;
      continue;
    }
    p->len += (size_t)n;
    p->text[p->len] = '\0';
  }
}

/* Reads to EOF and reaps, within the deadline. Returns the exit code, or -1 when it was
 * killed (timed out) or died of a signal. */
static int proc_finish(proc_t *p, int64_t deadline) {
  proc_read(p, NULL, deadline);
  int status = reap(p->pid, deadline);
  if (p->out >= 0) {
    close(p->out);
    p->out = -1;
  }
  if (status < 0 || !WIFEXITED(status))
    return -1;
  return WEXITSTATUS(status);
}

static void proc_free(proc_t *p) {
  if (p->out >= 0)
    close(p->out);
  free(p->text);
  p->text = NULL;
}

/* The last lines of a program's output, for an error message. */
static const char *tail_of(const char *text) {
  size_t len = strlen(text);
  const char *t = len > 400 ? text + len - 400 : text;
  return *t ? t : "(no output)";
}

/* ---- A member (runs in a forked child) ---- */

typedef struct {
  unsigned n, self;
  int sock;
  uv_loop_t loop;
  fsdp_ucx_t *ucx;
  fsdp_ucx_peer_t *peers[MAX_MEMBERS];
  char labels[MAX_MEMBERS][32];
  uint32_t op_id;
  unsigned timeout_s;
} member_t;

typedef struct {
  bool done;
  uint64_t end_ns;
  fsdp_status_t st;
} ring_result_t;

static void on_ring_done(fsdp_ring_t *ring, const fsdp_status_t *st, void *arg) {
  (void)ring;
  ring_result_t *res = arg;
  res->end_ns = fsdp_clock_now_ns();
  res->st = *st;
  res->done = true;
}

/* Runs one collective to its callback; the ring's own deadline bounds the wait. Returns 0,
 * or -1 with *st saying why. */
static int member_ring(member_t *m, fsdp_ring_args_t *a, uint64_t *ret_start, uint64_t *ret_end,
                       fsdp_status_t *st) {
  uv_update_time(&m->loop);
  a->n = m->n;
  a->self = m->self;
  a->peers = m->peers;
  a->op_id = m->op_id++;
  a->deadline_ms = uv_now(&m->loop) + (uint64_t)m->timeout_s * 1000;
  ring_result_t res = {0};
  fsdp_ring_t *ring;
  uint64_t start = fsdp_clock_now_ns();
  if (fsdp_ring_start(m->ucx, a, on_ring_done, &res, &ring, st) < 0)
    return -1;
  while (!res.done)
    uv_run(&m->loop, UV_RUN_ONCE);
  if (res.st.code != 0) {
    *st = res.st;
    return -1;
  }
  if (ret_start)
    *ret_start = start;
  if (ret_end)
    *ret_end = res.end_ns;
  return 0;
}

/* Every member has entered it before any leaves: an all-gather of one word each. */
static int member_barrier(member_t *m, fsdp_status_t *st) {
  uint64_t words[MAX_MEMBERS] = {0};
  fsdp_ring_args_t a = {.kind = FSDP_RING_ALL_GATHER, .buf = words, .region_bytes = 8,
                        .dtype = FSDP_DTYPE_FP32};
  uint32_t id = m->op_id;
  m->op_id = BARRIER_OP_BASE | id; /* its own tag space: never the same op_id as data */
  int rc = member_ring(m, &a, NULL, NULL, st);
  m->op_id = id;
  return rc;
}

/* Small integers, so that sums are exact in any order; the iteration is mixed in so that a
 * buffer left from an earlier one cannot pass the check. */
static inline float value(unsigned member, size_t e, unsigned iter) {
  return (float)((e + member * 3u + iter) & 15u);
}

/* "run KIND MIB ITERS WARMUP CHUNK WINDOW": times one op at one size and reports
 * "ok MS MS ..." (every iteration, warm-up first) or "FAIL text". */
static void member_run(member_t *m, const char *cmd) {
  unsigned kind, iters, warmup, window;
  size_t mib, chunk;
  if (sscanf(cmd, "run %u %zu %u %u %zu %u", &kind, &mib, &iters, &warmup, &chunk, &window) !=
      6) {
    send_text(m->sock, "FAIL member %u: bad command '%s'", m->self, cmd);
    return;
  }
  size_t n = m->n, region_elems = (mib << 20) / n / 4, region = region_elems * 4;
  size_t bytes = region * n;
  /* The ring's defaults when 0, so that the scratch is the size the ring asks for. */
  size_t eff_chunk = chunk ? chunk / 4 * 4 : (size_t)1 << 20;
  size_t scratch_bytes = (size_t)(window ? window : 8) * eff_chunk;
  float *buf = map_faulted(bytes);
  void *scratch = kind == FSDP_RING_ALL_GATHER ? NULL : map_faulted(scratch_bytes);
  double *times = calloc(iters + warmup, sizeof *times);
  if (!buf || (kind != FSDP_RING_ALL_GATHER && !scratch) || !times) {
    send_text(m->sock, "FAIL member %u: out of memory for %zu bytes", m->self, bytes);
    goto out;
  }
  fsdp_status_t st = FSDP_STATUS_INIT;
  for (unsigned it = 0; it < iters + warmup; it++) {
    if (kind == FSDP_RING_ALL_GATHER) {
      memset(buf, 0xff, bytes); /* NaN everywhere but our own region */
      for (size_t e = 0; e < region_elems; e++)
        buf[m->self * region_elems + e] = value(m->self, e, it);
    } else {
      for (size_t e = 0; e < n * region_elems; e++)
        buf[e] = value(m->self, e, it);
    }
    fsdp_ring_args_t a = {.kind = (fsdp_ring_kind_t)kind, .buf = buf, .region_bytes = region,
                          .dtype = FSDP_DTYPE_FP32, .chunk_bytes = chunk, .window = window,
                          .scratch = scratch, .scratch_bytes = scratch ? scratch_bytes : 0};
    uint64_t t0, t1;
    if (member_barrier(m, &st) < 0 || member_ring(m, &a, &t0, &t1, &st) < 0) {
      send_text(m->sock, "FAIL member %u, iteration %u: %s", m->self, it, st.message);
      goto out;
    }
    times[it] = (double)(t1 - t0) / 1e6;
    /* The check, outside the clock. */
    size_t lo = kind == FSDP_RING_ALL_GATHER ? 0 : m->self * region_elems;
    size_t hi = kind == FSDP_RING_ALL_GATHER ? n * region_elems : lo + region_elems;
    for (size_t e = lo; e < hi; e++) {
      float want = 0;
      if (kind == FSDP_RING_ALL_GATHER)
        want = value((unsigned)(e / region_elems), e % region_elems, it);
      else
        for (unsigned r = 0; r < n; r++)
          want += value(r, e, it);
      if (buf[e] != want) {
        send_text(m->sock, "FAIL member %u: %s of %zu bytes, iteration %u: element %zu is %g, "
                           "expected %g", m->self, fsdp_ring_kind_name((fsdp_ring_kind_t)kind),
                  bytes, it, e, (double)buf[e], (double)want);
        goto out;
      }
    }
  }
  char *text = malloc(BLOB_MAX);
  int len = snprintf(text, BLOB_MAX, "ok");
  for (unsigned it = 0; it < iters + warmup && len < BLOB_MAX - 32; it++)
    len += snprintf(text + len, (size_t)(BLOB_MAX - len), " %.4f", times[it]);
  send_blob(m->sock, text, (uint32_t)len, SETUP_TIMEOUT_MS);
  free(text);
out:
  if (buf)
    munmap(buf, bytes);
  if (scratch)
    munmap(scratch, scratch_bytes);
  free(times);
}

static void on_closed(void *arg) {
  *(bool *)arg = true;
}

static void on_guard(uv_timer_t *h) {
  (void)h;
}

static void member_main(unsigned n, unsigned self, int sock, const options_t *o) {
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  if (o->pin)
    pin_to(self);
  member_t m = {.n = n, .self = self, .sock = sock, .op_id = 1, .timeout_s = o->timeout_s};
  uv_loop_init(&m.loop);
  fsdp_status_t st = FSDP_STATUS_INIT;
  /* What the daemon's AUTO ends with: peer error handling where tcp reaches the peer, none
   * where only shared memory does. Named here so that UCX does not log the refused first
   * try of AUTO on every connect. */
  const char *tls = getenv("UCX_TLS");
  fsdp_ucx_options_t opt = {.err_mode = !tls || strstr(tls, "tcp") ? FSDP_UCX_ERR_AUTO
                                                                    : FSDP_UCX_ERR_NONE};
  if (fsdp_ucx_new(&m.loop, &opt, &m.ucx, &st) < 0) {
    send_text(sock, "FAIL member %u: %s", self, st.message);
    _exit(1);
  }
  const void *addr;
  size_t len;
  fsdp_ucx_address(m.ucx, &addr, &len);
  if (send_blob(sock, addr, (uint32_t)len, SETUP_TIMEOUT_MS) < 0)
    _exit(1);
  for (unsigned j = 0; j < n; j++) {
    static unsigned char buf[BLOB_MAX];
    uint32_t got;
    if (recv_blob(sock, buf, sizeof buf, &got, SETUP_TIMEOUT_MS) < 0)
      _exit(1);
    snprintf(m.labels[j], sizeof m.labels[j], "member %u", j);
    if (j == self)
      continue;
    if (fsdp_ucx_connect(m.ucx, buf, got, m.labels[j], &m.peers[j], &st) < 0) {
      send_text(sock, "FAIL member %u: %s", self, st.message);
      _exit(1);
    }
  }
  send_text(sock, "ready %s", fsdp_ucx_peer_has_err_handling(m.peers[(self + 1) % n])
                                  ? "peer error handling"
                                  : "no peer error handling");
  for (;;) {
    static char cmd[256];
    uint32_t got;
    /* The parent bounds every run; this only ends a member whose parent is gone. */
    if (recv_blob(sock, cmd, sizeof cmd, &got, (int)o->timeout_s * 1000 * 4 + 60000) < 0)
      break;
    if (strncmp(cmd, "run ", 4) == 0)
      member_run(&m, cmd);
    else
      break;
  }
  bool closed = false;
  fsdp_ucx_close(m.ucx, on_closed, &closed);
  uv_timer_t guard;
  uv_timer_init(&m.loop, &guard);
  uv_timer_start(&guard, on_guard, 50, 50);
  int64_t end = fsdp_clock_deadline_ms(5000);
  while (!closed && fsdp_clock_now_ms() < end)
    uv_run(&m.loop, UV_RUN_ONCE);
  uv_close((uv_handle_t *)&guard, NULL);
  uv_run(&m.loop, UV_RUN_DEFAULT);
  _exit(closed && uv_loop_close(&m.loop) == 0 ? 0 : 1);
}

/* ---- The members, from the parent ---- */

typedef struct {
  unsigned n;
  pid_t pid[MAX_MEMBERS];
  int sock[MAX_MEMBERS];
  char err_mode[64];
} group_t;

static void group_stop(group_t *g) {
  for (unsigned i = 0; i < g->n; i++)
    if (g->sock[i] >= 0)
      send_blob(g->sock[i], "exit", 4, 1000);
  int64_t deadline = fsdp_clock_deadline_ms(10000);
  for (unsigned i = 0; i < g->n; i++) {
    if (g->pid[i] > 0)
      reap(g->pid[i], deadline);
    if (g->sock[i] >= 0)
      close(g->sock[i]);
    g->pid[i] = 0;
    g->sock[i] = -1;
  }
}

static int group_start(group_t *g, const options_t *o, const char *ucx_tls) {
  memset(g, 0, sizeof *g);
  g->n = o->members;
  for (unsigned i = 0; i < g->n; i++)
    g->sock[i] = -1;
  /* The members read UCX_TLS when they make their context. */
  setenv("UCX_TLS", ucx_tls, 1);
  for (unsigned i = 0; i < g->n; i++) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
      fprintf(stderr, "fsdp-ucx-bench: socketpair: %s\n", strerror(errno));
      group_stop(g);
      return -1;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
      fprintf(stderr, "fsdp-ucx-bench: fork: %s\n", strerror(errno));
      close(sv[0]);
      close(sv[1]);
      group_stop(g);
      return -1;
    }
    if (pid == 0) {
      setpgid(0, 0);
      close(sv[0]);
      for (unsigned j = 0; j < i; j++)
        close(g->sock[j]);
      member_main(g->n, i, sv[1], o);
    }
    setpgid(pid, pid);
    child_track(pid);
    close(sv[1]);
    g->pid[i] = pid;
    g->sock[i] = sv[0];
  }
  unsetenv("UCX_TLS");
  static unsigned char addr[MAX_MEMBERS][BLOB_MAX];
  uint32_t len[MAX_MEMBERS];
  for (unsigned i = 0; i < g->n; i++) {
    int r = recv_blob(g->sock[i], addr[i], sizeof addr[i], &len[i], SETUP_TIMEOUT_MS);
    if (r < 0 || strncmp((char *)addr[i], "FAIL", 4) == 0) {
      fprintf(stderr, "fsdp-ucx-bench: UCX_TLS=%s: member %u sent no address: %s\n", ucx_tls, i,
              r < 0 ? strerror(-r) : (char *)addr[i]);
      group_stop(g);
      return -1;
    }
  }
  for (unsigned i = 0; i < g->n; i++)
    for (unsigned j = 0; j < g->n; j++)
      if (send_blob(g->sock[i], addr[j], len[j], SETUP_TIMEOUT_MS) < 0) {
        fprintf(stderr, "fsdp-ucx-bench: member %u is gone\n", i);
        group_stop(g);
        return -1;
      }
  for (unsigned i = 0; i < g->n; i++) {
    char line[512];
    uint32_t got;
    int r = recv_blob(g->sock[i], line, sizeof line, &got, SETUP_TIMEOUT_MS);
    if (r < 0 || strncmp(line, "ready ", 6) != 0) {
      fprintf(stderr, "fsdp-ucx-bench: UCX_TLS=%s: member %u did not connect: %s\n", ucx_tls,
              i, r < 0 ? strerror(-r) : line);
      group_stop(g);
      return -1;
    }
    snprintf(g->err_mode, sizeof g->err_mode, "%.40s", line + 6);
  }
  return 0;
}

typedef struct {
  bool done;
  double median_ms, min_ms, max_ms;
} timing_t;

/* One op at one size on every member; the iteration's time is the slowest member's. */
static int group_run(group_t *g, const options_t *o, unsigned op, size_t mib, timing_t *ret) {
  char cmd[256];
  snprintf(cmd, sizeof cmd, "run %u %zu %u %u %zu %u", (unsigned)OP_KIND[op], mib, o->iters,
           o->warmup, o->chunk, o->window);
  for (unsigned i = 0; i < g->n; i++)
    if (send_blob(g->sock[i], cmd, (uint32_t)strlen(cmd), SETUP_TIMEOUT_MS) < 0) {
      fprintf(stderr, "fsdp-ucx-bench: member %u is gone\n", i);
      return -1;
    }
  unsigned total = o->iters + o->warmup;
  double worst[MAX_ITERS * 2] = {0};
  int rc = 0;
  static char line[BLOB_MAX];
  for (unsigned i = 0; i < g->n; i++) {
    uint32_t got;
    int r = recv_blob(g->sock[i], line, sizeof line, &got, (int)o->timeout_s * 1000);
    if (r < 0) {
      fprintf(stderr, "fsdp-ucx-bench: %s of %zu MiB: member %u reported nothing within %u s: "
                      "%s\n", fsdp_ring_kind_name(OP_KIND[op]), mib, i, o->timeout_s,
              strerror(-r));
      return -1; /* the caller stops the members */
    }
    if (strncmp(line, "ok", 2) != 0) {
      fprintf(stderr, "fsdp-ucx-bench: %s\n", line);
      rc = -1;
      continue;
    }
    char *p = line + 2;
    for (unsigned it = 0; it < total; it++) {
      char *end;
      double t = strtod(p, &end);
      if (end == p) {
        fprintf(stderr, "fsdp-ucx-bench: member %u sent %u times, expected %u\n", i, it, total);
        return -1;
      }
      p = end;
      if (t > worst[it])
        worst[it] = t;
    }
  }
  if (rc < 0)
    return -1;
  double *timed = worst + o->warmup;
  ret->done = true;
  ret->median_ms = median(timed, o->iters);
  ret->min_ms = timed[0];
  ret->max_ms = timed[o->iters - 1];
  return 0;
}

/* ---- The peers ---- */

static char g_self_dir[PATH_MAX];

static bool have_program(const char *name) {
  const char *path = getenv("PATH");
  if (!path)
    return false;
  char *copy = strdup(path), *save = NULL;
  bool found = false;
  for (char *d = strtok_r(copy, ":", &save); d && !found; d = strtok_r(NULL, ":", &save)) {
    char full[PATH_MAX];
    snprintf(full, sizeof full, "%s/%s", d, name);
    found = access(full, X_OK) == 0;
  }
  free(copy);
  return found;
}

/* A TCP port free on the loopback now (ucx_perftest's own exchange port). */
static int free_port(void) {
  int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0)
    return -1;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  int port = -1;
  if (bind(s, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(s, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  close(s);
  return port;
}

/* Whether something listens on this TCP port now (ucx_perftest's server, whose "Waiting for
 * connection" line sits in its stdio buffer when its output is a pipe). */
static bool port_listening(int port) {
  static const char *const tables[] = {"/proc/net/tcp", "/proc/net/tcp6"};
  bool found = false;
  for (size_t k = 0; k < 2 && !found; k++) {
    FILE *f = fopen(tables[k], "r");
    if (!f)
      continue;
    char line[512];
    while (!found && fgets(line, sizeof line, f)) {
      char local[64];
      unsigned st;
      if (sscanf(line, " %*s %63s %*s %x", local, &st) != 2)
        continue;
      const char *colon = strrchr(local, ':');
      found = colon && st == 0x0a && strtol(colon + 1, NULL, 16) == port;
    }
    fclose(f);
  }
  return found;
}

/* ucx_perftest -f prints the final figures as one row of 8 numbers: iterations, latency
 * 50th percentile, average and overall (µs), bandwidth average and overall (MB/s, where its
 * MB is 2^20 bytes), message rate average and overall. Returns the overall bandwidth in
 * bytes/s, or a negative value. */
static double parse_perftest(const char *text) {
  double bw = -1;
  const char *line = text;
  while (line && *line) {
    double v[8];
    if (sscanf(line, "%lf %lf %lf %lf %lf %lf %lf %lf", &v[0], &v[1], &v[2], &v[3], &v[4],
               &v[5], &v[6], &v[7]) == 8)
      bw = v[5] * 1048576.0;
    line = strchr(line, '\n');
    if (line)
      line++;
  }
  return bw;
}

/* UCX point to point: `streams` perftest servers and clients with this UCX_TLS at once, one
 * message of `bytes` at a time each. One stream: the server on CPU 0 and the client on
 * CPU 1 under --pin. n streams in the ring's pattern: stream i goes from the client of
 * member i (on CPU i) to the server of member i + 1, as the ring's member i sends to its
 * right neighbour while it receives from its left. Returns the mean bytes/s of one stream,
 * or -1 with why. */
static double run_perftest(const options_t *o, const char *ucx_tls, size_t bytes,
                           unsigned streams, char *why, size_t why_len) {
  bool tcp = strstr(ucx_tls, "tcp") != NULL;
  for (int attempt = 0; attempt < 3; attempt++) {
    proc_t srv[MAX_MEMBERS], cli[MAX_MEMBERS];
    int port[MAX_MEMBERS];
    char port_s[MAX_MEMBERS][16], size_s[32], iters_s[16], warm_s[16];
    snprintf(size_s, sizeof size_s, "%zu", bytes);
    snprintf(iters_s, sizeof iters_s, "%u", o->p2p_iters);
    snprintf(warm_s, sizeof warm_s, "%u", o->p2p_iters / 5 + 1);
    int64_t deadline = fsdp_clock_deadline_ms((int64_t)o->timeout_s * 1000);
    unsigned started = 0;
    bool retry = false;
    why[0] = '\0';
    for (; started < streams; started++) {
      unsigned i = started;
      if ((port[i] = free_port()) < 0) {
        snprintf(why, why_len, "no free port: %s", strerror(errno));
        break;
      }
      snprintf(port_s[i], sizeof port_s[i], "%d", port[i]);
      /* Peer error handling (-e) where the ring has it, so the same protocols are chosen. */
      char *srv_argv[] = {"ucx_perftest", "-p", port_s[i], tcp ? "-e" : NULL, NULL};
      unsigned srv_cpu = streams == 1 ? 0 : (i + 1) % streams;
      if (proc_spawn(&srv[i], srv_argv, ucx_tls, o->pin ? srv_cpu : UINT_MAX) < 0) {
        snprintf(why, why_len, "cannot start ucx_perftest: %s", strerror(errno));
        break;
      }
      int64_t listen_deadline = fsdp_clock_deadline_ms(10000);
      while (!port_listening(port[i]) && fsdp_clock_now_ms() < listen_deadline &&
             !has_exited(srv[i].pid))
        usleep(5000);
      if (!port_listening(port[i])) {
        int code = proc_finish(&srv[i], fsdp_clock_deadline_ms(2000));
        snprintf(why, why_len, "ucx_perftest server on port %d did not start (exit %d): %s",
                 port[i], code, tail_of(srv[i].text));
        retry = strstr(srv[i].text, "in use") != NULL; /* taken since we looked: again */
        proc_free(&srv[i]);
        break;
      }
    }
    unsigned clients = 0;
    for (; !why[0] && clients < started; clients++) {
      unsigned i = clients;
      char *cli_argv[] = {"ucx_perftest", "127.0.0.1", "-p", port_s[i], "-t", "tag_bw",
                          "-s", size_s, "-n", iters_s, "-w", warm_s, "-f",
                          tcp ? "-e" : NULL, NULL};
      unsigned cli_cpu = streams == 1 ? 1 : i;
      if (proc_spawn(&cli[i], cli_argv, ucx_tls, o->pin ? cli_cpu : UINT_MAX) < 0) {
        snprintf(why, why_len, "cannot start ucx_perftest: %s", strerror(errno));
        break;
      }
    }
    double sum = 0;
    for (unsigned i = 0; i < started; i++) {
      int cli_code = i < clients ? proc_finish(&cli[i], deadline) : -1;
      int srv_code =
          proc_finish(&srv[i], cli_code == 0 ? fsdp_clock_deadline_ms(5000) : fsdp_clock_now_ms());
      double bw = cli_code == 0 ? parse_perftest(cli[i].text) : -1;
      if (bw <= 0 && !why[0])
        snprintf(why, why_len, "ucx_perftest client %u of %u %s (server %s): %s", i, streams,
                 cli_code < 0 ? "timed out or crashed" : cli_code ? "failed" : "printed no figures",
                 srv_code == 0 ? "exited 0" : "did not exit cleanly", tail_of(cli[i].text));
      sum += bw;
      if (i < clients)
        proc_free(&cli[i]);
      proc_free(&srv[i]);
    }
    if (!why[0])
      return sum / streams;
    if (!retry)
      return -1;
  }
  return -1;
}

typedef struct {
  bool done;
  double median_ms;
} mpi_result_t;

/* fsdp-mpi-collectives under mpirun with these btls at one size; fills res[op][size_index].
 * Returns 0, or -1 with why. */
static int run_mpi(const options_t *o, const char *btl, unsigned size_index,
                   mpi_result_t res[N_OPS][MAX_SIZES], char *why, size_t why_len) {
  char prog[PATH_MAX + 32], np_s[16], sizes_s[128] = "", iters_s[16], warm_s[16];
  snprintf(prog, sizeof prog, "%s/fsdp-mpi-collectives", g_self_dir);
  snprintf(np_s, sizeof np_s, "%u", o->members);
  snprintf(sizes_s, sizeof sizes_s, "%zu", o->mib[size_index]);
  snprintf(iters_s, sizeof iters_s, "%u", o->iters);
  snprintf(warm_s, sizeof warm_s, "%u", o->warmup);
  const char *op = o->ops[0] && o->ops[1] ? "both" : o->ops[0] ? "all-gather" : "reduce-scatter";
  /* Binding to none and pinning in the program (--pin) gives MPI's ranks the placement of the
   * ring's members; the tcp btl is kept to the loopback device, where UCX's tcp goes too. */
  char *argv[] = {"mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
                  "-np", np_s, "--mca", "btl", (char *)btl, "--mca", "pml", "ob1",
                  "--mca", "btl_tcp_if_include", "lo", prog, "--sizes", sizes_s, "--op",
                  (char *)op, "--iters", iters_s, "--warmup", warm_s,
                  o->pin ? "--pin" : NULL, NULL};
  proc_t p;
  if (proc_spawn(&p, argv, NULL, UINT_MAX) < 0) {
    snprintf(why, why_len, "cannot start mpirun: %s", strerror(errno));
    return -1;
  }
  int code = proc_finish(&p, fsdp_clock_deadline_ms((int64_t)o->timeout_s * 1000));
  int found = 0;
  for (const char *line = p.text; line && *line;) {
    char opname[32];
    size_t bytes;
    unsigned iters;
    double med, mn, mx;
    if (sscanf(line, "result %31s %zu %u %lf %lf %lf", opname, &bytes, &iters, &med, &mn, &mx) ==
        6) {
      unsigned k = strcmp(opname, "all-gather") == 0 ? 0 : 1;
      size_t want = ((o->mib[size_index] << 20) / o->members / 4) * 4 * o->members;
      if (want == bytes) {
        res[k][size_index].done = true;
        res[k][size_index].median_ms = med;
        found++;
      }
    }
    line = strchr(line, '\n');
    if (line)
      line++;
  }
  if (code != 0)
    snprintf(why, why_len, "mpirun %s: %s", code < 0 ? "timed out or crashed" : "failed",
             tail_of(p.text));
  proc_free(&p);
  return code == 0 && found > 0 ? 0 : -1;
}

/* ---- Options and the report ---- */

static void usage(FILE *f) {
  fprintf(f,
          "usage: fsdp-ucx-bench [--members 2|3] [--sizes MIB,...] "
          "[--op all-gather|reduce-scatter|both]\n"
          "                      [--iters K] [--warmup W] [--chunk BYTES] [--window W]\n"
          "                      [--tls tcp|shm|both|UCX_TLS] [--pin] [--no-p2p] [--no-mpi]\n"
          "                      [--p2p-iters K] [--timeout S]\n"
          "Times the ring all-gather and reduce-scatter (fp32) between member processes on this\n"
          "host, each with its own UCX worker, against ucx_perftest tag_bw and OpenMPI.\n"
          "  --members N    ring members (processes), 2 or 3 (default 2)\n"
          "  --sizes LIST   buffer per member in MiB (default 16,64,256)\n"
          "  --chunk BYTES  the ring's chunk (default 0: the ring's own default)\n"
          "  --window W     chunks in flight per direction (default 0: the ring's default)\n"
          "  --tls T        tcp (UCX_TLS=tcp), shm (posix,sysv,cma,self), both (default), or\n"
          "                 any UCX_TLS value\n"
          "  --pin          member i (and perftest/MPI process i) on CPU i mod the CPU count\n"
          "  --timeout S    bound on each step: a member's run, ucx_perftest, mpirun (120)\n");
}

static int parse_size(const char *s, size_t *ret) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s)
    return -1;
  if (strcmp(end, "KiB") == 0 || strcmp(end, "k") == 0)
    v <<= 10;
  else if (strcmp(end, "MiB") == 0 || strcmp(end, "m") == 0)
    v <<= 20;
  else if (*end)
    return -1;
  *ret = (size_t)v;
  return 0;
}

static int parse_args(int argc, char **argv, options_t *o) {
  *o = (options_t){.members = 2, .mib = {16, 64, 256}, .n_sizes = 3, .ops = {true, true},
                   .iters = 10, .warmup = 2, .p2p = true, .mpi = true, .p2p_iters = 20,
                   .timeout_s = 120};
  const char *tls = "both";
  static const struct option longs[] = {
      {"members", required_argument, NULL, 'n'}, {"sizes", required_argument, NULL, 's'},
      {"op", required_argument, NULL, 'o'},      {"iters", required_argument, NULL, 'i'},
      {"warmup", required_argument, NULL, 'w'},  {"chunk", required_argument, NULL, 'c'},
      {"window", required_argument, NULL, 'W'},  {"tls", required_argument, NULL, 't'},
      {"pin", no_argument, NULL, 'P'},           {"no-p2p", no_argument, NULL, '2'},
      {"no-mpi", no_argument, NULL, 'M'},        {"p2p-iters", required_argument, NULL, 'I'},
      {"timeout", required_argument, NULL, 'T'}, {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0}};
  int c;
  char *end;
  while ((c = getopt_long(argc, argv, "h", longs, NULL)) != -1) {
    unsigned long v = 0;
    if (optarg && strchr("niwWIT", c)) {
      v = strtoul(optarg, &end, 10);
      if (*end || end == optarg || v > 1000000) {
        fprintf(stderr, "fsdp-ucx-bench: '%s' is not a count\n", optarg);
        return -1;
      }
    }
    switch (c) {
    case 'n':
      if (v < 2 || v > MAX_MEMBERS) {
        fprintf(stderr, "fsdp-ucx-bench: --members %lu, expected 2..%d\n", v, MAX_MEMBERS);
        return -1;
      }
      o->members = (unsigned)v;
      break;
    case 's': {
      o->n_sizes = 0;
      const char *p = optarg;
      while (*p) {
        unsigned long long m = strtoull(p, &end, 10);
        if (end == p || m == 0 || m > 4096 || o->n_sizes == MAX_SIZES ||
            (*end != ',' && *end != '\0')) {
          fprintf(stderr, "fsdp-ucx-bench: --sizes '%s', expected up to %d sizes in MiB "
                          "(1..4096), comma-separated\n", optarg, MAX_SIZES);
          return -1;
        }
        o->mib[o->n_sizes++] = (size_t)m;
        p = *end ? end + 1 : end;
      }
      break;
    }
    case 'o':
      o->ops[0] = strcmp(optarg, "all-gather") == 0 || strcmp(optarg, "both") == 0;
      o->ops[1] = strcmp(optarg, "reduce-scatter") == 0 || strcmp(optarg, "both") == 0;
      if (!o->ops[0] && !o->ops[1]) {
        fprintf(stderr, "fsdp-ucx-bench: --op '%s', expected all-gather, reduce-scatter or "
                        "both\n", optarg);
        return -1;
      }
      break;
    case 'i':
    case 'I':
      if (v == 0 || v > MAX_ITERS) {
        fprintf(stderr, "fsdp-ucx-bench: iterations %lu, expected 1..%d\n", v, MAX_ITERS);
        return -1;
      }
      *(c == 'i' ? &o->iters : &o->p2p_iters) = (unsigned)v;
      break;
    case 'w':
      if (v > MAX_ITERS) {
        fprintf(stderr, "fsdp-ucx-bench: --warmup %lu, expected 0..%d\n", v, MAX_ITERS);
        return -1;
      }
      o->warmup = (unsigned)v;
      break;
    case 'c':
      if (parse_size(optarg, &o->chunk) < 0 || o->chunk > ((size_t)1 << 30)) {
        fprintf(stderr, "fsdp-ucx-bench: --chunk '%s', expected bytes (or NKiB, NMiB) up to "
                        "1 GiB\n", optarg);
        return -1;
      }
      break;
    case 'W':
      o->window = (unsigned)v; /* the ring checks the range */
      break;
    case 't':
      tls = optarg;
      break;
    case 'P':
      o->pin = true;
      break;
    case '2':
      o->p2p = false;
      break;
    case 'M':
      o->mpi = false;
      break;
    case 'T':
      if (v < 5) {
        fprintf(stderr, "fsdp-ucx-bench: --timeout %lu, expected at least 5 s\n", v);
        return -1;
      }
      o->timeout_s = (unsigned)v;
      break;
    case 'h':
      usage(stdout);
      exit(EXIT_OK);
    default:
      usage(stderr);
      return -1;
    }
  }
  if (optind < argc) {
    usage(stderr);
    return -1;
  }
  if (strcmp(tls, "both") == 0) {
    o->tls[0] = TLS_PRESETS[0].ucx_tls;
    o->tls[1] = TLS_PRESETS[1].ucx_tls;
    o->n_tls = 2;
  } else {
    o->tls[0] = tls;
    for (size_t k = 0; k < sizeof TLS_PRESETS / sizeof TLS_PRESETS[0]; k++)
      if (strcmp(tls, TLS_PRESETS[k].name) == 0)
        o->tls[0] = TLS_PRESETS[k].ucx_tls;
    o->n_tls = 1;
  }
  return 0;
}

static void fmt_ms(char *out, size_t cap, double ms) {
  snprintf(out, cap, ms >= 100 ? "%.1f" : ms >= 10 ? "%.2f" : "%.3f", ms);
}

typedef struct {
  const char *ucx_tls, *mpi_btl;
  char err_mode[64];
  timing_t ring[N_OPS][MAX_SIZES];
  double p2p[MAX_SIZES];      /* bytes/s of one stream alone, <= 0: none */
  double p2p_ring[MAX_SIZES]; /* bytes/s of one stream of n at once, <= 0: none */
  char p2p_why[256];
  mpi_result_t mpi[N_OPS][MAX_SIZES];
  char mpi_why[512];
} tls_result_t;

static void print_section(const options_t *o, const tls_result_t *r) {
  printf("\nUCX_TLS=%s (%s); OpenMPI over btl %s\n", r->ucx_tls, r->err_mode, r->mpi_btl);
  if (r->p2p_why[0])
    printf("  ucx_perftest: %s\n", r->p2p_why);
  if (r->mpi_why[0])
    printf("  OpenMPI: %s\n", r->mpi_why);
  printf("%-15s %5s %10s %9s %8s %8s %8s %8s %8s %9s %10s %9s\n", "op", "MiB", "median ms",
         "min ms", "algbw", "busbw", "p2p", "bus/p2p", "p2p x n", "bus/p2p n", "MPI ms",
         "ring/MPI");
  for (unsigned op = 0; op < N_OPS; op++) {
    if (!o->ops[op])
      continue;
    for (unsigned s = 0; s < o->n_sizes; s++) {
      const timing_t *tm = &r->ring[op][s];
      if (!tm->done)
        continue;
      double bytes = (double)(((o->mib[s] << 20) / o->members / 4) * 4 * o->members);
      double alg = bytes / (tm->median_ms / 1e3) / 1e9;
      double bus = alg * (o->members - 1) / o->members;
      char med[16], mn[16], p2p[16] = "-", ratio[16] = "-", p2p_n[16] = "-", ratio_n[16] = "-",
           m1[16] = "-", r1[16] = "-";
      fmt_ms(med, sizeof med, tm->median_ms);
      fmt_ms(mn, sizeof mn, tm->min_ms);
      if (r->p2p[s] > 0) {
        snprintf(p2p, sizeof p2p, "%.2f", r->p2p[s] / 1e9);
        snprintf(ratio, sizeof ratio, "%.2f", bus * 1e9 / r->p2p[s]);
      }
      if (r->p2p_ring[s] > 0) {
        snprintf(p2p_n, sizeof p2p_n, "%.2f", r->p2p_ring[s] / 1e9);
        snprintf(ratio_n, sizeof ratio_n, "%.2f", bus * 1e9 / r->p2p_ring[s]);
      }
      if (r->mpi[op][s].done) {
        fmt_ms(m1, sizeof m1, r->mpi[op][s].median_ms);
        snprintf(r1, sizeof r1, "%.2f", tm->median_ms / r->mpi[op][s].median_ms);
      }
      printf("%-15s %5zu %10s %9s %8.2f %8.2f %8s %8s %8s %9s %10s %9s\n",
             fsdp_ring_kind_name(OP_KIND[op]), o->mib[s], med, mn, alg, bus, p2p, ratio, p2p_n,
             ratio_n, m1, r1);
    }
  }
  fflush(stdout);
}

int main(int argc, char **argv) {
  options_t o;
  if (parse_args(argc, argv, &o) < 0)
    return EXIT_USAGE;
  signal(SIGPIPE, SIG_IGN);
  signal(SIGINT, on_fatal_signal);
  signal(SIGTERM, on_fatal_signal);
  ssize_t l = readlink("/proc/self/exe", g_self_dir, sizeof g_self_dir - 1);
  if (l > 0) {
    g_self_dir[l] = '\0';
    char *slash = strrchr(g_self_dir, '/');
    if (slash)
      *slash = '\0';
  }
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  printf("fsdp-ucx-bench: ring all-gather and reduce-scatter, fp32, %u members (processes) on "
         "%ld CPUs%s%s\n", o.members, cpus, o.members > (unsigned)cpus ? " (oversubscribed)" : "",
         o.pin ? ", process i pinned to CPU i mod CPUs" : ", not pinned");
  char chunk_s[32] = "the ring's default", window_s[32] = "the ring's default";
  if (o.chunk)
    snprintf(chunk_s, sizeof chunk_s, "%zu KiB", o.chunk >> 10);
  if (o.window)
    snprintf(window_s, sizeof window_s, "%u", o.window);
  printf("  chunk %s, window %s; %u timed iterations after %u warm-up; an iteration's time is "
         "the slowest member's\n", chunk_s, window_s, o.iters, o.warmup);
  printf("  algbw = size / median time, busbw = size * (n-1)/n / median time, GB/s = 1e9 "
         "bytes/s;\n"
         "  p2p = ucx_perftest tag_bw, one message of the size at a time, same UCX_TLS and tcp "
         "segments;\n"
         "  bus/p2p = busbw / p2p; p2p x n = one stream's tag_bw while n streams run at once in "
         "the ring's\n  pattern (member i to i+1, process of member i on CPU i under --pin: on "
         "one host they share\n  its CPUs and memory as the ring's members do); bus/p2p n = "
         "busbw / that; ring/MPI = ring median /\n  OpenMPI median (below 1: the ring is "
         "faster). Each size runs the ring, then its peers.\n");
  fflush(stdout);

  const char *p2p_skip = NULL, *mpi_skip = NULL;
  if (!o.p2p)
    p2p_skip = "skipped (--no-p2p)";
  else if (!have_program("ucx_perftest"))
    p2p_skip = "skipped: ucx_perftest not found (Debian package ucx-utils; scripts/setup.sh "
               "--bench installs it)";
  if (!o.mpi)
    mpi_skip = "skipped (--no-mpi)";
  else if (!FSDP_BENCH_MPI)
    mpi_skip = "skipped: built without MPI (CMake found no MPI C library when this build was "
               "configured; install openmpi-bin and libopenmpi-dev, e.g. scripts/setup.sh "
               "--bench, and configure again)";
  else if (!have_program("mpirun"))
    mpi_skip = "skipped: mpirun not found (Debian package openmpi-bin)";

  static tls_result_t tr[MAX_TLS];
  int rc = EXIT_OK;
  for (unsigned t = 0; t < o.n_tls && rc == EXIT_OK; t++) {
    tls_result_t *r = &tr[t];
    r->ucx_tls = o.tls[t];
    /* MPI's own transport of the same kind: shared memory against shared memory, tcp
     * against everything else (tcp is the required peer between hosts). */
    r->mpi_btl = strcmp(r->ucx_tls, TLS_PRESETS[1].ucx_tls) == 0 ? TLS_PRESETS[1].mpi_btl
                                                                 : TLS_PRESETS[0].mpi_btl;
    if (p2p_skip)
      snprintf(r->p2p_why, sizeof r->p2p_why, "%s", p2p_skip);
    if (mpi_skip)
      snprintf(r->mpi_why, sizeof r->mpi_why, "%s", mpi_skip);
    group_t g;
    fprintf(stderr, "UCX_TLS=%s: starting %u members\n", r->ucx_tls, o.members);
    if (group_start(&g, &o, r->ucx_tls) < 0) {
      rc = EXIT_FAILED;
      break;
    }
    snprintf(r->err_mode, sizeof r->err_mode, "%s", g.err_mode);
    /* Size by size, the ring and then its peers, so that a change in the machine's load
     * during the run shows in both sides of a ratio rather than in one. */
    for (unsigned s = 0; s < o.n_sizes && rc == EXIT_OK; s++) {
      for (unsigned op = 0; op < N_OPS && rc == EXIT_OK; op++) {
        if (!o.ops[op])
          continue;
        fprintf(stderr, "UCX_TLS=%s: ring %s %zu MiB\n", r->ucx_tls,
                fsdp_ring_kind_name(OP_KIND[op]), o.mib[s]);
        if (group_run(&g, &o, op, o.mib[s], &r->ring[op][s]) < 0)
          rc = EXIT_FAILED;
      }
      if (rc != EXIT_OK)
        break;
      size_t bytes = ((o.mib[s] << 20) / o.members / 4) * 4 * o.members;
      if (!p2p_skip) {
        fprintf(stderr, "UCX_TLS=%s: ucx_perftest tag_bw %zu bytes\n", r->ucx_tls, bytes);
        char why[256];
        r->p2p[s] = run_perftest(&o, r->ucx_tls, bytes, 1, why, sizeof why);
        if (r->p2p[s] > 0 && o.members > 1) {
          fprintf(stderr, "UCX_TLS=%s: %u ucx_perftest tag_bw streams at once\n", r->ucx_tls,
                  o.members);
          r->p2p_ring[s] = run_perftest(&o, r->ucx_tls, bytes, o.members, why, sizeof why);
        }
        if (r->p2p[s] <= 0 || (o.members > 1 && r->p2p_ring[s] <= 0))
          snprintf(r->p2p_why, sizeof r->p2p_why, "%zu MiB: %.200s", o.mib[s], why);
      }
      if (!mpi_skip) {
        fprintf(stderr, "OpenMPI btl %s: %u ranks, %zu MiB\n", r->mpi_btl, o.members, o.mib[s]);
        char why[512];
        if (run_mpi(&o, r->mpi_btl, s, r->mpi, why, sizeof why) < 0)
          snprintf(r->mpi_why, sizeof r->mpi_why, "%zu MiB: %.450s", o.mib[s], why);
      }
    }
    group_stop(&g);
    print_section(&o, r);
  }
  return rc;
}
