/* The UCX transport and its ring collectives between real processes: n = 1, 2 and 3 forked
 * members, each with its own loop and ucp worker, exchange their addresses through the
 * parent (socketpairs made before the fork), run every collective for every dtype on odd
 * sizes, with the data in the buffer and again made by a produce hook and read by a
 * finalize hook (each chunk finalized exactly once), and compare with a reference each
 * computes itself. (The parent never uses libuv's thread pool: a child forked after it
 * started would inherit pool threads that no longer exist.) The sums are compared bit for
 * bit: the ring's summation order is fixed (region r is summed around the ring from member
 * r + 1, each addition rounded to the dtype, see ring.h), so the reference adds in that
 * order with the same rounding (fp32 addition of exact values, then fsdp_cast), and there
 * is no tolerance to state.
 *
 * Faults: a member SIGKILLed or SIGSTOPped in the middle of an all-reduce must end the
 * survivors' collectives with an error naming it, within the deadline plus slack; a
 * cancelled collective ends on both sides. Every wait here is bounded: the members' loops
 * by a guard timer, the parent's reads by poll timeouts, the children by a reaping deadline
 * after which they are killed.
 *
 * The suite runs twice (see tests/CMakeLists.txt): UCX_TLS=tcp with peer error handling
 * (FSDP_TEST_UCX_ERR_MODE=peer), and shared memory (posix, sysv, cma) without it. */
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "collectives/ring.h"
#include "common/clock.h"
#include "kernels/kernels.h"
#include "transport/ucx.h"

#define MAX_N 3
#define IO_TIMEOUT_MS 20000
#define REAP_TIMEOUT_MS 30000

/* ---- Small bounded I/O between parent and members ---- */

