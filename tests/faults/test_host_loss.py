"""The fault matrix's rows of a lost host (tests/faults/run.sh repeats each with an external
deadline and prints docs/RELIABILITY.md's table): 2 replica groups x 2 hosts, four daemons on
this machine (cluster.shard_group_hosts 2, HYBRID_SHARD), 2 trainers each, the daemons' AdamW
with clipping, no checkpoint directory. The same cluster first trains a job uninterrupted;
then a second job, whose lost host (host 1, or host 2 of the other group) loses its trainer
(SIGKILL, as the backward of step 3 starts) and its daemon (SIGKILL). A new daemon takes its
rank, the job's trainers start again on every host (generation 1), the lost host copies its
shards, optimizer state and step from its replica (the same place in the other group: host
3, or host 0), and the job ends with losses and
parameters bit for bit the uninterrupted job's. Meanwhile the surviving daemons keep
serving: their threads are as many as before, their descriptors grow by what the second job
holds and nothing more, and fsdpctl shows every host joined again.

torch runs only in the child processes, under the tests' interpreter (.venv/bin/python).
"""

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from fsdpd_harness import built_with, fsdpd, poll  # noqa: E402,F401
from test_peers import Cluster, peers, wait_all_joined  # noqa: E402
from test_shard_model import DAEMON_ARGS, STEPS, _assert_matches, _finish, _start  # noqa: E402
from worker_records import final as _final, losses as _losses  # noqa: E402

pytestmark = pytest.mark.skipif(built_with("FSDP_SANITIZE"),
                                reason="ASan/UBSan build: libfsdp.so would need libasan "
                                       "preloaded into the interpreter")

ARGS = ("--optim", "adamw", "--clip", "--strategy", "HYBRID_SHARD")
HOSTS, LOCAL = 4, 2


def _ranks(c, job, restarts=0, kill=None):
    """The job's trainers, global rank g on host g // LOCAL; kill: the rank that dies at
    step 3."""
    return [_start(c.daemons[g // LOCAL], "rank", LOCAL, g, *ARGS,
                   *(("--kill-at-step", "3") if g == kill else ()), job=job, hosts=HOSTS,
                   restarts=restarts)
            for g in range(HOSTS * LOCAL)]


# gRPC's own pools, which it grows and shrinks as it likes.
GRPC_THREADS = ("event_engine", "default-executo", "resolver-execut", "grpc_global_tim",
                "timer_manager")


def _counts(d):
    """The daemon's open descriptors, and its threads but gRPC's."""
    pid = d.proc.pid
    threads = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
        except OSError:
            continue  # it ended meanwhile
        threads += comm not in GRPC_THREADS
    return len(os.listdir(f"/proc/{pid}/fd")), threads


def _as_reference(records):
    """An uninterrupted run's records as the one reference _assert_matches takes: the mean of
    the ranks' losses at each step (computed as it computes the ranks' own), and the state
    every rank read back."""
    means = {s: sum(_losses(r)[s] for r in records) / len(records) for s in _losses(records[0])}
    return [{"step": s, "loss": v} for s, v in means.items()] + [
        {"final": True, "state": _final(records[0])}]


@pytest.mark.parametrize("lost", [1, 2], ids=["host1-of-group0", "host2-of-group1"])
def test_a_lost_host_of_a_replica_group_recovers_and_the_job_ends_bit_for_bit(fsdpd, lost):
    c = Cluster(fsdpd, HOSTS, lws=LOCAL,
                extra=[*DAEMON_ARGS, "--set", f"cluster.shard_group_hosts={HOSTS // 2}",
                       "--set", "store.collective_timeout=5s"])
    wait_all_joined(c)
    survivors = [d for i, d in enumerate(c.daemons) if i != lost]
    before = [_counts(d) for d in survivors]
    whole = _finish(_ranks(c, "whole"))
    after_whole = [_counts(d) for d in survivors]

    first = _ranks(c, "lossy", kill=lost * LOCAL)
    on_lost = range(lost * LOCAL, (lost + 1) * LOCAL)
    on_others = [g for g in range(HOSTS * LOCAL) if g not in on_lost]
    before_loss = dict(zip(on_lost, _finish([first[g] for g in on_lost], expect_rc=None)))
    assert [first[g].returncode for g in on_lost] == [-9, 3], before_loss
    c.daemons[lost].kill()
    # Each of the others hears the loss within the collective timeout.
    before_loss.update(zip(on_others, _finish([first[g] for g in on_others], expect_rc=None)))
    assert all(first[g].returncode == 3 for g in on_others), before_loss

    again_daemon = c.restart(lost)
    wait_all_joined(c)
    again = _finish(_ranks(c, "lossy", restarts=1))
    for records in again:
        assert records[0]["resumed"] and records[0]["start"] == 3, records[0]
        assert sorted(_losses(records)) == list(range(3, STEPS + 1))
    replica = (lost + HOSTS // 2) % HOSTS
    log = again_daemon.stderr()
    assert f"host {replica}, a replica of this host's shards, holds it after step 2" in log, log
    assert f"went to host {lost}, which recovers it" in c.daemons[replica].stderr()

    # Steps 1 and 2 of the first run, 3 and 4 of the second: the uninterrupted job's bits.
    firsts = [_losses(before_loss[g]) for g in range(HOSTS * LOCAL)]
    merged = [[{"step": k, "loss": v} for k, v in {**a, **_losses(b)}.items()] +
              [{"final": True, "state": _final(b)}] for a, b in zip(firsts, again)]
    _assert_matches(merged, _as_reference(whole), 0.0)

    for d in c.daemons:
        assert all(p["state"] in ("SELF", "JOINED")
                   for p in peers(d)["peers"]), peers(d)
    # The survivors' own threads are as after the first job (libuv's pool starts with it);
    # their descriptors grew by what one job holds, twice.
    after = [_counts(d) for d in survivors]
    for b, w, a in zip(before, after_whole, after):
        assert a[1] == w[1], (b, w, a)
        assert a[0] - w[0] <= w[0] - b[0], (b, w, a)
