"""Checkpoints move between FSDP2 and fsdpd through torch.distributed.checkpoint (DCP), both
ways and at another world size, with FSDP2's own state-dict APIs: the script of
dcp_worker.py (fully_shard per block and at the root, AdamW, get/set_model_state_dict and
get/set_optimizer_state_dict around dcp.save and dcp.load) under FSDP2 and with fully_shard
from fsdpd.torch. fsdpd's parameters are DTensors over the daemon's masters, so DCP reads and
writes them as it does FSDP2's, resharding by their metadata.

What is compared: a checkpoint loaded at 4 ranks gives back the parameters and AdamW's
moments it was saved with, bit for bit (read back whole with full_tensor()); and from it
both sides take the next step with the same losses, bit for bit (the same parameters, the
same batches: each rank's forward is its own). The steps after differ in the order the 4
ranks' gradients are summed, which neither side's docs fix.
"""

import os
import subprocess

import pytest

from fsdpd_harness import SOURCE_DIR, built_with, fsdpd  # noqa: F401
from test_shard_model import CHILD_TIMEOUT, DAEMON_ARGS, LIB, PYTHON
from worker_records import finish, losses

WORKER = SOURCE_DIR / "tests" / "integration" / "dcp_worker.py"

pytestmark = pytest.mark.skipif(
    built_with("FSDP_SANITIZE"),
    reason="ASan/UBSan build: libfsdp.so would need libasan preloaded into the interpreter")


def run(fsdpd, tmp_path, name, mode, world, steps, load=None, save=None):
    """One side's run: each rank's records, and rank 0's final parameters and moments."""
    import torch
    out = tmp_path / name
    out.mkdir()
    daemon = fsdpd(*DAEMON_ARGS, name=name) if mode == "fully_shard" else None
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("FSDPD_", "TORCHELASTIC_", "MASTER_"))}
        env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
                   FSDP_SOURCE_DIR=str(SOURCE_DIR), OMP_NUM_THREADS="1", RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   GLOO_SOCKET_IFNAME="lo", MKL_CBWR="AUTO,STRICT")
        if daemon:
            env.update(FSDPD_SOCKET=str(daemon.socket_path), FSDPD_JOB=f"dcp-{name}")
        args = ["--out", out, "--steps", steps]
        args += ["--load", load] if load else []
        args += ["--save", save] if save else []
        procs.append(subprocess.Popen([PYTHON, str(WORKER), mode, *map(str, args)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    records = finish(procs, CHILD_TIMEOUT)
    return records, torch.load(out / "final-rank-0.pt")


def assert_same_state(a, b):
    import torch
    for kind in ("params", "moments"):
        assert sorted(a[kind]) == sorted(b[kind]), kind
        for name in a[kind]:
            assert torch.equal(a[kind][name], b[kind][name]), (kind, name)


@pytest.mark.parametrize("saver,loader", [("fsdp2", "fully_shard"), ("fully_shard", "fsdp2")])
def test_a_checkpoint_moves_between_fsdp2_and_fsdpd_at_another_world_size(fsdpd, tmp_path,
                                                                           saver, loader):
    """saver trains 2 steps at 2 ranks and saves; loader loads at 4 ranks: the same
    parameters and moments; then loader and saver's own kind, both at 4 ranks from the
    checkpoint, take step 3 with the same losses."""
    ckpt = tmp_path / "ckpt"
    _, saved = run(fsdpd, tmp_path, "save", saver, 2, 2, save=ckpt)
    _, loaded = run(fsdpd, tmp_path, "load", loader, 4, 0, load=ckpt)
    assert_same_state(saved, loaded)
    ours, _ = run(fsdpd, tmp_path, "next", loader, 4, 1, load=ckpt)
    theirs, _ = run(fsdpd, tmp_path, "next-same", saver, 4, 1, load=ckpt)
    assert [losses(r) for r in ours] == [losses(r) for r in theirs]
    assert all(list(losses(r)) == [3] for r in ours)
