/* The CUDA module's NCCL communicators (cuda/module.h), through the module as fsdpd loads it,
 * on the one GPU a test machine has (NCCL refuses two ranks on one GPU): a communicator of
 * one rank, whose collectives are the host's arithmetic bit for bit (a gather is a copy, a
 * reduce one fp32 product with the pre-scale); a communicator whose second rank never joins,
 * which ends at its deadline, aborted, instead of waiting for ever; and the arguments it
 * refuses. Exits 77 (skipped) without a GPU or without a module built with NCCL. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/clock.h"
#include "cuda/loader.h"

#define N 4099 /* elements a rank sends: not a round number */

static const fsdp_cuda_module_t *cuda;
static int ordinal;

typedef struct {
  fsdp_cuda_stream_t *stream;
  fsdp_cuda_memory_t send, recv;
} bufs_t;

static void bufs_new(bufs_t *b, size_t bytes) {
  fsdp_status_t st = FSDP_STATUS_INIT;
  assert_int_equal(cuda->stream_new(ordinal, &b->stream, &st), 0);
  assert_int_equal(cuda->memory_new(ordinal, bytes, &b->send, &st), 0);
  assert_int_equal(cuda->memory_new(ordinal, bytes, &b->recv, &st), 0);
}

static void bufs_free(bufs_t *b) {
  cuda->memory_free(&b->send);
  cuda->memory_free(&b->recv);
  cuda->stream_free(b->stream);
}

static void to_device(bufs_t *b, void *dst, const void *src, size_t bytes) {
  fsdp_status_t st = FSDP_STATUS_INIT;
  assert_int_equal(cuda->copy(b->stream, dst, src, bytes, &st), 0);
  assert_int_equal(cuda->synchronize(b->stream, &st), 0);
}

static fsdp_cuda_comm_t *comm_of_one(void) {
  unsigned char id[FSDP_CUDA_NCCL_ID_BYTES];
  fsdp_status_t st = FSDP_STATUS_INIT;
  assert_int_equal(cuda->nccl_id(id, &st), 0);
  fsdp_cuda_comm_t *comm = NULL;
  int r = cuda->comm_new(ordinal, 1, 0, id, fsdp_clock_deadline_ms(30000), &comm, &st);
  if (r < 0)
    fail_msg("comm_new: %s", st.message);
  return comm;
}

static void test_a_communicator_of_one_gives_the_hosts_bits(void **state) {
  (void)state;
  float host[N], got[N];
  uint16_t half[N], half_got[N];
  for (size_t i = 0; i < N; i++) {
    host[i] = (float)((int)(i * 2654435761u % 20001) - 10000) / 7.0f;
    half[i] = (uint16_t)(i * 40503u);
  }
  bufs_t b;
  bufs_new(&b, sizeof host);
  fsdp_cuda_comm_t *comm = comm_of_one();
  fsdp_status_t st = FSDP_STATUS_INIT;
  int64_t deadline = fsdp_clock_deadline_ms(30000);

  /* A gather of one rank is its part, bf16 and fp32 alike. */
  to_device(&b, b.send.base, half, sizeof half);
  assert_int_equal(cuda->all_gather(comm, b.stream, b.send.base, b.recv.base, N,
                                    FSDP_DTYPE_BF16, deadline, &st), 0);
  to_device(&b, half_got, b.recv.base, sizeof half_got);
  assert_memory_equal(half_got, half, sizeof half);

  /* A reduce of one rank is its part times the pre-scale, one fp32 product. */
  const float scale = 1.0f / 3.0f;
  float want[N];
  for (size_t i = 0; i < N; i++)
    want[i] = host[i] * scale;
  to_device(&b, b.send.base, host, sizeof host);
  assert_int_equal(cuda->reduce_scatter(comm, b.stream, b.send.base, b.recv.base, N,
                                        FSDP_DTYPE_FP32, scale, deadline, &st), 0);
  to_device(&b, got, b.recv.base, sizeof got);
  assert_memory_equal(got, want, sizeof want);
  memset(got, 0, sizeof got);
  assert_int_equal(cuda->all_reduce(comm, b.stream, b.send.base, b.recv.base, N,
                                    FSDP_DTYPE_FP32, scale, deadline, &st), 0);
  to_device(&b, got, b.recv.base, sizeof got);
  assert_memory_equal(got, want, sizeof want);

  /* The reductions are of fp32: a bf16 one is refused, and the communicator lives on. */
  assert_int_equal(cuda->reduce_scatter(comm, b.stream, b.send.base, b.recv.base, N,
                                        FSDP_DTYPE_BF16, 1.0f, deadline, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "the reductions are in fp32"));
  assert_int_equal(cuda->all_gather(comm, b.stream, b.send.base, b.recv.base, N,
                                    FSDP_DTYPE_FP32, deadline, &st), 0);
  cuda->comm_free(comm);
  bufs_free(&b);
}

static void test_a_rank_that_never_joins_ends_at_the_deadline(void **state) {
  (void)state;
  unsigned char id[FSDP_CUDA_NCCL_ID_BYTES];
  fsdp_status_t st = FSDP_STATUS_INIT;
  assert_int_equal(cuda->nccl_id(id, &st), 0);
  fsdp_cuda_comm_t *comm = NULL;
  int64_t start = fsdp_clock_now_ms();
  int r = cuda->comm_new(ordinal, 2, 0, id, start + 1500, &comm, &st);
  int64_t took = fsdp_clock_now_ms() - start;
  assert_int_equal(r, FSDP_E_DEADLINE_EXCEEDED);
  assert_null(comm);
  assert_non_null(strstr(st.message, "rank 0 of 2"));
  assert_non_null(strstr(st.message, "the communicator was aborted"));
  assert_true(took >= 1500 && took < 10000);
}

static void test_a_rank_outside_the_communicator_is_refused(void **state) {
  (void)state;
  unsigned char id[FSDP_CUDA_NCCL_ID_BYTES] = {0};
  fsdp_status_t st = FSDP_STATUS_INIT;
  fsdp_cuda_comm_t *comm = NULL;
  assert_int_equal(cuda->comm_new(ordinal, 2, 2, id, fsdp_clock_deadline_ms(1000), &comm, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_non_null(strstr(st.message, "rank 2 of 2"));
  assert_null(comm);
}

int main(void) {
  fsdp_status_t st = FSDP_STATUS_INIT;
  if (fsdp_cuda_load(&cuda, &st) < 0) {
    printf("skipped: %s\n", st.message);
    return 77;
  }
  if (!cuda->comm_new) {
    printf("skipped: the CUDA module was built without NCCL\n");
    return 77;
  }
  fsdp_cuda_device_t devices[FSDP_CUDA_DEVICES_MAX];
  unsigned n = 0;
  if (cuda->probe(devices, FSDP_CUDA_DEVICES_MAX, &n, &st) < 0 || n == 0) {
    printf("skipped: no GPU (%s)\n", n == 0 && st.code == 0 ? "none seen" : st.message);
    return 77;
  }
  ordinal = devices[0].ordinal;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_a_communicator_of_one_gives_the_hosts_bits),
      cmocka_unit_test(test_a_rank_that_never_joins_ends_at_the_deadline),
      cmocka_unit_test(test_a_rank_outside_the_communicator_is_refused),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
