/* A job's staging buffers for staged rings: the smallest free buffer that fits is lent, a
 * lent one never twice, a take that finds only smaller free ones remakes one (its old
 * memory forgotten first, the new made by fsdp_staging_make), and the count stays what was
 * lent at once. The host backend makes the memory. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/backend/host_backend.h"
#include "daemon/store/staging.h"

typedef struct forgotten {
  const void *base;
  size_t bytes;
  int calls;
} forgotten_t;

static void forget(void *arg, const void *base, size_t bytes) {
  forgotten_t *f = arg;
  f->base = base;
  f->bytes = bytes;
  f->calls++;
}

static fsdp_staging_buffer_t *take(fsdp_staging_t *s, size_t bytes, forgotten_t *f) {
  fsdp_staging_buffer_t *b = NULL;
  fsdp_status_t st;
  assert_int_equal(fsdp_staging_take(s, bytes, forget, f, &b, &st), 0);
  assert_int_equal(fsdp_staging_make(s, b, &st), 0);
  assert_non_null(b->base);
  assert_true(b->bytes >= bytes);
  memset(b->base, 0x5a, bytes); /* the memory is there to write */
  return b;
}

static void count_is(const fsdp_staging_t *s, unsigned buffers, size_t bytes) {
  unsigned n;
  size_t total;
  fsdp_staging_count(s, &n, &total);
  assert_int_equal(n, buffers);
  assert_int_equal(total, bytes);
}

static void test_lends_the_smallest_that_fits_and_remakes_a_smaller_one(void **state) {
  (void)state;
  fsdp_backend_t host;
  fsdp_backend_init_host(&host, NULL);
  fsdp_staging_t s;
  fsdp_staging_init(&s, &host);
  forgotten_t f = {0};

  fsdp_staging_buffer_t *a = take(&s, 100, &f), *b = take(&s, 300, &f);
  assert_ptr_not_equal(a, b); /* a lent buffer is not lent again */
  count_is(&s, 2, 400);
  fsdp_staging_give(a);
  fsdp_staging_give(b);
  /* 80 fits both: the smaller one is lent. */
  fsdp_staging_buffer_t *c = take(&s, 80, &f);
  assert_ptr_equal(c, a);
  fsdp_staging_give(c);
  count_is(&s, 2, 400);
  assert_int_equal(f.calls, 0);

  /* 500 fits neither: a free smaller one is remade at 500, its old memory forgotten first;
   * no third buffer. */
  void *old_base = a->base;
  fsdp_staging_buffer_t *held = take(&s, 300, &f); /* b, which stays lent */
  assert_ptr_equal(held, b);
  fsdp_staging_buffer_t *d = take(&s, 500, &f);
  assert_ptr_equal(d, a);
  assert_int_equal(f.calls, 1);
  assert_ptr_equal(f.base, old_base);
  assert_int_equal(f.bytes, 100);
  assert_int_equal(d->bytes, 500);
  count_is(&s, 2, 800);

  /* Both lent: a take makes a third. */
  fsdp_staging_buffer_t *e = take(&s, 10, &f);
  assert_ptr_not_equal(e, a);
  assert_ptr_not_equal(e, b);
  count_is(&s, 3, 810);
  fsdp_staging_give(NULL); /* NULL-safe */
  fsdp_staging_cleanup(&s);
  fsdp_staging_cleanup(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_lends_the_smallest_that_fits_and_remakes_a_smaller_one),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
