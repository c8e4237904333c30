/* Prometheus's text format as daemon/metrics/exposition.h writes it: a family's HELP and TYPE
 * lines, label values escaped (backslash, quote, newline), integers and doubles (NaN and the
 * infinities as the format spells them), and a histogram's cumulative buckets, +Inf, sum and
 * count; an observation past the last bound counts in +Inf only. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/metrics/exposition.h"

static void test_families_and_samples(void **state) {
  (void)state;
  fsdp_exposition_t e;
  fsdp_exposition_init(&e);
  fsdp_exposition_family(&e, "x_total", "counter", "Help with \\ and\nnewline \"kept\".");
  const fsdp_label_t labels[] = {{"job", "a\"b\\c\nd"}, {"unit", "u"}};
  fsdp_exposition_count(&e, "x_total", labels, 2, 18446744073709551615ull);
  fsdp_exposition_count(&e, "x_total", NULL, 0, 0);
  fsdp_exposition_value(&e, "y", labels + 1, 1, 0.25);
  fsdp_exposition_value(&e, "y", NULL, 0, NAN);
  fsdp_exposition_value(&e, "y", NULL, 0, -INFINITY);
  assert_false(e.failed);
  assert_string_equal(e.text,
                      "# HELP x_total Help with \\\\ and\\nnewline \"kept\".\n"
                      "# TYPE x_total counter\n"
                      "x_total{job=\"a\\\"b\\\\c\\nd\",unit=\"u\"} 18446744073709551615\n"
                      "x_total 0\n"
                      "y{unit=\"u\"} 0.25\n"
                      "y NaN\n"
                      "y -Inf\n");
  assert_int_equal(e.len, strlen(e.text));
  fsdp_exposition_cleanup(&e);
  fsdp_exposition_cleanup(NULL);
}

static void test_histogram_buckets_are_cumulative(void **state) {
  (void)state;
  fsdp_histogram_t h = {0};
  fsdp_histogram_observe(&h, 50e-6);  /* on the first bound: in it */
  fsdp_histogram_observe(&h, 0.003);  /* in 5e-3 */
  fsdp_histogram_observe(&h, 0.003);
  fsdp_histogram_observe(&h, 11.0);   /* past the last: +Inf only */
  fsdp_exposition_t e;
  fsdp_exposition_init(&e);
  const fsdp_label_t work[] = {{"work", "gather"}};
  fsdp_exposition_histogram(&e, "w_seconds", work, 1, &h);
  assert_false(e.failed);
  /* Every bound's line, then +Inf, sum and count. */
  assert_non_null(strstr(e.text, "w_seconds_bucket{work=\"gather\",le=\"5e-05\"} 1\n"));
  assert_non_null(strstr(e.text, "w_seconds_bucket{work=\"gather\",le=\"0.0025\"} 1\n"));
  assert_non_null(strstr(e.text, "w_seconds_bucket{work=\"gather\",le=\"0.005\"} 3\n"));
  assert_non_null(strstr(e.text, "w_seconds_bucket{work=\"gather\",le=\"10\"} 3\n"));
  assert_non_null(strstr(e.text, "w_seconds_bucket{work=\"gather\",le=\"+Inf\"} 4\n"));
  assert_non_null(strstr(e.text, "w_seconds_sum{work=\"gather\"} 11.00605"));
  assert_non_null(strstr(e.text, "w_seconds_count{work=\"gather\"} 4\n"));
  size_t lines = 0;
  for (const char *p = e.text; *p; p++)
    lines += *p == '\n';
  assert_int_equal(lines, FSDP_HISTOGRAM_BOUNDS + 3);
  fsdp_exposition_cleanup(&e);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_families_and_samples),
      cmocka_unit_test(test_histogram_buckets_are_cumulative),
  };
  return cmocka_run_group_tests_name("exposition", tests, NULL, NULL);
}
