"""A lost host comes back from its replicas' memory (store.recover_from_replicas), with no
checkpoint directory anywhere: 2 daemons x 2 trainers, HYBRID_SHARD with each host its own
shard group, so that each host holds every shard and the other host replicates it. The
trainers train with the daemons' AdamW (its state in the daemons); host 1's trainer dies as
the backward of step 3 starts and its daemon is SIGKILLed, losing the job's masters and
optimizer state there. A new daemon takes host 1's rank; the job's trainers start again on
both hosts (as a launcher restarts them), host 1's daemon copies its shards, optimizer state
and step from host 0 over UCX, and steps 3 and 4 end bit for bit where one process clipping
and stepping as the daemons do ends (test_shard_model's exact reference).

torch runs only in the child processes, under the tests' interpreter (.venv/bin/python).
"""

import json

import pytest

from fsdpd_harness import built_with, fsdpd, poll  # noqa: F401
from test_peers import Cluster, wait_all_joined
from test_shard_model import DAEMON_ARGS, STEPS, _assert_matches, _finish, _start
from worker_records import final as _final, losses as _losses

pytestmark = pytest.mark.skipif(built_with("FSDP_SANITIZE"),
                                reason="ASan/UBSan build: libfsdp.so would need libasan "
                                       "preloaded into the interpreter")

ARGS = ("--optim", "adamw", "--clip", "--strategy", "HYBRID_SHARD")


def _ranks(c, *args, restarts=0, per_rank=None):
    """The job's 4 trainers, global rank g on host g // 2; per_rank: extra args by rank."""
    return [_start(c.daemons[g // 2], "rank", 2, g, *ARGS, *args, *(per_rank or {}).get(g, ()),
                   hosts=2, restarts=restarts) for g in range(4)]


def test_a_killed_host_recovers_from_its_replica_and_the_job_ends_bit_for_bit(fsdpd):
    c = Cluster(fsdpd, 2, lws=2, extra=list(DAEMON_ARGS))
    wait_all_joined(c)
    ref = _start(None, "reference", 4, 0, "--optim", "adamw", "--clip", "--daemon-clip",
                 "--world", "4", "--hosts", "2", "--strategy", "HYBRID_SHARD")
    first = _ranks(c, per_rank={2: ("--kill-at-step", "3")})
    # Host 1's trainers end (one killed, the other told so); its daemon is killed with the
    # job's state, and host 0's trainers, waiting on the all-reduce with host 1, hear it.
    lost = _finish(first[2:], expect_rc=None)
    assert first[2].returncode == -9 and first[3].returncode == 3, lost
    c.daemons[1].kill()
    kept = _finish(first[:2], expect_rc=None)
    assert [p.returncode for p in first[:2]] == [3, 3], kept
    assert all(sorted(_losses(r)) == [1, 2] for r in kept)

    again_daemon = c.restart(1)
    wait_all_joined(c)
    again = _finish(_ranks(c, restarts=1))
    for records in again:
        assert records[0]["resumed"] and records[0]["start"] == 3, records[0]
        assert sorted(_losses(records)) == [3, 4]
    log = again_daemon.stderr()
    assert "host 0, a replica of this host's shards, holds it after step 2" in log, log
    assert "loaded from the memory of host 0 (a replica)" in log, log
    assert "went to host 1, which recovers it" in c.daemons[0].stderr()
    for d in c.daemons:
        unit = json.loads(d.fsdpctl("--json", "unit", "blocks.0").stdout)
        assert unit["optimizer_steps"] == STEPS, unit

    (ref,) = _finish([ref])
    done = [{**_losses(a), **_losses(b)} for a, b in zip(kept + lost, again)]
    merged = [[{"step": k, "loss": v} for k, v in x.items()] + [{"final": True,
              "state": _final(s)}] for x, s in zip(done, again)]
    _assert_matches(merged, ref, 0.0)
