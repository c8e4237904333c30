"""Collectives across hosts: 2 and 3 fsdpd on this machine (own run dirs and ports, joined
over the Peer service, data over UCX), L = 2 trainers each, every sharding strategy, odd
element counts, fp32 and bf16. Unshard must give every rank the whole unit as the masters
all ranks wrote say; ReduceScatter must give every rank its shard of the mean over all
ranks of all hosts, computed here (the values are chosen so that every sum is exact, so
the ring's order of summation cannot matter and the check is bit for bit).

Faults: a daemon SIGKILLed or SIGSTOPped while the others wait in a collective; every
waiter gets an error naming the host within the peer timeout; a restarted daemon joins
again and collectives work again. UCX runs over tcp (what it picks by default: the daemons
ask for peer error handling, which its shared-memory transports do not offer) and over
shared memory (UCX_TLS=posix,sysv,cma,self); where the test may make network namespaces
(root, iproute2), two daemons also run each in its own, joined by a veth pair."""

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import grpc
import pytest

from fsdpd_harness import common_pb2, fsdpd, operator_pb2, poll, trainer_pb2  # noqa: F401
from test_peers import (INSECURE, Cluster, free_ports, peers, row, token_args, wait_all_joined,
                        wait_state)
from test_reduce_scatter import decode, f32, reference, rounder
from test_unshard import (BF16, FP32, PER_PARAM_SHAPES, SIZE, Rank, encode, host_element, in_shards,
                          on_all, per_param_map, values_for)

STRATEGIES = {"FULL_SHARD": common_pb2.FULL_SHARD, "SHARD_GRAD_OP": common_pb2.SHARD_GRAD_OP,
              "HYBRID_SHARD": common_pb2.HYBRID_SHARD, "NO_SHARD": common_pb2.NO_SHARD}
L = 2
SHAPES = ((37, 11), (5,), (3, 7))  # 433 elements: prime, so every layout pads

# The host backend takes the GPU backend's staged path for the rings among hosts: host
# buffers of their own, copied to and from the job's memory around the rings.
STAGED = {"FSDPD_FAILPOINT": "stage-rings:1:fail"}


def start_cluster(fsdpd, hosts, tls=None, extra=(), timeout="1s", staged=False):
    env = {"UCX_TLS": tls} if tls else {}
    if staged:
        env.update(STAGED)
    c = Cluster(fsdpd, hosts, env=env, lws=L, timeout=timeout,
                extra=["--set", "memory.job_limit=64MiB", *extra])
    wait_all_joined(c)
    return c


def attach(cluster, job="j", generation=0):
    """[[Rank]] by host: L sessions on every daemon."""
    return [[Rank(d, r, L, job=job, generation=generation) for r in range(L)]
            for d in cluster.daemons]


def grad_values(n, global_rank):
    # Halves in [-10, 10]: any sum of up to 6 of them is exact even in bf16.
    return [((i * 31 + 7 * global_rank) % 41 - 20) * 0.5 for i in range(n)]


