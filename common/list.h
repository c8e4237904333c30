/* An intrusive doubly linked list: the node lives inside the object it links, so linking and
 * unlinking never allocate and an object removes itself in O(1) knowing only itself.
 *
 * A list is a head node whose prev and next point at itself when it is empty (circular, with
 * the head as sentinel), so no operation has a special case for the ends. The head and the
 * linked nodes hold pointers to each other: a struct holding a head or a linked node must not
 * be copied or moved while linked (initialize the head after any assignment to the struct
 * that holds it). Not thread-safe: whoever owns the objects owns their list. */
#ifndef FSDP_LIST_H
#define FSDP_LIST_H

#include <stdbool.h>
#include <stddef.h>

typedef struct fsdp_list {
  struct fsdp_list *prev, *next;
} fsdp_list_t;

/* An empty list, or a node that is in none. */
static inline void fsdp_list_init(fsdp_list_t *list) {
  list->prev = list->next = list;
}

static inline bool fsdp_list_empty(const fsdp_list_t *list) {
  return list->next == list;
}

static inline void fsdp_list_insert_between(fsdp_list_t *node, fsdp_list_t *prev,
                                            fsdp_list_t *next) {
  node->prev = prev;
  node->next = next;
  prev->next = next->prev = node;
}

/* Links node first (front) or last (back) in list. node must be in no list. */
static inline void fsdp_list_push_front(fsdp_list_t *list, fsdp_list_t *node) {
  fsdp_list_insert_between(node, list, list->next);
}

static inline void fsdp_list_push_back(fsdp_list_t *list, fsdp_list_t *node) {
  fsdp_list_insert_between(node, list->prev, list);
}

/* Unlinks node from its list and leaves it as fsdp_list_init does, so removing it again, or
 * removing a node that was initialized and never linked, does nothing. */
static inline void fsdp_list_remove(fsdp_list_t *node) {
  node->prev->next = node->next;
  node->next->prev = node->prev;
  fsdp_list_init(node);
}

/* The object of type `type` whose member `member` is node. */
#define fsdp_list_entry(node, type, member) ((type *)((char *)(node) - offsetof(type, member)))

/* The first object of list, or NULL when it is empty. */
#define fsdp_list_first(list, type, member) \
  (fsdp_list_empty(list) ? NULL : fsdp_list_entry((list)->next, type, member))

/* Walks list front to back with pos, a pointer to the objects; the body must not unlink pos
 * (fsdp_list_for_each_safe may). */
#define fsdp_list_for_each(pos, list, member)                                          \
  for (pos = fsdp_list_entry((list)->next, __typeof__(*pos), member); &pos->member != (list); \
       pos = fsdp_list_entry(pos->member.next, __typeof__(*pos), member))

/* The same, where the body may unlink or free pos: tmp (of pos's type) holds the next one. */
#define fsdp_list_for_each_safe(pos, tmp, list, member)                                     \
  for (pos = fsdp_list_entry((list)->next, __typeof__(*pos), member),                       \
      tmp = fsdp_list_entry(pos->member.next, __typeof__(*pos), member);                    \
       &pos->member != (list);                                                               \
       pos = tmp, tmp = fsdp_list_entry(pos->member.next, __typeof__(*pos), member))

#endif
