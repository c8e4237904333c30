/* Unit plans across hosts (see topology.h). */
#include "daemon/store/topology.h"

static fsdp_host_ring_t ring(unsigned first, unsigned stride, unsigned members,
                             unsigned self) {
  return (fsdp_host_ring_t){.first = first, .stride = stride, .members = members, .self = self};
}

void fsdp_unit_plan(const fsdp_topology_t *topology, fsdp_unit_strategy_t strategy,
                    unsigned local_world_size, fsdp_unit_plan_t *ret_plan) {
  unsigned hosts = topology->hosts, h = topology->host_rank, l = local_world_size;
  unsigned g = topology->shard_group_hosts;
  fsdp_unit_plan_t p = {.data_parallel_size = hosts * l};
  switch (strategy) {
  case FSDP_UNIT_NO_SHARD:
    p.shards = p.local_shards = 1;
    p.shard_ring = ring(h, 1, 1, 0);
    p.replica_ring = ring(0, 1, hosts, h);
    break;
  case FSDP_UNIT_HYBRID_SHARD:
    p.shards = g * l;
    p.local_shards = l;
    p.first_shard = h % g * l;
    p.shard_ring = ring(h / g * g, 1, g, h % g);
    p.replica_ring = ring(h % g, g, hosts / g, h / g);
    break;
  default: /* FULL_SHARD, SHARD_GRAD_OP */
    p.shards = hosts * l;
    p.local_shards = l;
    p.first_shard = h * l;
    p.shard_ring = ring(0, 1, hosts, h);
    p.replica_ring = ring(h, 1, 1, 0);
  }
  /* A host's region (local_shards shards) splits evenly among the replicas. */
  p.pad_multiple = p.shards * p.replica_ring.members;
  *ret_plan = p;
}