def check_collectives(cluster, strategy, dtype, step=1, job="j", group=1,
                      layout=common_pb2.LAYOUT_FLAT):
    """The collectives of a unit of `layout`: with LAYOUT_PER_PARAM the masters and the
    gradient shards hold each parameter's pieces (per_param_map), the copy and the full
    gradients the parameters one after the other."""
    hosts = attach(cluster, job)
    flat = [r for host in hosts for r in host]
    per_param = layout == common_pb2.LAYOUT_PER_PARAM
    shapes = PER_PARAM_SHAPES if per_param else SHAPES
    layouts = [[r.register(shapes=shapes, param_dtype=dtype, strategy=STRATEGIES[strategy],
                           layout=layout) for r in host] for host in hosts]
    lay = layouts[0][0]
    # The values of the copy, and how the shards hold them.
    space = lay.numel if per_param else lay.padded_numel
    where = per_param_map(lay, shapes) if per_param else None
    to_shards = (lambda v: in_shards(where, v)) if per_param else (lambda v: v)
    n_hosts = len(hosts)
    assert all(x.padded_numel == lay.padded_numel for h in layouts for x in h)
    shards = [x.shard for h in layouts for x in h]
    if strategy == "NO_SHARD":
        assert shards == [0] * len(flat)
    elif strategy == "HYBRID_SHARD":  # shard groups of `group` hosts, replicated
        assert shards == [h % group * L + r for h in range(n_hosts) for r in range(L)]
    else:
        assert shards == list(range(L * n_hosts))
    # Each host keeps master and gradient buffers for its own shards only.
    for x in [x for h in layouts for x in h]:
        assert x.host_shards == (1 if strategy == "NO_SHARD" else L)
        assert x.host_first_shard == x.shard - (0 if strategy == "NO_SHARD" else x.shard % L)

    # Unshard: every rank writes its master shard; everyone gets the whole unit.
    values = values_for(space, 11)
    for host, lays in zip(hosts, layouts):
        for r, x in zip(host, lays):
            r.write_master_shard(x, to_shards(values))
    assert on_all(flat, "Unshard", step=step) == [None] * len(flat)
    for r, x in zip(flat, [x for h in layouts for x in h]):
        assert r.unsharded(x, dtype)[:space * SIZE[dtype]] == encode(values, dtype), \
            f"host rank {r.d.log_path.name}"

    # ReduceScatter: the mean over every rank of every host, each rank's shard of it. The
    # backward's Unshard (the ranks still hold the copy: no gather) lends the buffers.
    assert on_all(flat, "Unshard", step=step, backward=True) == [None] * len(flat)
    grads = [grad_values(space, g) for g in range(len(flat))]
    for g, r in enumerate(flat):
        r.write_full_grad(grads[g], dtype)
    assert on_all(flat, "ReduceScatter" if strategy != "NO_SHARD" else "AllReduce",
                  step=step) == [None] * len(flat)
    want = to_shards(reference(grads, dtype, 1, len(flat)))
    for r, x in zip(flat, [x for h in layouts for x in h]):
        lo, at = x.shard * x.shard_numel, x.grad_offset + host_element(x) * 4
        got = decode(bytes(r.memory[at:at + x.shard_numel * 4]), FP32)
        assert got == want[lo:lo + x.shard_numel], f"{r.d.log_path.name} shard {x.shard}"
    return hosts, layouts


@pytest.mark.parametrize("hosts", [2, 3])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_strategy_across_hosts(fsdpd, hosts, strategy):
    c = start_cluster(fsdpd, hosts)
    check_collectives(c, strategy, FP32)
    # The operator's shard map says which host and rank hold each shard.
    r = c.daemons[-1].fsdpctl("--json", "unit", "u")
    assert r.returncode == 0, r.stderr
    where = [(m["host_rank"], m["local_rank"]) for m in json.loads(r.stdout)["shard_map"]]
    if strategy == "HYBRID_SHARD":  # this host's group is this host alone
        assert where == [(hosts - 1, rank) for rank in range(L)]
    elif strategy != "NO_SHARD":
        assert where == [(h, rank) for h in range(hosts) for rank in range(L)]


