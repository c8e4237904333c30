/* Where a unit's shards live across hosts, and which hosts each collective runs among.
 *
 * The world is H hosts (one daemon each) x L local ranks; the global rank of local rank r
 * on host h is h * L + r. For a sharding strategy:
 *   FULL_SHARD, SHARD_GRAD_OP  S = H * L shards; host h holds shards [h * L, (h + 1) * L),
 *                              one contiguous region. Gathers and reduce-scatters run
 *                              among all hosts.
 *   HYBRID_SHARD               a shard group is g consecutive hosts (cluster.shard_group_hosts)
 *                              and S = g * L; host h holds shards [(h % g) * L, ...). Gathers
 *                              and reduce-scatters run within the group; the reduced shards
 *                              are then all-reduced among the replicas (hosts h % g, h % g +
 *                              g, ...).
 *   NO_SHARD                   S = 1: every host keeps the whole unit; gradients are
 *                              all-reduced among all hosts.
 * The flat buffer is padded to a multiple of S, and further to a multiple of every ring's
 * member count so that the all-reduce among replicas splits a host's region evenly (padding
 * < H * L). On one host every strategy but NO_SHARD shards over the local ranks.
 *
 * Pure functions; any thread. */
#ifndef FSDP_TOPOLOGY_H
#define FSDP_TOPOLOGY_H

#include <stdbool.h>

#include "daemon/store/unit_layout.h"

typedef struct fsdp_topology {
  unsigned hosts;             /* H >= 1 */
  unsigned host_rank;         /* this host, < H */
  unsigned shard_group_hosts; /* g, divides H */
} fsdp_topology_t;

/* A ring of hosts: first, first + stride, ... (members of them); this host is member self. */
typedef struct fsdp_host_ring {
  unsigned first, stride, members, self;
} fsdp_host_ring_t;

typedef struct fsdp_unit_plan {
  unsigned shards;       /* S */
  unsigned pad_multiple; /* padded_numel is a multiple of it */
  unsigned first_shard;  /* this host's first shard; local rank r holds first_shard + r */
  unsigned local_shards; /* shards this host holds: L, or 1 for NO_SHARD */
  unsigned data_parallel_size; /* H * L: gradients are averaged over it by default */
  fsdp_host_ring_t shard_ring;   /* gathers and reduce-scatters of host regions */
  fsdp_host_ring_t replica_ring; /* all-reduce of this host's region */
} fsdp_unit_plan_t;

/* The plan of a unit with `strategy` on a host of `topology` with L local ranks. */
void fsdp_unit_plan(const fsdp_topology_t *topology, fsdp_unit_strategy_t strategy,
                    unsigned local_world_size, fsdp_unit_plan_t *ret_plan);

/* The host rank of a ring's member i. */
static inline unsigned fsdp_host_ring_host(const fsdp_host_ring_t *ring, unsigned i) {
  return ring->first + i * ring->stride;
}

/* Which copy of its shard local rank r holds among every rank holding that shard: the
 * replica index of its host, and for NO_SHARD (one shard, held by every rank) its global
 * rank. */
static inline unsigned fsdp_unit_plan_replica(const fsdp_unit_plan_t *plan, unsigned r) {
  if (plan->shards > 1 || plan->data_parallel_size == plan->replica_ring.members)
    return plan->replica_ring.self;
  unsigned local = plan->data_parallel_size / plan->replica_ring.members;
  return plan->replica_ring.self * local + r;
}

/* Whether collectives of this plan involve other hosts. */
static inline bool fsdp_unit_plan_spans_hosts(const fsdp_unit_plan_t *plan) {
  return plan->shard_ring.members > 1 || plan->replica_ring.members > 1;
}

#endif
