/* A set of a job's local ranks, as a bitmap (ranks below FSDP_LOCAL_WORLD_MAX). */
#ifndef FSDP_RANK_SET_H
#define FSDP_RANK_SET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "proto/limits.h" /* FSDP_LOCAL_WORLD_MAX */

typedef struct fsdp_rank_set {
  uint64_t bits[FSDP_LOCAL_WORLD_MAX / 64];
} fsdp_rank_set_t;

static inline bool fsdp_rank_set_has(const fsdp_rank_set_t *set, uint32_t rank) {
  return rank < FSDP_LOCAL_WORLD_MAX && (set->bits[rank / 64] >> (rank % 64) & 1);
}

static inline bool fsdp_rank_set_empty(const fsdp_rank_set_t *set) {
  for (size_t i = 0; i < sizeof set->bits / sizeof set->bits[0]; i++)
    if (set->bits[i])
      return false;
  return true;
}

/* Adds or removes rank; returns whether that changed the set. */
static inline bool fsdp_rank_set_put(fsdp_rank_set_t *set, uint32_t rank, bool member) {
  if (rank >= FSDP_LOCAL_WORLD_MAX || fsdp_rank_set_has(set, rank) == member)
    return false;
  set->bits[rank / 64] ^= 1ull << (rank % 64);
  return true;
}

/* "1, 3" into buf: the ranks below world that are (member) or are not (!member) in set. */
static inline void fsdp_rank_set_format(const fsdp_rank_set_t *set, bool member,
                                        unsigned world, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (unsigned r = 0; r < world && used < size; r++)
    if (fsdp_rank_set_has(set, r) == member)
      used += (size_t)snprintf(buf + used, size - used, "%s%u", used ? ", " : "", r);
}

#endif