@pytest.mark.parametrize("staged", [False, True], ids=["host", "staged"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_per_param_layout_across_hosts(fsdpd, strategy, staged):
    """FSDP2's layout over 2 hosts: the all-gather moves the shards as they lie, through a
    staged copy, into the parameters one after the other; the reduces sum each parameter's
    rows into its pieces; bit for bit, on the host's rings and on a GPU's staged path."""
    c = start_cluster(fsdpd, 2, staged=staged)
    check_collectives(c, strategy, BF16, layout=common_pb2.LAYOUT_PER_PARAM)


def staging_of(daemon, job):
    jobs = json.loads(daemon.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
    return next((j["ring_staging_buffers"], j["ring_staging_bytes"]) for j in jobs
                if j["job"] == job)


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_staged_rings_give_every_strategy_the_same_bits(fsdpd, strategy, dtype):
    """The path of a GPU's jobs: the rings move host buffers staged from the job's memory.
    The same collectives as above, bit for bit, over 3 hosts, HYBRID_SHARD in shard groups
    of 3 hosts and of 1 (each host's reduce then goes straight to the all-reduce among
    replicas). The gather gives its staging buffer back before the reduce takes one of the
    same size: the job keeps one."""
    c = start_cluster(fsdpd, 3, staged=True)
    _, layouts = check_collectives(c, strategy, dtype)
    size = layouts[0][0].padded_numel * SIZE[dtype]
    assert [staging_of(d, "j") for d in c.daemons] == [(1, size)] * 3
    if strategy == "HYBRID_SHARD":
        c = start_cluster(fsdpd, 3, staged=True, extra=["--set", "cluster.shard_group_hosts=3"])
        check_collectives(c, strategy, dtype, group=3)


def test_a_retired_jobs_memory_leaves_the_transport_and_a_new_job_runs(fsdpd):
    """The buffers a unit's rings move are registered with UCX on its first ring and let go
    before the job's memory is unmapped when it retires; a new job, whose arenas the kernel
    may map at the same addresses, then registers and moves its own. (Over tcp and shared
    memory a registration pins nothing, so what this checks is that retiring a job that ran
    rings, and running a new one, works: not what a stale registration would do on RDMA.)"""
    c = start_cluster(fsdpd, 2, extra=["--set", "store.job_retention=200ms",
                                       "--set", "daemon.housekeeping_interval=20ms"])
    for job in ("first", "second"):
        hosts, _ = check_collectives(c, "FULL_SHARD", FP32, job=job)
        for r in [r for host in hosts for r in host]:
            r.sock.close()  # the trainers go
        for d in c.daemons:
            poll(lambda: not d.status().jobs, 10, what=f"job '{job}' to be freed")
            assert f"job '{job}': no session for" in d.stderr()


def test_a_restarted_job_meets_none_of_the_messages_its_failed_run_left(fsdpd):
    """Host 0's ranks reduce step 1 while host 1's never do: host 0's ring sends its chunks
    to host 1, whose daemon runs no ring to take them, and fails at its deadline, leaving
    them and its abort unmatched there. The job restarts: every rank attaches again with
    generation 1 and reduces step 1 with other gradients. The new run's rings have tags of
    their own, so host 1 sums the new gradients only, and nothing fails."""
    c = start_cluster(fsdpd, 2, extra=["--set", "store.collective_timeout=1s"])

    def register_and_write(hosts, offset):
        layouts = [[r.register(shapes=SHAPES) for r in host] for host in hosts]
        flat = [(r, x) for host, lays in zip(hosts, layouts) for r, x in zip(host, lays)]
        n = layouts[0][0].padded_numel
        grads = [grad_values(n, g + offset) for g in range(len(flat))]
        assert on_all([r for r, _ in flat], "Unshard", step=1, backward=True) == \
            [None] * len(flat)
        for g, (r, x) in enumerate(flat):
            r.write_full_grad(grads[g], FP32)
        return flat, grads

    hosts = attach(c)
    register_and_write(hosts, offset=5)
    errors = on_all(hosts[0], "ReduceScatter", step=1)
    assert all(e is not None and "deadline passed" in e.details() for e in errors), errors

    for r in [r for host in hosts for r in host]:
        r.sock.close()  # the job's trainers go, and come back as its next run
    for d in c.daemons:
        poll(lambda: not d.status().sessions, 10, what="the first run's sessions to end")
    hosts = attach(c, generation=1)
    assert all(s.generation == 1 for d in c.daemons for s in d.status().sessions)
    flat, grads = register_and_write(hosts, offset=0)
    assert on_all([r for r, _ in flat], "ReduceScatter", step=1) == [None] * len(flat)
    want = reference(grads, FP32, 1, len(flat))
    for r, x in flat:
        lo, at = x.shard * x.shard_numel, x.grad_offset + host_element(x) * 4
        got = decode(bytes(r.memory[at:at + x.shard_numel * 4]), FP32)
        assert got == want[lo:lo + x.shard_numel], f"{r.d.log_path.name} shard {x.shard}"


@pytest.mark.parametrize("tls", ["tcp", "posix,sysv,cma,self"], ids=["tcp", "shm"])
def test_bf16_and_the_transports(fsdpd, tls):
    c = start_cluster(fsdpd, 2, tls=tls)
    check_collectives(c, "FULL_SHARD", BF16)
    check_collectives(c, "HYBRID_SHARD", BF16, job="hybrid")


def test_hybrid_shard_groups_of_two_hosts(fsdpd):
    """Four hosts would be the natural case; with 2 hosts per group and 2 hosts the group
    is the whole cluster (g = 2): FULL_SHARD's layout through HYBRID_SHARD's path."""
    c = start_cluster(fsdpd, 2, extra=["--set", "cluster.shard_group_hosts=2"])
    hosts, layouts = check_collectives(c, "HYBRID_SHARD", FP32, group=2)
    assert [x.shard for h in layouts for x in h] == [0, 1, 2, 3]


@pytest.mark.parametrize("staged", [False, True], ids=["", "staged"])
@pytest.mark.parametrize("n_hosts,group", [(2, 1), (4, 2)])
def test_hybrid_shard_all_reduces_among_replicas_on_the_last_micro_batch_only(fsdpd, n_hosts,
                                                                              group, staged):
    """Gradient accumulation over three micro-batches, bf16: the first two reduces defer
    their all-reduce among the replicas, so each host keeps its shard group's sum (FSDP2's
    partial reduce output) and no gradient shard changes; the third adds the kept sum to its
    own, runs the one all-reduce among replicas, and writes the shards, overwriting them (the
    first reduce did not accumulate). Shard groups of one host (no ring before the
    all-reduce) and of two (a reduce-scatter among the group first). The result is bit for
    bit the roundings FSDP2 performs: the group's sum, kept = kept + sum, then (sum + kept)
    all-reduced, then the mean."""
    c = start_cluster(fsdpd, n_hosts, extra=["--set", f"cluster.shard_group_hosts={group}"],
                      staged=staged)
    hosts = attach(c)
    flat = [r for host in hosts for r in host]
    layouts = [r.register(shapes=SHAPES, param_dtype=BF16, strategy=common_pb2.HYBRID_SHARD)
               for r in flat]
    n = layouts[0].padded_numel
    R = rounder(BF16)

    def shards():
        return [decode(bytes(r.memory[x.grad_offset + host_element(x) * 4:
                                      x.grad_offset + (host_element(x) + x.shard_numel) * 4]),
                       FP32) for r, x in zip(flat, layouts)]

    def unit_info(d):
        return json.loads(d.fsdpctl("--json", "unit", "u").stdout)

    before = shards()
    group_sums = []  # [micro-batch][shard group][element]
    for m, (defer, accumulate) in enumerate([(True, False), (True, True), (False, True)]):
        step = m + 1
        assert on_all(flat, "Unshard", step=step) == [None] * len(flat)
        assert on_all(flat, "Unshard", step=step, backward=True) == [None] * len(flat)
        # Not exact in bf16: every rounding shows.
        grads = [decode(encode([((i * 37 + 11 * g + 5 * m) % 97 - 48) * 0.37 for i in range(n)],
                               BF16), BF16) for g in range(len(flat))]
        for g, r in enumerate(flat):
            r.write_full_grad(grads[g], BF16)
        assert on_all(flat, "ReduceScatter", step=step, accumulate=accumulate,
                      defer_all_reduce=defer) == [None] * len(flat)
        host_sums = [[R(grads[h * L][i] + grads[h * L + 1][i]) for i in range(n)]
                     for h in range(n_hosts)]
        # A group's hosts are consecutive; a ring of two adds its two hosts' sums.
        group_sums.append([host_sums[h] if group == 1 else
                           [R(a + b) for a, b in zip(host_sums[h], host_sums[h + 1])]
                           for h in range(0, n_hosts, group)])
        infos = [unit_info(d) for d in c.daemons]
        if defer:
            assert shards() == before
            assert [(u["deferred_reduces"], u["replica_all_reduces"]) for u in infos] == \
                [(step, 0)] * n_hosts
    assert [(u["deferred_reduces"], u["replica_all_reduces"]) for u in infos] == \
        [(0, 1)] * n_hosts
    totals = []  # two groups, two replicas of each shard: a ring of two adds them
    for g in range(2):
        kept = group_sums[0][g]
        kept = [R(k + s) for k, s in zip(kept, group_sums[1][g])]
        totals.append([R(s + k) for s, k in zip(group_sums[2][g], kept)])
    mean = [R(R(a + b) * f32(1 / len(flat))) for a, b in zip(*totals)]
    for got, x in zip(shards(), layouts):
        lo = x.shard * x.shard_numel
        assert got == mean[lo:lo + x.shard_numel], f"shard {x.shard}"
    if staged:  # the deferred sums were kept in host memory
        assert all(staging_of(d, "j")[0] >= 2 for d in c.daemons)


@pytest.mark.parametrize("tls", [None, "posix,sysv,cma,self"], ids=["tcp", "shm"])
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_host_fails_every_waiter_naming_it(fsdpd, how, tls):
    """Over tcp UCX reports the dead peer itself; over shared memory only the peer service's
    heartbeats notice, and the fabric fails the connection."""
    c = start_cluster(fsdpd, 3, tls=tls)
    hosts = attach(c)
    for host in hosts:
        for r in host:
            r.register(shapes=SHAPES)
    everyone = [r for host in hosts for r in host]
    assert on_all(everyone, "Unshard", step=1, backward=True) == [None] * len(everyone)
    victim = c.daemons[2]
    survivors = hosts[0] + hosts[1]
    box = {}
    t0 = time.monotonic()
    waiter = threading.Thread(
        target=lambda: box.update(e=on_all(survivors, "ReduceScatter", step=1)))
    waiter.start()
    time.sleep(0.2)  # the survivors reach the ring; host 2's trainers never come
    sig = signal.SIGKILL if how == "SIGKILL" else signal.SIGSTOP
    victim.proc.send_signal(sig)
    try:
        waiter.join(30)
        elapsed = time.monotonic() - t0
        errors = box["e"]
        for e in errors:
            assert e is not None and e.code() in (grpc.StatusCode.UNAVAILABLE,
                                                   grpc.StatusCode.ABORTED,
                                                   grpc.StatusCode.DEADLINE_EXCEEDED), e
            assert "host 2" in e.details(), e.details()
        assert elapsed < 1.0 + 3.0, elapsed  # peer.timeout + slack
    finally:
        if how == "SIGSTOP":
            victim.proc.send_signal(signal.SIGCONT)
    for d in c.daemons[:2]:
        d.assert_serving()
    if how == "SIGKILL":
        # The host comes back: it joins again and collectives work again, in a new job.
        victim.proc.wait(5)
        c.restart(2)
        wait_all_joined(c)
        check_collectives(c, "FULL_SHARD", FP32, step=1, job="again")


def test_a_collective_needing_a_lost_host_fails_within_peer_timeout(fsdpd):
    """The cluster formed, then host 1 was SIGKILLed and is LOST. A collective host 0 starts
    now needs it: it waits peer.timeout for host 1 to be back, then fails naming it; not
    peer.join_timeout (2 minutes by default) counted from the daemon's start."""
    c = start_cluster(fsdpd, 2)
    hosts = attach(c)
    for host in hosts:
        for r in host:
            r.register(shapes=SHAPES)
    c.daemons[1].proc.kill()
    c.daemons[1].proc.wait(5)
    wait_state(c.daemons[0], 1, "LOST", 1.0 + 3.0)
    t0 = time.monotonic()
    errors = on_all(hosts[0], "Unshard", step=1)
    elapsed = time.monotonic() - t0
    for e in errors:
        assert e is not None and e.code() == grpc.StatusCode.UNAVAILABLE, e
        assert "host 1 (127.0.0.1:" in e.details() and "LOST" in e.details(), e.details()
        assert "not back within peer.timeout (1000 ms)" in e.details(), e.details()
    assert 0.9 <= elapsed < 1.0 + 3.0, elapsed  # peer.timeout, plus slack for a loaded machine
    c.daemons[0].assert_serving()
    # Host 1 back, the same collective works again.
    c.restart(1)
    wait_all_joined(c)
    check_collectives(c, "FULL_SHARD", FP32, step=1, job="again")


def test_a_second_daemon_claiming_a_host_rank_is_named_and_changes_nothing(fsdpd, tmp_path):
    """A second daemon starts as host 1, with the cluster's host list and token, listening
    on another loopback address at host 1's port. Its Joins carry another incarnation:
    host 0 asks host 1's own address, which answers with the live one, so they are refused
    with ALREADY_EXISTS naming host 1, its live incarnation and where they came from. The
    cluster keeps its relationship (nothing lost, nothing joined again) and its collectives
    work while the impostor keeps trying."""
    c = start_cluster(fsdpd, 2, extra=token_args(tmp_path))
    d0, d1 = c.daemons
    inc1 = peers(d1)["incarnation"]
    impostor = fsdpd(*c.args(1), "--peer-listen", f"127.0.0.2:{c.ports[1]}", env=c.env,
                     name=f"{c.tag}-impostor")
    inc_x = peers(impostor)["incarnation"]
    assert inc_x != inc1
    seen = wait_state(impostor, 0, "REFUSED", 10.0)
    assert "ALREADY_EXISTS" in seen["last_error"], seen
    assert (f"host 1 is JOINED at incarnation {inc1}, as its own address "
            f"127.0.0.1:{c.ports[1]} confirmed; this Join as host 1, incarnation {inc_x}, "
            "came from ipv4:127.0.0.1:") in seen["last_error"], seen
    for step in range(1, 4):  # collectives go on while the impostor keeps joining
        check_collectives(c, "FULL_SHARD", FP32, step=step, job=f"j{step}")
    r = row(d0, 1)
    assert r["state"] == "JOINED" and r["incarnation"] == inc1, r
    assert f"incarnation {inc_x}" in r["last_error"], r
    assert row(d1, 0)["state"] == "JOINED"
    log0, log1 = d0.stderr(), d1.stderr()
    assert log0.count("another daemon claims the host's rank") == 1, log0  # logged once
    assert f"host 1 (127.0.0.1:{c.ports[1]}) is " not in log0, log0  # never dropped
    assert log0.count(f"host 1 (127.0.0.1:{c.ports[1]}) joined") == 1, log0
    assert f"host 0 (127.0.0.1:{c.ports[0]}) is " not in log1, log1
    assert log1.count(f"host 0 (127.0.0.1:{c.ports[0]}) joined") == 1, log1
    assert impostor.running() and d0.running() and d1.running()


class NetnsCluster:
    """Two daemons, each in a network namespace of its own, joined by a veth pair: their Peer
    service and UCX (over tcp) cross a real link rather than loopback. Trainers reach the
    daemons' unix sockets, which belong to the file system, from the test's namespace."""

    def __init__(self, fsdpd, tag):
        self.names = [f"fsdp{tag}a", f"fsdp{tag}b"]
        self.addresses = ["10.231.7.1", "10.231.7.2"]
        self.daemons = []
        self._ip("link", "add", f"{self.names[0]}v", "type", "veth", "peer", "name",
                 f"{self.names[1]}v")
        for ns, address in zip(self.names, self.addresses):
            self._ip("netns", "add", ns)
            self._ip("link", "set", f"{ns}v", "netns", ns)
            self._ip("-n", ns, "addr", "add", f"{address}/24", "dev", f"{ns}v")
            self._ip("-n", ns, "link", "set", f"{ns}v", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
        hosts = ",".join(f"{a}:7100" for a in self.addresses)
        for rank, ns in enumerate(self.names):
            self.daemons.append(fsdpd(
                "--hosts", hosts, "--host-rank", rank, "--local-world-size", L,
                "--set", "peer.heartbeat_interval=100ms", "--set", "peer.timeout=1s",
                "--set", "memory.job_limit=64MiB", *INSECURE, health_listen="",
                env={"UCX_TLS": "tcp"},
                prefix=["ip", "netns", "exec", ns], name=f"{ns}-host{rank}"))

    @staticmethod
    def _ip(*args):
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
        if r.returncode:
            raise OSError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def close(self):
        for d in self.daemons:
            d.kill()
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def test_daemons_in_their_own_network_namespaces(fsdpd):
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 to make network namespaces and a veth pair")
    try:
        c = NetnsCluster(fsdpd, os.getpid() % 100000)
    except OSError as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    try:
        wait_all_joined(c)
        check_collectives(c, "FULL_SHARD", FP32)
        check_collectives(c, "HYBRID_SHARD", BF16, job="hybrid")
    finally:
        c.close()


def test_trainers_must_match_the_clusters_local_world_size(fsdpd):
    c = start_cluster(fsdpd, 2)
    with pytest.raises(AssertionError) as excinfo:  # the memory channel's welcome refuses
        Rank(c.daemons[0], 0, 3, job="wide")
    assert ("job 'wide': local_world_size 3, but every host of this cluster runs "
            "cluster.local_world_size = 2 trainers") in str(excinfo.value)
    c.daemons[0].assert_serving()


def test_collectives_wait_for_the_cluster_then_fail_naming_who_is_missing(fsdpd):
    """Host 1 never comes: host 0's collective among hosts waits for the cluster to join,
    then fails after peer.join_timeout naming the host; the daemon keeps serving."""
    hosts = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    d = fsdpd("--hosts", hosts, "--host-rank", 0, "--local-world-size", L,
              "--set", "memory.job_limit=64MiB", "--set", "peer.join_timeout=1500ms",
              *INSECURE)
    ranks = [Rank(d, r, L) for r in range(L)]
    for r in ranks:
        r.register(shapes=SHAPES)
    t0 = time.monotonic()
    errors = on_all(ranks, "Unshard", step=1)
    elapsed = time.monotonic() - t0
    for e in errors:
        assert e is not None and e.code() == grpc.StatusCode.UNAVAILABLE, e
        assert "the hosts did not all join" in e.details() and "host 1" in e.details(), \
            e.details()
    assert elapsed < 1.5 + 3.0, elapsed
    d.assert_serving()


def test_a_daemon_stops_cleanly_while_collectives_wait_for_the_cluster(fsdpd):
    hosts = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    d = fsdpd("--hosts", hosts, "--host-rank", 0, "--local-world-size", L,
              "--set", "memory.job_limit=64MiB", "--set", "daemon.drain_timeout=300ms",
              *INSECURE)
    ranks = [Rank(d, r, L) for r in range(L)]
    for r in ranks:
        r.register(shapes=SHAPES)
    box = {}
    waiter = threading.Thread(target=lambda: box.update(e=on_all(ranks, "Unshard", step=1)))
    waiter.start()
    time.sleep(0.3)  # both ranks asked: the gather waits for host 1 to join
    d.send_signal(signal.SIGTERM)
    assert d.wait() == 0
    waiter.join(10)
    assert all(e is not None for e in box["e"])


def test_a_session_that_ends_while_its_call_waits_is_never_answered_ok(fsdpd):
    """Host 0's ranks are in a gather already running (their cast done, the all-gather among
    hosts waiting for host 1's ranks) when rank 0's session ends: its Unshard ends at once
    with ABORTED naming the session, not OK when the gather later completes; the others
    get the unit."""
    c = start_cluster(fsdpd, 2)
    hosts = attach(c)
    layouts = [[r.register(shapes=SHAPES) for r in host] for host in hosts]
    values = values_for(layouts[0][0].padded_numel, 13)
    for host, lays in zip(hosts, layouts):
        for r, x in zip(host, lays):
            r.write_master_shard(x, values)
    d0 = c.daemons[0]
    box = {}
    waiting = [threading.Thread(target=lambda r=r: box.update({r.rank: on_all([r], "Unshard",
                                                                              step=1)[0]}))
               for r in hosts[0]]
    for t in waiting:
        t.start()

    def running():
        units = d0.call("/fsdp.v1.Operator/ListUnits", operator_pb2.ListUnitsRequest(),
                        operator_pb2.ListUnitsReply).units
        return units and any(ci.running for ci in units[0].collectives)
    poll(running, 10, what="host 0's gather to run")
    ended = hosts[0][0]
    d0.call("/fsdp.v1.Trainer/Detach", trainer_pb2.DetachRequest(session_id=ended.session),
            trainer_pb2.DetachReply)
    waiting[0].join(5)
    answered_before_the_gather = not waiting[0].is_alive()
    assert on_all(hosts[1], "Unshard", step=1) == [None] * L
    for t in waiting:
        t.join(10)
    assert answered_before_the_gather, "rank 0's Unshard still waited after its session ended"
    e = box[0]
    assert e is not None and e.code() == grpc.StatusCode.ABORTED, e
    assert (f"session {ended.session:016x} (job 'j' local rank 0) ended while the call waited: "
            f"detached") in e.details(), e.details()
    assert box[1] is None
    for r, x in [(hosts[0][1], layouts[0][1])] + list(zip(hosts[1], layouts[1])):
        assert r.unsharded(x, FP32) == encode(values, FP32)
