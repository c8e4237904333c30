/* The backend's table of operations, as its callers see it through backend.h: the host
 * backend's memory is its arenas' memfds, so asking it for device memory is refused naming
 * the backend (and freeing such memory does nothing), not a call through an empty slot; its
 * kernels and host memory work with no worker pool. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/backend/host_backend.h"

static void test_the_host_backend_refuses_device_memory(void **state) {
  (void)state;
  fsdp_backend_t host;
  fsdp_backend_init_host(&host, NULL);
  assert_true(fsdp_backend_memory_is_host(&host));
  fsdp_backend_memory_t memory = {.fd = -1};
  fsdp_status_t st;
  assert_int_equal(fsdp_backend_memory_new(&host, 4096, &memory, &st), FSDP_E_INTERNAL);
  assert_string_equal(st.message, "the host backend's memory is its arenas'");
  fsdp_backend_memory_free(&host, &memory); /* nothing to free */
  fsdp_backend_cleanup(&host);
}

static void test_the_host_backend_casts_in_host_memory(void **state) {
  (void)state;
  fsdp_backend_t host;
  fsdp_backend_init_host(&host, NULL);
  fsdp_status_t st;
  void *mem = NULL;
  assert_int_equal(fsdp_backend_host_new(&host, 4 * sizeof(float), &mem, &st), 0);
  float *src = mem, dst[4] = {0};
  for (int i = 0; i < 4; i++)
    src[i] = (float)i - 1.5f;
  assert_int_equal(fsdp_backend_cast(&host, dst, FSDP_DTYPE_FP32, src, FSDP_DTYPE_FP32, 4, &st), 0);
  assert_memory_equal(dst, src, sizeof dst);
  fsdp_backend_host_free(&host, mem);
  fsdp_backend_cleanup(&host);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_the_host_backend_refuses_device_memory),
      cmocka_unit_test(test_the_host_backend_casts_in_host_memory),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
