/* common/list.h: the intrusive list's order at both ends, removal from the front, the middle
 * and the back, removal during a walk, and a removed node that is removed again. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "common/list.h"

typedef struct item {
  int value;
  fsdp_list_t link;
} item_t;

/* The values of list front to back into out (at most cap); returns how many there are. */
static size_t values(fsdp_list_t *list, int *out, size_t cap) {
  size_t n = 0;
  item_t *it;
  fsdp_list_for_each(it, list, link) {
    if (n < cap)
      out[n] = it->value;
    n++;
  }
  return n;
}

static void assert_values(fsdp_list_t *list, const int *want, size_t n_want) {
  int got[16];
  assert_int_equal(values(list, got, 16), n_want);
  for (size_t i = 0; i < n_want; i++)
    assert_int_equal(got[i], want[i]);
  assert_true(fsdp_list_empty(list) == (n_want == 0));
}

static void test_empty(void **state) {
  (void)state;
  fsdp_list_t list;
  fsdp_list_init(&list);
  assert_true(fsdp_list_empty(&list));
  assert_null(fsdp_list_first(&list, item_t, link));
  assert_values(&list, NULL, 0);
}

static void test_push_front_and_back_keep_order(void **state) {
  (void)state;
  fsdp_list_t list;
  fsdp_list_init(&list);
  item_t a = {.value = 1}, b = {.value = 2}, c = {.value = 3}, d = {.value = 4};
  fsdp_list_push_back(&list, &b.link);
  fsdp_list_push_back(&list, &c.link);
  fsdp_list_push_front(&list, &a.link);
  fsdp_list_push_back(&list, &d.link);
  assert_values(&list, (const int[]){1, 2, 3, 4}, 4);
  assert_ptr_equal(fsdp_list_first(&list, item_t, link), &a);
  assert_ptr_equal(fsdp_list_entry(list.prev, item_t, link), &d);
}

static void test_remove_anywhere(void **state) {
  (void)state;
  fsdp_list_t list;
  fsdp_list_init(&list);
  item_t items[5];
  for (int i = 0; i < 5; i++) {
    items[i].value = i;
    fsdp_list_push_back(&list, &items[i].link);
  }
  fsdp_list_remove(&items[2].link); /* the middle */
  assert_values(&list, (const int[]){0, 1, 3, 4}, 4);
  fsdp_list_remove(&items[0].link); /* the front */
  assert_values(&list, (const int[]){1, 3, 4}, 3);
  fsdp_list_remove(&items[4].link); /* the back */
  assert_values(&list, (const int[]){1, 3}, 2);
  fsdp_list_remove(&items[1].link);
  fsdp_list_remove(&items[3].link);
  assert_values(&list, NULL, 0);
  /* A removed node is in no list: it may go back in, at either end. */
  fsdp_list_push_front(&list, &items[2].link);
  fsdp_list_push_front(&list, &items[4].link);
  assert_values(&list, (const int[]){4, 2}, 2);
}

static void test_remove_twice_is_harmless(void **state) {
  (void)state;
  fsdp_list_t list;
  fsdp_list_init(&list);
  item_t a = {.value = 1}, b = {.value = 2}, never = {.value = 3};
  fsdp_list_init(&never.link);
  fsdp_list_push_back(&list, &a.link);
  fsdp_list_push_back(&list, &b.link);
  fsdp_list_remove(&a.link);
  fsdp_list_remove(&a.link);
  fsdp_list_remove(&never.link);
  assert_values(&list, (const int[]){2}, 1);
}

static void test_for_each_safe_removes_while_walking(void **state) {
  (void)state;
  fsdp_list_t list;
  fsdp_list_init(&list);
  item_t items[6];
  for (int i = 0; i < 6; i++) {
    items[i].value = i;
    fsdp_list_push_back(&list, &items[i].link);
  }
  item_t *it, *tmp;
  int seen = 0;
  fsdp_list_for_each_safe(it, tmp, &list, link) {
    seen++;
    if (it->value % 2 == 0)
      fsdp_list_remove(&it->link);
  }
  assert_int_equal(seen, 6);
  assert_values(&list, (const int[]){1, 3, 5}, 3);
  fsdp_list_for_each_safe(it, tmp, &list, link)
    fsdp_list_remove(&it->link);
  assert_values(&list, NULL, 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_empty),
      cmocka_unit_test(test_push_front_and_back_keep_order),
      cmocka_unit_test(test_remove_anywhere),
      cmocka_unit_test(test_remove_twice_is_harmless),
      cmocka_unit_test(test_for_each_safe_removes_while_walking),
  };
  return cmocka_run_group_tests_name("list", tests, NULL, NULL);
}