static int io_full(int fd, void *buf, size_t len, bool writing, int timeout_ms) {
  char *p = buf;
  int64_t end = fsdp_clock_now_ms() + timeout_ms;
  while (len > 0) {
    struct pollfd pfd = {.fd = fd, .events = writing ? POLLOUT : POLLIN};
    int left = (int)(end - fsdp_clock_now_ms());
    if (left <= 0 || poll(&pfd, 1, left) <= 0)
      return -ETIMEDOUT;
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

static int send_blob(int fd, const void *p, uint32_t len) {
  int r = io_full(fd, &len, sizeof len, true, IO_TIMEOUT_MS);
  return r < 0 ? r : io_full(fd, (void *)p, len, true, IO_TIMEOUT_MS);
}

/* Reads one blob (at most cap bytes, NUL-terminated when it fits) into buf. */
static int recv_blob(int fd, void *buf, uint32_t cap, uint32_t *ret_len, int timeout_ms) {
  uint32_t len;
  int r = io_full(fd, &len, sizeof len, false, timeout_ms);
  if (r < 0)
    return r;
  if (len > cap)
    return -EMSGSIZE;
  r = io_full(fd, buf, len, false, timeout_ms);
  if (r < 0)
    return r;
  if (len < cap)
    ((char *)buf)[len] = '\0';
  *ret_len = len;
  return 0;
}

/* ---- A member (runs in a forked child) ---- */

typedef struct member {
  unsigned n, self;
  int sock;
  uv_loop_t loop;
  fsdp_ucx_t *ucx;
  fsdp_ucx_peer_t *peers[MAX_N];
  char labels[MAX_N][32];
  uv_prepare_t slow;
  bool slow_on;
} member_t;

__attribute__((format(printf, 2, 3))) static void report(member_t *m, const char *fmt, ...) {
  char text[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  send_blob(m->sock, text, (uint32_t)strlen(text));
}

static fsdp_ucx_err_mode_t test_err_mode(void) {
  const char *e = getenv("FSDP_TEST_UCX_ERR_MODE");
  if (e && strcmp(e, "peer") == 0)
    return FSDP_UCX_ERR_PEER;
  return FSDP_UCX_ERR_AUTO;
}

static int member_setup(member_t *m) {
  uv_loop_init(&m->loop);
  fsdp_status_t st = FSDP_STATUS_INIT;
  fsdp_ucx_options_t opt = {.err_mode = test_err_mode()};
  if (fsdp_ucx_new(&m->loop, &opt, &m->ucx, &st) < 0) {
    report(m, "FAIL member %u: %s", m->self, st.message);
    return -1;
  }
  const void *addr;
  size_t len;
  fsdp_ucx_address(m->ucx, &addr, &len);
  if (send_blob(m->sock, addr, (uint32_t)len) < 0)
    return -1;
  for (unsigned j = 0; j < m->n; j++) {
    unsigned char buf[4096];
    uint32_t got;
    if (recv_blob(m->sock, buf, sizeof buf, &got, IO_TIMEOUT_MS) < 0)
      return -1;
    snprintf(m->labels[j], sizeof m->labels[j], "host %u (test)", j);
    if (j == m->self)
      continue;
    if (fsdp_ucx_connect(m->ucx, buf, got, m->labels[j], &m->peers[j], &st) < 0) {
      report(m, "FAIL member %u: %s", m->self, st.message);
      return -1;
    }
  }
  /* Everyone connected before anyone starts: a member that finished and closed its
   * transport before another connected to it would make that connect fail. */
  char go[8];
  uint32_t got;
  if (send_blob(m->sock, "ready", 5) < 0 || recv_blob(m->sock, go, sizeof go, &got, IO_TIMEOUT_MS) < 0)
    return -1;
  /* The loop has not run since it was made: the collectives' deadlines (uv_now + ms) must
   * count from now, not from before the waits above. */
  uv_update_time(&m->loop);
  return 0;
}

static void on_closed(void *arg) {
  *(bool *)arg = true;
}

static void on_guard(uv_timer_t *h) {
  (void)h;
}

/* Runs the loop until *flag is set or timeout_ms passes; a guard timer bounds each wait. */
static bool run_until(member_t *m, const bool *flag, int timeout_ms) {
  uv_timer_t guard;
  uv_timer_init(&m->loop, &guard);
  uv_timer_start(&guard, on_guard, 50, 50);
  int64_t end = fsdp_clock_now_ms() + timeout_ms;
  while (!*flag && fsdp_clock_now_ms() < end)
    uv_run(&m->loop, UV_RUN_ONCE);
  uv_close((uv_handle_t *)&guard, NULL);
  uv_run(&m->loop, UV_RUN_NOWAIT);
  return *flag;
}

static void on_parent(uv_poll_t *h, int status, int events) {
  (void)status;
  (void)events;
  *(bool *)h->data = true;
}

/* Waits up to timeout_ms for the parent to write, with the loop running as a daemon's always
 * does. Over shared memory a peer's sends that this member's worker has not taken end only
 * when it takes them (UCX cannot close such an endpoint without waiting): a member that
 * stopped its loop here would hold up a collective that failed on the others. */
static bool wait_parent(member_t *m, int timeout_ms) {
  bool readable = false;
  uv_poll_t watch;
  uv_poll_init(&m->loop, &watch, m->sock);
  watch.data = &readable;
  uv_poll_start(&watch, UV_READABLE, on_parent);
  run_until(m, &readable, timeout_ms);
  uv_close((uv_handle_t *)&watch, NULL);
  uv_run(&m->loop, UV_RUN_NOWAIT);
  return readable;
}

static int member_teardown(member_t *m) {
  bool closed = false;
  if (m->slow_on)
    uv_close((uv_handle_t *)&m->slow, NULL);
  fsdp_ucx_close(m->ucx, on_closed, &closed);
  if (!run_until(m, &closed, 5000))
    return -1;
  uv_run(&m->loop, UV_RUN_DEFAULT);
  return uv_loop_close(&m->loop) == 0 ? 0 : -1;
}

/* ---- Data and reference ---- */

/* Member m's value for element e: deterministic, of mixed sign and magnitude, exactly
 * representable in dtype t (rounded through fsdp_cast). */
static void fill_member(void *dst, fsdp_dtype_t t, unsigned member, size_t first, size_t count,
                        uint32_t seed) {
  float *f = malloc((count ? count : 1) * sizeof *f);
  for (size_t i = 0; i < count; i++) {
    uint32_t x = (uint32_t)(first + i) * 2654435761u ^ (member + 1) * 40503u ^ seed * 97u;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    int exp = (int)(x % 17) - 8;
    float v = ldexpf(1.0f + (float)((x >> 8) & 0x3ff) / 1024.0f, exp);
    f[i] = (x >> 31) ? -v : v;
  }
  fsdp_cast(dst, t, f, FSDP_DTYPE_FP32, count);
  free(f);
}

/* Region r's sum as the ring builds it: from member r + 1 around to r, each step rounded. */
static void ring_sum(void *out, fsdp_dtype_t t, unsigned n, unsigned r, size_t elems,
                     uint32_t seed) {
  size_t es = fsdp_dtype_size(t);
  void *x = malloc(elems * es + 1);
  float *acc = malloc(elems * 4 + 4), *v = malloc(elems * 4 + 4);
  fill_member(out, t, (r + 1) % n, r * elems, elems, seed);
  fsdp_cast(acc, FSDP_DTYPE_FP32, out, t, elems);
  for (unsigned s = 2; s <= n; s++) {
    fill_member(x, t, (r + s) % n, r * elems, elems, seed);
    fsdp_cast(v, FSDP_DTYPE_FP32, x, t, elems);
    for (size_t i = 0; i < elems; i++)
      acc[i] += v[i];
    fsdp_cast(out, t, acc, FSDP_DTYPE_FP32, elems); /* round to t once per addition */
    fsdp_cast(acc, FSDP_DTYPE_FP32, out, t, elems);
  }
  free(x);
  free(acc);
  free(v);
}

typedef struct result {
  bool done;
  fsdp_status_t st;
  int64_t elapsed_ms;
  int64_t start_ms;
} result_t;

static void on_ring_done(fsdp_ring_t *ring, const fsdp_status_t *st, void *arg) {
  (void)ring;
  result_t *res = arg;
  res->st = *st;
  res->elapsed_ms = fsdp_clock_now_ms() - res->start_ms;
  res->done = true;
}

typedef struct shape {
  size_t elems;
  size_t chunk_bytes;
  unsigned window;
} shape_t;

/* A hooked collective: the member's contribution is made by `produce`, chunk by chunk, and
 * `finalize` copies each final chunk out and counts the bytes it was given. */
typedef struct hooks {
  const member_t *m;
  fsdp_ring_kind_t kind;
  fsdp_dtype_t t;
  size_t rb;
  uint32_t seed;
  unsigned char *buf, *out, *finalized;
  unsigned fail_region; /* produce fails here (FSDP_RING_MAX: never) */
} hooks_t;

static int hook_produce(void *arg, unsigned region, size_t off, size_t bytes) {
  hooks_t *h = arg;
  size_t es = fsdp_dtype_size(h->t);
  if (region >= h->m->n || off % es || bytes % es || off + bytes > h->rb ||
      (h->kind == FSDP_RING_ALL_GATHER && region != h->m->self))
    return -ERANGE;
  if (region == h->fail_region)
    return -EIO;
  fill_member(h->buf + region * h->rb + off, h->t, h->m->self, (region * h->rb + off) / es,
              bytes / es, h->seed);
  return 0;
}

static int hook_finalize(void *arg, unsigned region, size_t off, size_t bytes) {
  hooks_t *h = arg;
  if (region >= h->m->n || off + bytes > h->rb)
    return -ERANGE;
  size_t at = region * h->rb + off;
  memcpy(h->out + at, h->buf + at, bytes);
  for (size_t i = 0; i < bytes; i++)
    h->finalized[at + i]++;
  return 0;
}

/* Runs one collective and checks the buffer; returns 0, or -1 after reporting. hooked: the
 * member's data comes from produce and the result is read through finalize. */
static int check_collective(member_t *m, fsdp_ring_kind_t kind, fsdp_dtype_t t, shape_t sh,
                            uint32_t op_id, bool hooked) {
  size_t es = fsdp_dtype_size(t), rb = sh.elems * es, total = rb * m->n;
  unsigned char *buf = malloc(total + 1), *want = malloc(total + 1);
  unsigned char *out = calloc(total + 1, 1), *finalized = calloc(total + 1, 1);
  hooks_t h = {.m = m, .kind = kind, .t = t, .rb = rb, .seed = op_id, .buf = buf, .out = out,
               .finalized = finalized, .fail_region = FSDP_RING_MAX};
  memset(buf, 0xa5, total);
  if (!hooked && kind == FSDP_RING_ALL_GATHER) /* hooked: produce writes the member's part */
    fill_member(buf + m->self * rb, t, m->self, m->self * sh.elems, sh.elems, op_id);
  else if (!hooked)
    fill_member(buf, t, m->self, 0, sh.elems * m->n, op_id);
  for (unsigned r = 0; r < m->n; r++) {
    if (kind == FSDP_RING_ALL_GATHER)
      fill_member(want + r * rb, t, r, r * sh.elems, sh.elems, op_id);
    else if (kind == FSDP_RING_ALL_REDUCE || r == m->self)
      ring_sum(want + r * rb, t, m->n, r, sh.elems, op_id);
  }
  result_t res = {.start_ms = fsdp_clock_now_ms()};
  fsdp_ring_args_t a = {.kind = kind, .n = m->n, .self = m->self, .peers = m->peers,
                        .buf = buf, .region_bytes = rb, .dtype = t, .op_id = op_id,
                        .deadline_ms = uv_now(&m->loop) + 15000,
                        .chunk_bytes = sh.chunk_bytes, .window = sh.window};
  fsdp_status_t st = FSDP_STATUS_INIT;
  fsdp_ring_t *ring;
  int rc = -1;
  const char *what = fsdp_ring_kind_name(kind);
  /* The hooked runs also move their chunks from and to memory registered with UCX. */
  fsdp_ucx_mem_t *buf_mem = NULL, *scratch_mem = NULL;
  size_t chunk = sh.chunk_bytes ? sh.chunk_bytes / es * es : (size_t)1 << 20;
  size_t scratch_bytes = chunk * (sh.window ? sh.window : 8);
  void *scratch = hooked ? malloc(scratch_bytes) : NULL;
  if (hooked) {
    a.produce = hook_produce;
    a.finalize = hook_finalize;
    a.hook_arg = &h;
    if (kind != FSDP_RING_ALL_GATHER) {
      a.scratch = scratch;
      a.scratch_bytes = scratch_bytes;
    }
    if ((total > 0 && fsdp_ucx_mem_register(m->ucx, buf, total, &buf_mem, &st) < 0) ||
        fsdp_ucx_mem_register(m->ucx, scratch, scratch_bytes, &scratch_mem, &st) < 0) {
      report(m, "FAIL member %u: registering memory: %s", m->self, st.message);
      goto out;
    }
    a.buf_mem = buf_mem;
    a.scratch_mem = scratch_mem;
  }
  if (fsdp_ring_start(m->ucx, &a, on_ring_done, &res, &ring, &st) < 0) {
    report(m, "FAIL member %u: %s %s start: %s", m->self, what, fsdp_dtype_name(t), st.message);
    goto out;
  }
  if (!run_until(m, &res.done, 20000)) {
    report(m, "FAIL member %u: %s %s of %zu elements: no callback in 20 s", m->self, what,
            fsdp_dtype_name(t), sh.elems);
    goto out;
  }
  if (res.st.code != 0) {
    report(m, "FAIL member %u: %s %s of %zu elements: %s", m->self, what, fsdp_dtype_name(t),
           sh.elems, res.st.message);
    goto out;
  }
  const unsigned char *got = hooked ? out : buf;
  for (unsigned r = 0; r < m->n; r++) {
    bool ends_with = kind != FSDP_RING_REDUCE_SCATTER || r == m->self;
    for (size_t i = 0; i < sh.elems; i++) {
      size_t off = r * rb + i * es;
      if (hooked && finalized[off] != ends_with) {
        report(m, "FAIL member %u of %u: hooked %s %s, %zu elements per region: region %u "
                  "element %zu finalized %u times, expected %u",
               m->self, m->n, what, fsdp_dtype_name(t), sh.elems, r, i, finalized[off],
               (unsigned)ends_with);
        goto out;
      }
      if (ends_with && memcmp(got + off, want + off, es) != 0) {
        uint32_t g = 0, w = 0;
        memcpy(&g, got + off, es);
        memcpy(&w, want + off, es);
        report(m, "FAIL member %u of %u: %s%s %s, %zu elements per region, chunk %zu, window "
                  "%u: region %u element %zu is 0x%x, expected 0x%x",
               m->self, m->n, hooked ? "hooked " : "", what, fsdp_dtype_name(t), sh.elems,
               sh.chunk_bytes, sh.window, r, i, g, w);
        goto out;
      }
    }
  }
  rc = 0;
out:
  fsdp_ucx_mem_deregister(buf_mem);
  fsdp_ucx_mem_deregister(scratch_mem);
  free(scratch);
  free(buf);
  free(want);
  free(out);
  free(finalized);
  return rc;
}

/* Member 0's produce fails for the region it makes first (n - 1, which it sends first):
 * every member needs a chunk that is never sent, so every collective fails, and member 0's
 * message names the produce. */
static int check_produce_failure(member_t *m, uint32_t op_id) {
  size_t elems = 4096, rb = elems * 4;
  unsigned char *buf = malloc(rb * m->n), *out = malloc(rb * m->n), *fin = calloc(rb * m->n, 1);
  hooks_t h = {.m = m, .kind = FSDP_RING_REDUCE_SCATTER, .t = FSDP_DTYPE_FP32, .rb = rb,
               .seed = op_id, .buf = buf, .out = out, .finalized = fin,
               .fail_region = m->self == 0 ? m->n - 1 : FSDP_RING_MAX};
  result_t res = {.start_ms = fsdp_clock_now_ms()};
  fsdp_ring_args_t a = {.kind = FSDP_RING_REDUCE_SCATTER, .n = m->n, .self = m->self,
                        .peers = m->peers, .buf = buf, .region_bytes = rb,
                        .dtype = FSDP_DTYPE_FP32, .op_id = op_id,
                        .deadline_ms = uv_now(&m->loop) + 15000, .chunk_bytes = 4096,
                        .produce = hook_produce, .finalize = hook_finalize, .hook_arg = &h};
  fsdp_status_t st = FSDP_STATUS_INIT;
  fsdp_ring_t *ring;
  int rc = -1;
  if (fsdp_ring_start(m->ucx, &a, on_ring_done, &res, &ring, &st) < 0) {
    report(m, "FAIL member %u: produce failure start: %s", m->self, st.message);
  } else if (!run_until(m, &res.done, 20000)) {
    report(m, "FAIL member %u: no callback 20 s after member 0's produce failed", m->self);
  } else if (res.st.code >= 0 ||
             (m->self == 0 && (!strstr(res.st.message, "the produce of region ") ||
                               !strstr(res.st.message, "failed: Input/output error")))) {
    report(m, "FAIL member %u: after member 0's produce failed: %d %s", m->self, res.st.code,
           res.st.message);
  } else {
    rc = 0;
  }
  free(buf);
  free(out);
  free(fin);
  return rc;
}

static const shape_t SHAPES[] = {
    {0, 0, 0},          /* nothing to move */
    {1, 0, 0},          /* one element */
    {7, 8, 2},          /* 2-element chunks (fp32), the last one short */
    {1000, 0, 0},       /* smaller than one chunk */
    {50001, 16384, 3},  /* many chunks, region not a multiple of the chunk */
    {300007, 0, 0},     /* more than one default (1 MiB) chunk for fp32 */
};

static int member_correctness(member_t *m) {
  static const fsdp_dtype_t types[] = {FSDP_DTYPE_FP32, FSDP_DTYPE_BF16, FSDP_DTYPE_FP16};
  uint32_t op = 1;
  for (int k = 0; k < 3; k++)
    for (int ti = 0; ti < 3; ti++)
      for (size_t s = 0; s < sizeof SHAPES / sizeof SHAPES[0]; s++)
        for (int hooked = 0; hooked < 2; hooked++)
          if (check_collective(m, (fsdp_ring_kind_t)k, types[ti], SHAPES[s], op++, hooked) < 0)
            return -1;
  if (m->n > 1 && check_produce_failure(m, op++) < 0)
    return -1;
  report(m, "OK");
  return 0;
}

/* ---- Fault scenarios ---- */

enum scenario { CORRECTNESS, FAULT_VICTIM, FAULT_SURVIVOR, CANCEL_EARLY, CANCEL_PEER };

#define FAULT_DEADLINE_MS 2000
#define FAULT_ELEMS (256 * 1024)

/* The victim sleeps on every loop iteration, so that the collective is certain to still be
 * running when the parent kills or stops it. */
static void on_slow(uv_prepare_t *h) {
  (void)h;
  usleep(5000);
}

static int member_fault(member_t *m, bool victim) {
  size_t rb = FAULT_ELEMS * 4;
  float *buf = calloc(FAULT_ELEMS * m->n, 4);
  result_t res = {.start_ms = fsdp_clock_now_ms()};
  fsdp_ring_args_t a = {.kind = FSDP_RING_ALL_REDUCE, .n = m->n, .self = m->self,
                        .peers = m->peers, .buf = buf, .region_bytes = rb,
                        .dtype = FSDP_DTYPE_FP32, .op_id = 77,
                        .deadline_ms = uv_now(&m->loop) + FAULT_DEADLINE_MS,
                        .chunk_bytes = 8192, .window = 2};
  if (victim) {
    a.deadline_ms = uv_now(&m->loop) + 60000;
    uv_prepare_init(&m->loop, &m->slow);
    uv_prepare_start(&m->slow, on_slow);
    m->slow_on = true;
  }
  fsdp_status_t st = FSDP_STATUS_INIT;
  fsdp_ring_t *ring;
  if (fsdp_ring_start(m->ucx, &a, on_ring_done, &res, &ring, &st) < 0) {
    report(m, "FAIL member %u: start: %s", m->self, st.message);
    free(buf);
    return -1;
  }
  if (victim)
    report(m, "started");
  bool ok = run_until(m, &res.done, FAULT_DEADLINE_MS + 10000);
  if (!ok)
    report(m, "FAIL member %u: no callback %d ms after the start", m->self,
           FAULT_DEADLINE_MS + 10000);
  else
    report(m, "%d %lld %s", res.st.code, (long long)res.elapsed_ms, res.st.message);
  free(buf);
  return ok ? 0 : -1;
}

/* Member 0 cancels right after the start; member 1 must hear of it. */
static int member_cancel(member_t *m) {
  size_t rb = FAULT_ELEMS * 4;
  float *buf = calloc(FAULT_ELEMS * m->n, 4);
  result_t res = {.start_ms = fsdp_clock_now_ms()};
  fsdp_ring_args_t a = {.kind = FSDP_RING_ALL_REDUCE, .n = m->n, .self = m->self,
                        .peers = m->peers, .buf = buf, .region_bytes = rb,
                        .dtype = FSDP_DTYPE_FP32, .op_id = 99,
                        .deadline_ms = uv_now(&m->loop) + 10000,
                        .chunk_bytes = 8192, .window = 2};
  fsdp_status_t st = FSDP_STATUS_INIT;
  fsdp_ring_t *ring;
  if (fsdp_ring_start(m->ucx, &a, on_ring_done, &res, &ring, &st) < 0) {
    report(m, "FAIL member %u: start: %s", m->self, st.message);
    free(buf);
    return -1;
  }
  if (m->self == 0)
    fsdp_ring_cancel(ring);
  bool ok = run_until(m, &res.done, 12000);
  if (!ok)
    report(m, "FAIL member %u: no callback after a cancel", m->self);
  else
    report(m, "%d %lld %s", res.st.code, (long long)res.elapsed_ms, res.st.message);
  free(buf);
  return ok ? 0 : -1;
}

static void member_main(unsigned n, unsigned self, int sock, enum scenario sc,
                        unsigned victim) {
  /* cmocka's handlers would turn a crash here into a return into the parent's test list,
   * inside the child: a crash must end the member and show in its exit status. */
  static const int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
    signal(sigs[i], SIG_DFL);
  member_t m = {.n = n, .self = self, .sock = sock};
  int rc = member_setup(&m);
  if (rc == 0) {
    switch (sc) {
    case CORRECTNESS:
      rc = member_correctness(&m);
      break;
    case FAULT_VICTIM:
    case FAULT_SURVIVOR:
      rc = member_fault(&m, self == victim);
      break;
    case CANCEL_EARLY:
    case CANCEL_PEER:
      rc = member_cancel(&m);
      break;
    }
    /* Nobody closes its transport while another may still be receiving from it. */
    char bye[8];
    uint32_t got;
    if (wait_parent(&m, REAP_TIMEOUT_MS))
      recv_blob(sock, bye, sizeof bye, &got, IO_TIMEOUT_MS);
    if (member_teardown(&m) < 0) {
      report(&m, "FAIL member %u: the transport did not close cleanly", self);
      rc = -1;
    }
  }
  close(sock);
  /* exit, not _exit: under ASan the leak check runs in every member too. */
  exit(rc == 0 ? 0 : 1);
}

/* ---- The parent ---- */

typedef struct group {
  unsigned n;
  pid_t pid[MAX_N];
  int sock[MAX_N];
} group_t;

static void group_start(group_t *g, unsigned n, enum scenario sc, unsigned victim) {
  g->n = n;
  for (unsigned i = 0; i < n; i++) {
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
      close(sv[0]);
      for (unsigned j = 0; j < i; j++)
        close(g->sock[j]);
      member_main(n, i, sv[1], sc, victim);
    }
    close(sv[1]);
    g->pid[i] = pid;
    g->sock[i] = sv[0];
  }
  /* Gather every address, then give each member the whole table. */
  static unsigned char addr[MAX_N][4096];
  uint32_t len[MAX_N] = {0}; /* each set by recv_blob, or the test has failed */
  for (unsigned i = 0; i < n; i++) {
    int r = recv_blob(g->sock[i], addr[i], sizeof addr[i], &len[i], IO_TIMEOUT_MS);
    if (r < 0)
      fail_msg("member %u sent no address: %s", i, strerror(-r));
  }
  for (unsigned i = 0; i < n; i++)
    for (unsigned j = 0; j < n; j++)
      assert_int_equal(send_blob(g->sock[i], addr[j], len[j]), 0);
  char ready[8];
  for (unsigned i = 0; i < n; i++) {
    int r = recv_blob(g->sock[i], ready, sizeof ready, &len[i], IO_TIMEOUT_MS);
    if (r < 0)
      fail_msg("member %u did not connect: %s", i, strerror(-r));
  }
  for (unsigned i = 0; i < n; i++)
    assert_int_equal(send_blob(g->sock[i], "go", 2), 0);
}

/* The next line member i reports, within timeout_ms. */
static void group_read(group_t *g, unsigned i, char *out, size_t cap, int timeout_ms) {
  uint32_t len;
  int r = recv_blob(g->sock[i], out, (uint32_t)cap - 1, &len, timeout_ms);
  if (r < 0)
    fail_msg("member %u reported nothing within %d ms: %s", i, timeout_ms, strerror(-r));
}

/* Waits for every member to exit, killing any still running at the deadline. Returns how
 * many exited with 0. */
static unsigned group_reap(group_t *g) {
  unsigned ok = 0;
  for (unsigned i = 0; i < g->n; i++)
    send_blob(g->sock[i], "bye", 3);
  int64_t end = fsdp_clock_now_ms() + REAP_TIMEOUT_MS;
  for (unsigned i = 0; i < g->n; i++) {
    int status = 0;
    pid_t r;
    while ((r = waitpid(g->pid[i], &status, WNOHANG)) == 0 && fsdp_clock_now_ms() < end)
      usleep(2000);
    if (r == 0) {
      kill(g->pid[i], SIGKILL);
      waitpid(g->pid[i], &status, 0);
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
      ok++;
    } else { /* why, when the member said: its last report, if any came after the test's */
      char last[1024];
      uint32_t len = 0;
      if (recv_blob(g->sock[i], last, sizeof last - 1, &len, 100) < 0)
        len = 0;
      last[len] = '\0';
      print_message("member %u ended with status 0x%x: %s\n", i, (unsigned)status,
                    len ? last : "(no report)");
    }
    close(g->sock[i]);
  }
  return ok;
}

static void run_correctness(unsigned n) {
  group_t g;
  group_start(&g, n, CORRECTNESS, 0);
  char line[1024];
  for (unsigned i = 0; i < n; i++) {
    group_read(&g, i, line, sizeof line, 120000);
    if (strcmp(line, "OK") != 0) {
      group_reap(&g);
      fail_msg("n = %u: %s", n, line);
    }
  }
  assert_int_equal(group_reap(&g), n);
}

/* One member: no transfers, but every chunk still goes through the hooks. */
static void test_collectives_one(void **state) {
  (void)state;
  run_correctness(1);
}

static void test_collectives_two(void **state) {
  (void)state;
  run_correctness(2);
}

static void test_collectives_three(void **state) {
  (void)state;
  run_correctness(3);
}

/* Member 2 of 3 is killed (or stopped) 100 ms into an all-reduce it is slowly taking part
 * in. The survivors' callbacks must come with an error naming "member 2 (host 2 (test))",
 * within the deadline plus a slack for the grace, the drain and a loaded machine; with peer
 * error handling a killed member is reported well before the deadline. */
static void run_fault(int sig) {
  group_t g;
  const unsigned victim = 2;
  group_start(&g, 3, FAULT_SURVIVOR, victim);
  char line[1024];
  group_read(&g, victim, line, sizeof line, IO_TIMEOUT_MS);
  assert_string_equal(line, "started");
  usleep(100 * 1000);
  assert_int_equal(kill(g.pid[victim], sig), 0);
  bool peer_mode = test_err_mode() == FSDP_UCX_ERR_PEER;
  for (unsigned i = 0; i < 2; i++) {
    group_read(&g, i, line, sizeof line, FAULT_DEADLINE_MS + 15000);
    int code;
    long long elapsed;
    int off = 0;
    if (sscanf(line, "%d %lld %n", &code, &elapsed, &off) != 2) {
      kill(g.pid[victim], SIGKILL);
      group_reap(&g);
      fail_msg("member %u: %s", i, line);
    }
    const char *msg = line + off;
    print_message("member %u after %s of member 2: %lld ms: %s\n", i,
                  sig == SIGKILL ? "SIGKILL" : "SIGSTOP", elapsed, msg);
    assert_true(code < 0);
    if (!strstr(msg, "member 2 (host 2 (test))"))
      fail_msg("member %u's error does not name member 2: %s", i, msg);
    assert_true(elapsed < FAULT_DEADLINE_MS + 1500);
    if (sig == SIGKILL && peer_mode)
      assert_true(elapsed < FAULT_DEADLINE_MS);
    if (sig == SIGSTOP)
      assert_true(elapsed >= FAULT_DEADLINE_MS - 50);
  }
  kill(g.pid[victim], SIGKILL);
  /* The survivors must still close their transports and exit cleanly. */
  unsigned ok = group_reap(&g);
  assert_int_equal(ok, 2);
}

static void test_member_killed(void **state) {
  (void)state;
  run_fault(SIGKILL);
}

static void test_member_stopped(void **state) {
  (void)state;
  run_fault(SIGSTOP);
}

static void test_cancel(void **state) {
  (void)state;
  group_t g;
  group_start(&g, 2, CANCEL_EARLY, 0);
  char line[1024];
  for (unsigned i = 0; i < 2; i++) {
    group_read(&g, i, line, sizeof line, 15000);
    int code;
    long long elapsed;
    int off = 0;
    if (sscanf(line, "%d %lld %n", &code, &elapsed, &off) != 2)
      fail_msg("member %u: %s", i, line);
    print_message("member %u: %lld ms: %s\n", i, elapsed, line + off);
    if (i == 0) {
      assert_int_equal(code, FSDP_E_CANCELLED);
      assert_non_null(strstr(line + off, "cancelled by the caller"));
    } else {
      /* Member 1 hears member 0's abort message, or, when member 0 closed its transport
       * first, that its connection failed: either way the error names member 0. */
      assert_true(code < 0);
      assert_non_null(strstr(line + off, "member 0 (host 0 (test))"));
    }
    assert_true(elapsed < 5000);
  }
  assert_int_equal(group_reap(&g), 2);
}

/* ---- In one process: n = 1 and argument checks ---- */

static void on_single(fsdp_ring_t *ring, const fsdp_status_t *st, void *arg) {
  (void)ring;
  result_t *res = arg;
  res->st = *st;
  res->done = true;
}

static void test_single_member_and_arguments(void **state) {
  (void)state;
  uv_loop_t loop;
  uv_loop_init(&loop);
  fsdp_status_t st = FSDP_STATUS_INIT;
  fsdp_ucx_t *ucx;
  assert_int_equal(fsdp_ucx_new(&loop, NULL, &ucx, &st), 0);

  float buf[5] = {1, 2, 3, 4, 5};
  for (int k = 0; k < 3; k++) {
    result_t res = {0};
    fsdp_ring_args_t a = {.kind = (fsdp_ring_kind_t)k, .n = 1, .buf = buf, .region_bytes = 20,
                          .dtype = FSDP_DTYPE_FP32, .op_id = 5,
                          .deadline_ms = uv_now(&loop) + 1000};
    fsdp_ring_t *ring;
    assert_int_equal(fsdp_ring_start(ucx, &a, on_single, &res, &ring, &st), 0);
    assert_false(res.done); /* never from inside start */
    for (int i = 0; i < 100 && !res.done; i++)
      uv_run(&loop, UV_RUN_ONCE);
    assert_true(res.done);
    assert_int_equal(res.st.code, 0);
    assert_true(buf[4] == 5.0f);
  }

  result_t res = {0};
  fsdp_ring_t *ring;
  fsdp_ring_args_t bad = {.kind = FSDP_RING_ALL_GATHER, .n = 17, .buf = buf, .region_bytes = 4};
  assert_int_equal(fsdp_ring_start(ucx, &bad, on_single, &res, &ring, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "member 0 of 17"));
  bad.n = 2;
  assert_int_equal(fsdp_ring_start(ucx, &bad, on_single, &res, &ring, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "neighbours 1 and 1"));
  bad.n = 1;
  bad.dtype = FSDP_DTYPE_FP32;
  bad.region_bytes = 6;
  assert_int_equal(fsdp_ring_start(ucx, &bad, on_single, &res, &ring, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "region of 6 bytes"));

  /* Address bytes that are not ours are refused, naming the label. */
  fsdp_ucx_peer_t *peer;
  assert_int_equal(fsdp_ucx_connect(ucx, "garbage", 7, "host 9 (x)", &peer, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "host 9 (x)"));
  const void *addr;
  size_t len;
  fsdp_ucx_address(ucx, &addr, &len);
  unsigned char *copy = malloc(len);
  memcpy(copy, addr, len);
  copy[7] = 9; /* format version */
  assert_int_equal(fsdp_ucx_connect(ucx, copy, len, "host 9 (x)", &peer, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "format version 9, expected 1"));
  free(copy);

  bool closed = false;
  fsdp_ucx_close(ucx, on_closed, &closed);
  for (int i = 0; i < 100 && !closed; i++)
    uv_run(&loop, UV_RUN_ONCE);
  assert_true(closed);
  assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_single_member_and_arguments),
      cmocka_unit_test(test_collectives_one),
      cmocka_unit_test(test_collectives_two),
      cmocka_unit_test(test_collectives_three),
      cmocka_unit_test(test_cancel),
      cmocka_unit_test(test_member_killed),
      cmocka_unit_test(test_member_stopped),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
