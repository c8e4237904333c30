"""fsdpd.torch.shard_model against a real fsdpd: L trainer processes train the small
transformer of examples/transformer.py through the daemon, each on its slice of every global
batch, and a separate process trains the same model on the whole batch alone
(shard_model_worker.py). The mean of the ranks' losses at every step and the final
parameters (the daemon's masters, read back as a full state dict) must equal the single
process's: within 1e-5 relative in fp32 (L = 2 and 3, FULL_SHARD and SHARD_GRAD_OP); with
param_dtype=bfloat16, bit for bit the reference that performs the ranks' mixed-precision
computation itself. Also: tied and frozen parameters, no_sync
accumulation, clip_grad_norm_ and the state dict round trip; and a trainer SIGKILLed in the
middle of a backward, after which the job's trainers start again, attach, find their
parameters in the daemon and finish the run with the uninterrupted run's results.

torch runs only in the child processes, under the tests' interpreter (.venv/bin/python).
"""

import array
import json
import math
import os
import re
import subprocess
import sys

import pytest

from fsdpd_harness import BUILD_DIR, SOURCE_DIR, built_with, fsdpd, poll  # noqa: F401
from worker_records import final as _final, finish, losses as _losses

PYTHON = sys.executable  # .venv/bin/python, with torch (scripts/venv.sh)
LIB = BUILD_DIR / "lib" / "libfsdp.so"
WORKER = SOURCE_DIR / "tests" / "integration" / "shard_model_worker.py"
DAEMON_ARGS = ("--set", "memory.job_limit=64MiB")
CHILD_TIMEOUT = 120
STEPS = 4


pytestmark = pytest.mark.skipif(built_with("FSDP_SANITIZE"),
                                reason="ASan/UBSan build: libfsdp.so would need libasan "
                                       "preloaded into the interpreter")


def _start(d, mode, world, rank, *args, job="train", hosts=1, restarts=0):
    """A worker: local rank `rank` of `world` on daemon d (global rank host * world + rank
    when there are several hosts), or the reference when d is None; `restarts`: how often
    the launcher restarted the job, as torchrun tells its workers."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FSDPD_") and
           k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
               FSDP_SOURCE_DIR=str(SOURCE_DIR), OMP_NUM_THREADS="1",
               TORCHELASTIC_RESTART_COUNT=str(restarts))
    if d is not None:
        env.update(FSDPD_SOCKET=str(d.socket_path), FSDPD_JOB=job, LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world))
    if hosts > 1:
        host, local = divmod(rank, world)
        env.update(LOCAL_RANK=str(local), RANK=str(rank), WORLD_SIZE=str(world * hosts))
    return subprocess.Popen([PYTHON, str(WORKER), mode, "--steps", str(STEPS), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs, expect_rc=0):
    return finish(procs, CHILD_TIMEOUT, expect_rc)


def _train(d, world, *args):
    """Runs the ranks and the reference together; returns their records."""
    procs = [_start(d, "rank", world, r, *args) for r in range(world)]
    procs.append(_start(None, "reference", world, 0, *args))
    *ranks, ref = _finish(procs)
    return ranks, ref


def _assert_matches(ranks, ref, rel, steps=range(1, STEPS + 1), check_params=True):
    """Losses within rel; each parameter tensor within rel of its largest value."""
    world = len(ranks)
    want = _losses(ref)
    got = [_losses(r) for r in ranks]
    for step in steps:
        mean = sum(g[step] for g in got) / world
        assert abs(mean - want[step]) <= rel * abs(want[step]), (step, mean, want[step])
    # Training moved the parameters: the loss changed by far more than fp32's tolerance.
    assert abs(want[STEPS] - want[1]) > 1e-3 * abs(want[1])
    if not check_params:
        return
    ref_state = _final(ref)
    for r in ranks:  # every rank reads the same full state dict back
        state = _final(r)
        assert list(state) == list(ref_state)  # original names, tied ones under each
        for name, values in ref_state.items():
            scale = max(max(abs(v) for v in values), 1e-6)
            worst = max(abs(a - b) for a, b in zip(state[name], values))
            bound = rel * scale
            assert len(state[name]) == len(values) and worst <= bound, (name, worst, bound)


@pytest.mark.parametrize("world,strategy", [(2, "FULL_SHARD"), (3, "FULL_SHARD"),
                                            (2, "SHARD_GRAD_OP")])
def test_ranks_train_like_one_process(fsdpd, world, strategy):
    d = fsdpd(*DAEMON_ARGS)
    ranks, ref = _train(d, world, "--strategy", strategy)
    for r, records in enumerate(ranks):
        units = records[0]["units"]
        assert [u["name"] for u in units] == ["root", "blocks.0", "blocks.1"]
        assert all(u["shard"] == r for u in units) and not records[0]["resumed"]
    _assert_matches(ranks, ref, 1e-5)
    out = d.fsdpctl("units").stdout
    assert "blocks.0" in out and "blocks.1" in out


@pytest.mark.parametrize("max_inflight,cap_from_step", [(None, 0), (1, 0), (None, 3)],
                         ids=["default", "one-in-flight", "cap-lowered-at-step-3"])
def test_bf16_params_train_exactly_like_the_mixed_precision_reference(fsdpd, max_inflight,
                                                                      cap_from_step):
    """The reference performs the same roundings as the ranks and the daemon (a bf16 copy of
    the masters, bf16 forward and backward per rank, the sum in bf16, the fp32 update), so
    the results are equal bit for bit, whatever the CPU's bf16 kernels round like. The
    daemon's pools never lent more than max_inflight buffers at once, also when the ranks
    lower it between steps (each when it gets there, while the others still hold two)."""
    d = fsdpd(*DAEMON_ARGS)
    world = 3  # a sum of three rounds in between, and 1/3 is no power of two
    extra = ["--max-inflight", str(max_inflight)] if max_inflight else []
    if cap_from_step:
        extra += ["--cap-from-step", str(cap_from_step), "--cap", "1"]
    procs = [_start(d, "rank", world, r, "--param-dtype", "bf16", *extra)
             for r in range(world)]
    procs.append(_start(None, "reference", world, 0, "--param-dtype", "bf16",
                        "--world", str(world)))
    *ranks, ref = _finish(procs)
    want = {rec["step"]: rec["rank_losses"] for rec in ref if "step" in rec}
    assert sorted(want) == list(range(1, STEPS + 1))
    for r, records in enumerate(ranks):
        assert {step: want[step][r] for step in want} == _losses(records), r
    # Training moved the parameters (the loss fell), and they are the reference's exactly.
    assert want[STEPS] != want[1]
    assert all(_final(records) == _final(ref) for records in ranks)
    (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
    cap = max_inflight or 2  # store.max_inflight's default
    assert job["max_inflight"] == (1 if cap_from_step else cap)
    # shard_model has the daemon prefetch one unit ahead, along the order it recorded.
    assert (job["forward_prefetch"], job["backward_prefetch"], job["order_given"]) == (1, 1, False)
    infos = [json.loads(d.fsdpctl("--json", "unit", name).stdout)
             for name in ("root", "blocks.0", "blocks.1")]
    assert [info["forward_index"] for info in infos] == [0, 1, 2]
    # Each unit's last cast and reduce of thousands of elements: microseconds of the daemon's.
    assert all(info["last_gather_us"] > 0 and info["last_reduce_us"] > 0 for info in infos)
    # Both blocks reshard after forward and share the cap (blocks.1 is gathered ahead while
    # the ranks hold blocks.0, so the cap is reached); the root keeps its own copy.
    assert job["copies"]["most_lent"] == cap and job["copies"]["lent"] == 0
    assert job["copies"]["buffers"] == job["max_inflight"]  # a lowered cap drops the rest
    assert len(job["gradients"]) == world
    for pool in job["gradients"]:  # how many at once depends on how the reduces overlap
        assert 0 < pool["most_lent"] <= cap and pool["lent"] == 0
    if cap == 1:  # the prefetch of blocks.1 waits for blocks.0's copy to come back
        assert job["copies"]["waits"] > 0


@pytest.mark.parametrize("optim,clip", [("adamw", False), ("sgd-momentum", False),
                                        ("adamw", True)],
                         ids=["adamw", "sgd-momentum", "adamw-clipped"])
def test_the_daemons_optimizer_trains_like_torch_optim(fsdpd, optim, clip):
    """fsdpd.optim's AdamW (SGD with momentum) in the daemon, weight decay excluded from
    biases and norms by a group and the LR halved every 2 steps by a torch scheduler, against
    torch.optim's in one process that takes the ranks' gradients reduced as the daemon does:
    the losses and parameters bit for bit (the daemon's kernels round as torch's x86-64
    kernels do). Clipped to a norm of 0.5: bit for bit with a reference that clips as the
    daemon does (its squares summed in double, then torch's coefficient from the norm), and
    the losses within 1e-6 of one that uses clip_grad_norm_ (fp32 norms). The state lives in the daemon: fsdpctl shows each unit's
    step count and state bytes."""
    d = fsdpd(*DAEMON_ARGS)
    args = ("--optim", optim, *(("--clip",) if clip else ()))
    procs = [_start(d, "rank", 2, r, *args) for r in range(2)]
    procs.append(_start(None, "reference", 2, 0, *args, "--world", "2",
                        *(("--daemon-clip",) if clip else ())))
    if clip:
        procs.append(_start(None, "reference", 2, 0, *args, "--world", "2"))
    r0, r1, exact, *clip_grad_norm = _finish(procs)
    _assert_matches([r0, r1], exact, 0.0)
    if clip:
        _assert_matches([r0, r1], clip_grad_norm[0], 1e-6, check_params=False)
    unit = json.loads(d.fsdpctl("--json", "unit", "blocks.0").stdout)
    assert unit["optimizer_steps"] == STEPS, unit
    (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
    arrays = 2 if optim == "adamw" else 1
    assert job["optimizer_bytes"] >= arrays * 4 * unit["padded_numel"], job


def test_tied_frozen_no_sync_clipping_and_state_dict(fsdpd):
    d = fsdpd(*DAEMON_ARGS)
    ranks, ref = _train(d, 2, "--features")
    units = [u["name"] for u in ranks[0][0]["units"]]
    assert units == ["root", "root#frozen", "blocks.0", "blocks.1"]
    state = _final(ranks[0])
    assert state["tok.weight"] == state["head.weight"]  # tied: one parameter, both names
    assert all(r["norm"] > 0 for r in ranks[0] if "norm" in r)
    _assert_matches(ranks, ref, 1e-5)


@pytest.mark.parametrize("staged", [False, True], ids=["", "staged"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
def test_two_daemons_train_like_one_process(fsdpd, strategy, staged):
    """2 daemons x 2 trainers: FULL_SHARD shards every unit over the 4 ranks of both hosts,
    HYBRID_SHARD over each host's 2 and replicates across; each trainer takes the slice of
    the batch of its global rank, and the run equals one process on the whole batch. Staged:
    the rings among hosts move host buffers of their own, as a GPU's jobs do."""
    from test_cluster import STAGED
    from test_peers import Cluster, wait_all_joined
    c = Cluster(fsdpd, 2, lws=2, extra=list(DAEMON_ARGS), env=STAGED if staged else None)
    wait_all_joined(c)
    procs = [_start(c.daemons[g // 2], "rank", 2, g, "--strategy", strategy, "--features",
                    hosts=2) for g in range(4)]
    procs.append(_start(None, "reference", 4, 0, "--features"))
    *ranks, ref = _finish(procs)
    shards = [records[0]["units"][0]["shard"] for records in ranks]
    assert shards == ([0, 1, 2, 3] if strategy == "FULL_SHARD" else [0, 1, 0, 1])
    _assert_matches(ranks, ref, 1e-5)
    for d in c.daemons:
        # Each step is two micro-batches, the first under no_sync: HYBRID_SHARD all-reduces
        # among the replicas once per step (the first micro-batch's reduce defers), FULL_SHARD
        # has no replicas.
        for name in ("root", "blocks.0", "blocks.1"):
            unit = json.loads(d.fsdpctl("--json", "unit", name).stdout)
            assert unit["deferred_reduces"] == 0, unit
            assert unit["replica_all_reduces"] == (STEPS if strategy == "HYBRID_SHARD" else 0)
        # The host sums are lent while the reduces' rings run, never more than the cap.
        (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
        sums = job["sums"]
        assert 0 < sums["most_lent"] <= job["max_inflight"] and sums["lent"] == 0, job
        assert sums["buffers"] <= job["max_inflight"], job
        assert (job["ring_staging_buffers"] > 0) == staged, job


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD"])
def test_two_daemons_clip_by_the_norm_of_every_hosts_shards(fsdpd, strategy):
    """The daemons' AdamW with max_grad_norm on 2 daemons x 2 trainers: FULL_SHARD's units
    span both hosts, whose parts of the norm an all-reduce among them sums in fp32;
    HYBRID_SHARD's shard group is one host, holding every shard. Bit for bit against one
    process clipping as the daemons do, rounding for rounding (clip_as_the_daemon: each
    host's part of each unit, the fp32 ring, the units in registration order, torch's
    coefficient), on the 4 ranks' gradients summed as the daemons sum them. A reference
    that summed the squares in double alone was off by 1e-6 in qkv.bias's key part, whose
    gradient is zero but for rounding noise that AdamW brings to its learning rate."""
    from test_peers import Cluster, wait_all_joined
    c = Cluster(fsdpd, 2, lws=2, extra=list(DAEMON_ARGS))
    wait_all_joined(c)
    args = ("--optim", "adamw", "--clip")
    procs = [_start(c.daemons[g // 2], "rank", 2, g, "--strategy", strategy, *args, hosts=2)
             for g in range(4)]
    procs.append(_start(None, "reference", 4, 0, *args, "--daemon-clip", "--world", "4",
                        "--hosts", "2", "--strategy", strategy))
    *ranks, ref = _finish(procs)
    (units,) = [r["units"] for r in ref if "units" in r]  # the layout the reference assumed
    assert all([{k: u[k] for k in ("name", "numel")} for u in r[0]["units"]] == units
               for r in ranks), units
    _assert_matches(ranks, ref, 0.0)
    for d in c.daemons:
        unit = json.loads(d.fsdpctl("--json", "unit", "blocks.0").stdout)
        assert unit["optimizer_steps"] == STEPS, unit


def test_torch_adamw_steps_the_original_parameters_and_state_dicts_round_trip(fsdpd, tmp_path):
    """model.named_parameters() yields the original names, each this rank's part of the
    parameter; torch.optim.AdamW over them in two groups (no weight decay on biases and
    norms) trains exactly like the reference's over the whole parameters, on batches from a
    DataLoader with 2 workers. After step 2 the full and sharded state dicts go through
    torch.save, the masters are zeroed through a full one and loaded back from the sharded
    file, and training goes on unchanged."""
    args = ("--optim", "torch-adamw")
    ref = _start(None, "reference", 2, 0, *args, "--world", "2")
    d = fsdpd(*DAEMON_ARGS)
    ranks = _finish([_start(d, "rank", 2, r, *args, "--state-dict-at-step", "2",
                            "--checkpoint", tmp_path, "--loader-workers", "2")
                     for r in range(2)])
    (ref,) = _finish([ref])
    for records in ranks:
        (trip,) = [r["round_trip"] for r in records if "round_trip" in r]
        assert trip == sorted(_final(ref))
        # The batches came from DataLoader workers forked after the client, which refuses
        # them its calls.
        (refused,) = [r["worker_refused"] for r in records if "worker_refused" in r]
        assert "was forked from it (a DataLoader worker?)" in refused, refused
    _assert_matches(ranks, ref, 0.0)


def test_a_checkpoint_brings_the_job_back_on_a_new_daemon(fsdpd, tmp_path):
    """The ranks train 2 steps with the daemon's AdamW and save a checkpoint; that daemon
    goes. On a new daemon, new ranks register the same model, load the checkpoint (masters
    and the optimizer's state) and train steps 3 and 4: the end is the uninterrupted run's
    bit for bit."""
    args = ("--optim", "adamw")
    ref = _start(None, "reference", 2, 0, *args, "--world", "2")
    d = fsdpd(*DAEMON_ARGS)
    first = _finish([_start(d, "rank", 2, r, *args, "--save-at-step", "2", "--checkpoint",
                            tmp_path, job="ckpt") for r in range(2)])
    assert all({"saved": 2} in records for records in first)
    d.stop()
    d = fsdpd(*DAEMON_ARGS, name="again")
    again = _finish([_start(d, "rank", 2, r, *args, "--load", tmp_path, job="ckpt")
                     for r in range(2)])
    for records in again:
        assert records[0]["start"] == 3 and sorted(_losses(records)) == [3, 4]
    (ref,) = _finish([ref])
    done = [{**_losses(a), **_losses(b)} for a, b in zip(first, again)]
    merged = [[{"step": k, "loss": v} for k, v in x.items()] + [{"final": True,
              "state": _final(s)}] for x, s in zip(done, again)]
    _assert_matches(merged, ref, 0.0)


def test_a_killed_daemon_comes_back_from_its_last_checkpoint(fsdpd, tmp_path):
    """The daemon saves every 2 steps (checkpoint.every_steps) while the ranks train 4 steps
    with its AdamW, and is then SIGKILLed: steps 3 and 4 are lost with it. A new daemon with
    checkpoint.resume = latest takes the job up from step 2; the same ranks' script, started
    again, finds the model trained (model.resumed, completed_steps 2) and trains steps 3
    and 4 again: the end is the uninterrupted run's bit for bit, and step 2's checkpoint is
    as it was."""
    options = (*DAEMON_ARGS, "--set", f"checkpoint.dir={tmp_path}",
               "--set", "checkpoint.every_steps=2", "--set", "checkpoint.resume=latest")
    args = ("--optim", "adamw")
    ref = _start(None, "reference", 2, 0, *args, "--world", "2")
    d = fsdpd(*options)
    first = _finish([_start(d, "rank", 2, r, *args) for r in range(2)])
    poll(lambda: (tmp_path / "train" / "step-2" / "manifest.json").exists(), 20,
         what="step 2's checkpoint")
    d.kill()
    resumed_from = (tmp_path / "train" / "step-2" / "host-0.bin").read_bytes()
    d = fsdpd(*options, name="again")
    again = _finish([_start(d, "rank", 2, r, *args) for r in range(2)])
    for records in again:
        assert records[0]["resumed"] and records[0]["start"] == 3
        assert sorted(_losses(records)) == [3, 4]
    # The step boundary of step 2 came before the load: no save then wrote the job's
    # memory, not loaded yet, over the checkpoint it resumed from.
    assert (tmp_path / "train" / "step-2" / "host-0.bin").read_bytes() == resumed_from
    (ref,) = _finish([ref])
    done = [{**{k: v for k, v in _losses(a).items() if k <= 2}, **_losses(b)}
            for a, b in zip(first, again)]
    merged = [[{"step": k, "loss": v} for k, v in x.items()] + [{"final": True,
              "state": _final(s)}] for x, s in zip(done, again)]
    _assert_matches(merged, ref, 0.0)


def _train_on(fsdpd, layout, name, *args):
    """Ranks of job 'ckpt' trained at layout (hosts, local ranks, strategy), one daemon per
    host, which stop after: their records."""
    hosts, world, strategy = layout
    if hosts == 1:
        daemons = [fsdpd(*DAEMON_ARGS, name=name)]
    else:
        from test_peers import Cluster, wait_all_joined
        c = Cluster(fsdpd, hosts, lws=world, extra=list(DAEMON_ARGS))
        wait_all_joined(c)
        daemons = c.daemons
    records = _finish([_start(daemons[g // world], "rank", world, g, "--strategy", strategy,
                              *args, job="ckpt", hosts=hosts) for g in range(hosts * world)])
    for d in daemons:
        assert d.stop() == 0
    return records


@pytest.mark.parametrize("saved,loaded,optim", [
    ((1, 2, "FULL_SHARD"), (1, 3, "FULL_SHARD"), "adamw"),
    ((2, 2, "FULL_SHARD"), (1, 3, "FULL_SHARD"), "adamw"),
    ((1, 3, "FULL_SHARD"), (2, 2, "HYBRID_SHARD"), "adamw"),
    ((2, 2, "FULL_SHARD"), (1, 3, "FULL_SHARD"), "torch-adamw"),
], ids=["1x2-1x3", "2x2-1x3", "1x3-2x2hybrid", "2x2-1x3-torch-adamw"])
def test_a_checkpoint_loads_at_another_world_size_and_strategy(fsdpd, tmp_path, saved, loaded,
                                                               optim):
    """Saved after step 2 with AdamW at one layout (hosts x local ranks, strategy), loaded at
    another: each daemon reads the elements it now holds, masters and AdamW's moments (the
    daemons', or torch's saved beside by original names), from whichever files hold them.
    Steps 3 and 4 go on exactly like the reference, which sums the ranks' gradients as the
    first layout's daemons do for steps 1 and 2 and as the second's do after."""
    args = ("--optim", optim)
    ref = _start(None, "reference", 1, 0, *args, "--world", str(saved[0] * saved[1]),
                 "--hosts", str(saved[0]), "--layout-from", "3", str(loaded[0] * loaded[1]),
                 str(loaded[0]))
    first = _train_on(fsdpd, saved, "first", *args, "--save-at-step", "2",
                      "--checkpoint", tmp_path)
    assert all({"saved": 2} in records for records in first)
    manifest = json.loads((tmp_path / "step-2" / "manifest.json").read_text())
    assert manifest["hosts"] == saved[0]
    # The export of every host's files is the full state dict the ranks read, bit for bit.
    from fsdpd_harness import run_fsdpctl
    from test_checkpoint import read_safetensors
    out = tmp_path / "model.safetensors"
    assert run_fsdpctl("export", tmp_path, "--out", out).returncode == 0
    _, tensors = read_safetensors(out)
    state = _final(first[0])
    assert sorted(tensors) == sorted(state)
    for name, values in state.items():
        kind, shape, data = tensors[name]
        assert kind == "F32" and math.prod(shape) == len(values), name
        assert data == array.array("f", values).tobytes(), name
    again = _train_on(fsdpd, loaded, "again", *args, "--load", tmp_path)
    (ref,) = _finish([ref])
    want = _losses(ref)
    for step, runs in [(1, first), (2, first), (3, again), (4, again)]:
        assert sum(_losses(records)[step] for records in runs) / len(runs) == want[step], step
    merged = [[{"step": 4, "loss": _losses(records)[4]},
               {"final": True, "state": _final(records)}] for records in again]
    _assert_matches(merged, ref, 0.0, steps=[4])


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_a_killed_trainer_restarts_and_training_goes_on(fsdpd, optim):
    """Rank 1 dies (SIGKILL) as the backward of step 3 starts; rank 0 hears it from the
    daemon (ABORTED, naming the rank) instead of hanging. Both start again like a launcher
    would restart them: they find the job's parameters in the daemon, resume at step 3, and
    end where an uninterrupted run ends. With the daemon's AdamW its state is in the daemon
    too, and the end is the uninterrupted run's bit for bit (torch.optim's on the same
    gradients, which test_the_daemons_optimizer_trains_like_torch_optim holds to the
    daemon's)."""
    d = fsdpd(*DAEMON_ARGS)
    args = ("--optim", optim)
    first = [_start(d, "rank", 2, 0, *args), _start(d, "rank", 2, 1, "--kill-at-step", "3", *args)]
    ref = _start(None, "reference", 2, 0, *args, *(("--world", "2") if optim != "sgd" else ()))
    r0, r1 = _finish(first, expect_rc=None)
    assert first[1].returncode == -9 and first[0].returncode == 3
    error = next(r for r in r0 if "error" in r)
    # Rank 0 was waiting for rank 1 ("is gone"), or asked after it died ("ended their
    # session"): either way at once, naming it.
    assert error["status"] == "ABORTED"
    assert re.search(r"local rank(\(s\))? 1 of job 'train' (is gone|ended their session)",
                     error["error"]), error
    assert sorted(_losses(r0)) == [1, 2]
    # Both sessions are gone, and so is every buffer they held, the dead rank's included.
    poll(lambda: not d.status().sessions, 5, what="both sessions to end")
    (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
    assert [pool["lent"] for pool in job["gradients"]] == [0, 0]
    assert all(pool["most_lent"] > 0 for pool in job["gradients"])
    assert job["copies"]["lent"] == 0

    again = [_start(d, "rank", 2, r, *args, restarts=1) for r in range(2)]
    s0, s1 = _finish(again)
    (ref,) = _finish([ref])
    for records in (s0, s1):
        assert records[0]["resumed"] and records[0]["start"] == 3
    done = [{**_losses(a), **_losses(b)} for a, b in ((r0, s0), (r1, s1))]
    merged = [[{"step": k, "loss": v} for k, v in x.items()] + [{"final": True,
              "state": _final(s)}] for x, s in zip(done, (s0, s1))]
    _assert_matches(merged, ref, 1e-5 if optim == "sgd" else 0.0)


EDGES = r'''
import os, sys, json
import torch
from torch import nn
import fsdpd, fsdpd.torch

torch.manual_seed(0)
torch.set_num_threads(1)
out = {}

# Wrapped modules that are the root's own children are units of their own.
client = fsdpd.Client(job="edges-seq")
seq = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
model = fsdpd.torch.shard_model(seq, client, wrap={nn.Linear})
out["seq_units"] = [u.name for u in model.units]
client.close()

# A unit whose output feeds the loss only on some steps: its backward prefetch is never
# waited for by its own backward.
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.b0, self.b1, self.b2 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x, use_aux):
        h = self.b0(x)
        aux = self.b1(h)
        y = self.b2(h)
        return y + aux.sum(dim=1, keepdim=True) if use_aux else y

client = fsdpd.Client(job="edges-aux")
model = fsdpd.torch.shard_model(Net(), client, wrap={nn.Linear})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(3, 4)
for step, use_aux in enumerate([True, False, True]):
    opt.zero_grad()
    model(x, use_aux).pow(2).mean().backward()
    opt.step()
out["aux_steps"] = model.completed_steps
before = model(x, False).detach()

# Loading a state dict right after attaching again to a trained job takes effect at once.
client.close()
client = fsdpd.Client(job="edges-aux")
model = fsdpd.torch.shard_model(Net(), client, wrap={nn.Linear})
out["resumed"] = model.resumed
sd = model.full_state_dict()
model.load_full_state_dict({k: torch.zeros_like(v) for k, v in sd.items()})
with torch.no_grad():
    out["after_zero_load"] = model(x, False).reshape(-1).tolist()
client.close()
print(json.dumps(out))
'''


def test_edges_root_children_prefetch_without_backward_and_load_after_resume(fsdpd, tmp_path):
    d = fsdpd(*DAEMON_ARGS)
    script = tmp_path / "edges.py"
    script.write_text(EDGES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")}
    env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
               FSDPD_SOCKET=str(d.socket_path), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               OMP_NUM_THREADS="1")
    r = subprocess.run([PYTHON, str(script)], env=env, capture_output=True, text=True,
                       timeout=CHILD_TIMEOUT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["seq_units"] == ["0", "2"]
    assert out["aux_steps"] == 3
    assert out["resumed"] and out["after_zero_load"] == [0.0, 0.0, 0.0]


POLICIES = r'''
import json, os, sys
sys.path.insert(0, os.path.join(os.environ["FSDP_SOURCE_DIR"], "examples"))
import torch
import fsdpd, fsdpd.torch
from transformer import Config, TinyGPT, Block, batch, loss_fn

cfg = Config(vocab=64, d_model=16, n_heads=2, n_layers=2, seq_len=8)
block = sum(p.numel() for p in TinyGPT(cfg, seed=0).blocks[0].parameters())
out = {}
for key, policy in [("class", fsdpd.torch.wrap_by_class(Block)),
                    ("name", fsdpd.torch.wrap_by_name("blocks.?")),
                    ("size", fsdpd.torch.wrap_by_size(block)),
                    ("small", fsdpd.torch.wrap_by_size(block // 4))]:
    client = fsdpd.Client(job="wrap-" + key)
    model = fsdpd.torch.shard_model(TinyGPT(cfg, seed=0), client, wrap=policy)
    out[key] = [u.name for u in model.units]
    if key == "class":
        tokens, targets = batch(1, 2, cfg.seq_len, cfg.vocab)
        loss_fn(model(tokens), targets).backward()
        mine = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # nothing clipped
        out["same_norm"] = float(mine) == float(model.clip_grad_norm_(1e9))
        try:
            torch.nn.utils.clip_grad_norm_(list(model.parameters())[:3], 1.0)
        except RuntimeError as e:
            out["refused"] = str(e)
        plain = torch.ones(3, requires_grad=True)
        plain.grad = torch.full((3,), 4.0)
        out["plain"] = float(torch.nn.utils.clip_grad_norm_([plain], 1.0))
    client.close()
print(json.dumps(out))
'''


def test_wrap_policies_and_torch_clip_grad_norm_on_a_sharded_model(fsdpd, tmp_path):
    """wrap_by_class, wrap_by_name and wrap_by_size pick the units FSDP's policies would;
    torch.nn.utils.clip_grad_norm_ over every parameter of the model takes the global norm
    (model.clip_grad_norm_'s), over some of them is refused naming model.clip_grad_norm_,
    and over other tensors is torch's own."""
    d = fsdpd(*DAEMON_ARGS)
    script = tmp_path / "policies.py"
    script.write_text(POLICIES)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")}
    env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
               FSDPD_SOCKET=str(d.socket_path), FSDP_SOURCE_DIR=str(SOURCE_DIR),
               OMP_NUM_THREADS="1")
    r = subprocess.run([PYTHON, str(script)], env=env, capture_output=True, text=True,
                       timeout=CHILD_TIMEOUT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    blocks = ["blocks.0", "blocks.1", "root"]
    assert sorted(out["class"]) == sorted(out["name"]) == sorted(out["size"]) == blocks
    # Smaller units: the blocks' layers, bottom up, and no block is left with enough.
    assert "blocks.0.fc" in out["small"] and "blocks.0" not in out["small"]
    assert out["same_norm"]
    assert "call model.clip_grad_norm_(max_norm) on every rank" in out["refused"]
    assert abs(out["plain"] - 48 ** 0.5) < 1e-5


def _torchrun(d, nnodes, node_rank, port, log_dir, *args):
    """torchrun (the tests' torch's, as `python -m torch.distributed.run`) of 2 workers on
    daemon d, node node_rank of nnodes, their stdout in log_dir (redirected and teed, 1: a
    stdout.log per worker); job, ranks and sizes come from torchrun alone."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FSDPD_", "TORCHELASTIC_")) and
           k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
               FSDP_SOURCE_DIR=str(SOURCE_DIR), OMP_NUM_THREADS="1",
               FSDPD_SOCKET=str(d.socket_path))
    log_dir.mkdir()
    out = open(log_dir / "torchrun.out", "w")  # not a pipe: a full one would stall it
    return subprocess.Popen(
        [PYTHON, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
         "--node_rank", str(node_rank), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
         "--rdzv_id", "torchrun-job", "--log_dir", str(log_dir), "--redirects", "1", "--tee", "1",
         str(WORKER), "rank", "--steps", str(STEPS), *args],
        env=env, stdout=out, stderr=subprocess.STDOUT)


def _torchrun_records(log_dirs, world):
    """Each global rank's records, from the stdout torchrun kept for it."""
    out = []
    for r in range(world):
        (path,) = log_dirs.glob(f"node{r // 2}/torchrun-job*/attempt_0/{r % 2}/stdout.log")
        out.append([json.loads(line) for line in path.read_text().splitlines()
                    if line.startswith("{")])
    return out


@pytest.mark.parametrize("hosts", [1, 2])
def test_torchrun_starts_the_trainers(fsdpd, tmp_path, hosts):
    """Trainers launched by torchrun, as an FSDP user launches them, with no variable of
    fsdpd's but the socket: the job is torchrun's run id, ranks and sizes are torchrun's, and
    the daemons check its topology at attach. On one daemon, and on two daemons (torchrun
    on each node): the daemon's AdamW ends exactly where the reference does."""
    from test_peers import Cluster, free_ports, wait_all_joined
    args = ("--optim", "adamw")
    ref = _start(None, "reference", 2 * hosts, 0, *args, "--world", str(2 * hosts),
                 "--hosts", str(hosts))
    if hosts == 1:
        daemons = [fsdpd(*DAEMON_ARGS)]
    else:
        c = Cluster(fsdpd, 2, lws=2, extra=list(DAEMON_ARGS))
        wait_all_joined(c)
        daemons = c.daemons
    (port,) = free_ports(1)
    runs = [_torchrun(d, hosts, h, port, tmp_path / f"node{h}", *args)
            for h, d in enumerate(daemons)]
    for h, run in enumerate(runs):
        code = run.wait(timeout=CHILD_TIMEOUT)
        assert code == 0, (tmp_path / f"node{h}" / "torchrun.out").read_text()[-3000:]
    ranks = _torchrun_records(tmp_path, 2 * hosts)
    (ref,) = _finish([ref])
    _assert_matches(ranks, ref, 0.0)
    for d in daemons:
        assert "job 'torchrun-job'" in d.stderr()


def test_a_script_written_as_for_fsdp_trains_like_one_process(fsdpd, tmp_path):
    """As an FSDP user writes it: launched by torchrun, the model built on the meta device
    (materialized unit by unit through param_init_fn), torch's AdamW over the original
    parameters in two groups, batches from a DataLoader with 2 workers, the state dicts
    saved with torch.save and loaded back after step 2: exactly the single process's
    training, which sums the 2 ranks' gradients as the daemon does."""
    from test_peers import free_ports
    args = ("--optim", "torch-adamw", "--meta")
    ref = _start(None, "reference", 2, 0, *args, "--world", "2")
    (port,) = free_ports(1)
    run = _torchrun(fsdpd(*DAEMON_ARGS), 1, 0, port, tmp_path / "node0", *args,
                    "--state-dict-at-step", "2", "--checkpoint", tmp_path,
                    "--loader-workers", "2")
    assert run.wait(timeout=CHILD_TIMEOUT) == 0, \
        (tmp_path / "node0" / "torchrun.out").read_text()[-3000:]
    ranks = _torchrun_records(tmp_path, 2)
    (ref,) = _finish([ref])
    for records in ranks:
        assert any("round_trip" in r for r in records)
        assert any("worker_refused" in r for r in records)
    _assert_matches(ranks, ref, 0.0)


TOPOLOGY = r'''
import fsdpd
try:
    fsdpd.Client()
except fsdpd.Error as e:
    print(e.status, e)
'''


def test_a_launcher_of_another_topology_is_refused_at_attach(fsdpd, tmp_path):
    """torchrun's variables saying 2 nodes of 2 (this one node 1) against one daemon of one
    host: the attach is refused, naming both topologies. torchrun's run id of a launch
    without --rdzv_id ('none', every launch's) is refused, naming the flag."""
    d = fsdpd(*DAEMON_ARGS)
    script = tmp_path / "topology.py"
    script.write_text(TOPOLOGY)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDPD_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
               FSDPD_SOCKET=str(d.socket_path), TORCHELASTIC_RUN_ID="wrong", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="2", RANK="2", WORLD_SIZE="4", GROUP_RANK="1")
    r = subprocess.run([PYTHON, str(script)], env=env, capture_output=True, text=True,
                       timeout=CHILD_TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("FAILED_PRECONDITION"), r.stdout
    assert "the launcher's topology (world_size 4, node_rank 1, local_world_size 2) is not " \
           "this daemon's (1 host x 2 local ranks = world_size 2, this host's rank 0" in r.stdout
    # torchrun without --rdzv_id: its run id 'none' would make every launch one job.
    r = subprocess.run([PYTHON, str(script)], env={**env, "TORCHELASTIC_RUN_ID": "none"},
                       capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    assert "torchrun was started without --rdzv_id" in r.stderr, r.stderr


SYNC = r'''
import json, os, sys
sys.path.insert(0, os.path.join(os.environ["FSDP_SOURCE_DIR"], "examples"))
import torch
import fsdpd, fsdpd.torch
from transformer import Config, TinyGPT, Block, batch, loss_fn

cfg = Config(vocab=64, d_model=16, n_heads=2, n_layers=2, seq_len=8)
rank = int(os.environ["LOCAL_RANK"])
out = {}
# Each rank builds other values; sync_module_states gives every rank rank 0's.
client = fsdpd.Client(job="sync")
model = fsdpd.torch.shard_model(TinyGPT(cfg, seed=rank), client, wrap={Block},
                                sync_module_states=True)
want = TinyGPT(cfg, seed=0).state_dict()
got = model.state_dict()
out["synced"] = all(torch.equal(got[k], v) for k, v in want.items())
client.close()
# A bfloat16 model: fp32 masters made from its values, its copies and compute in bfloat16.
client = fsdpd.Client(job="bf16")
low = TinyGPT(cfg, seed=3).to(torch.bfloat16)
want = {k: v.float() for k, v in low.state_dict().items()}
model = fsdpd.torch.shard_model(low, client, wrap={Block})
got = model.state_dict()
out["bf16_masters"] = all(torch.equal(got[k], v) for k, v in want.items())
tokens, targets = batch(1, 2, cfg.seq_len, cfg.vocab)
logits = model(tokens)
out["bf16_compute"] = str(logits.dtype)
loss_fn(logits.float(), targets).backward()
out["grads"] = all(p.grad is not None for p in model.parameters())
client.close()
print(json.dumps(out))
'''


def test_sync_module_states_and_a_bfloat16_model(fsdpd, tmp_path):
    """sync_module_states: ranks that built other values all take rank 0's, sent through
    the daemon. A bfloat16 model is accepted: its masters are its values in fp32, exactly,
    and it computes in bfloat16."""
    d = fsdpd(*DAEMON_ARGS)
    script = tmp_path / "sync.py"
    script.write_text(SYNC)
    procs = []
    for r in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")}
        env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
                   FSDPD_SOCKET=str(d.socket_path), FSDP_SOURCE_DIR=str(SOURCE_DIR),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([PYTHON, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=CHILD_TIMEOUT)
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {
            "synced": True, "bf16_masters": True, "bf16_compute": "torch.bfloat16",
            "grads": True}


AGAIN = r'''
import json, sys
import torch
from torch import nn
import fsdpd, fsdpd.torch

torch.manual_seed(0)
torch.set_num_threads(1)
client = fsdpd.Client(job="again")
model = fsdpd.torch.shard_model(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)),
                                client, wrap={nn.Linear})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
out = {"resumed": model.resumed, "start": model.completed_steps + 1}
x = torch.randn(3, 4)
for _ in range(2):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    model.clip_grad_norm_(1.0)
    opt.step()
out["keys"] = sorted(model.state_dict())
out["saved"] = model.save_checkpoint(sys.argv[1])
out["loaded"] = model.load_checkpoint(sys.argv[1])
client.close()
print(json.dumps(out))
'''


def _run_ranks(d, world, argv, job=None):
    """world local ranks of `argv` against daemon d; returns each one's stdout."""
    procs = []
    for r in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")}
        env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
                   FSDPD_SOCKET=str(d.socket_path), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                   **({"FSDPD_JOB": job} if job else {}))
        procs.append(subprocess.Popen([PYTHON, *map(str, argv)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=CHILD_TIMEOUT)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def test_trainers_that_attach_again_use_every_collective_of_the_model(fsdpd, tmp_path):
    """Issue 29 item 3: the model's scratch units (the sums behind clip_grad_norm_,
    state_dict, save_checkpoint and load_checkpoint) go on after the steps the job's earlier
    trainers left them at. Before, the trainers of a second run of the same job got
    FAILED_PRECONDITION ("unit '__fsdpd_sync__': local rank 0 asked for step 1, but the
    unsharded copy already holds step ..."). examples/train.py run twice goes on too: its
    loss unit follows the model's steps."""
    d = fsdpd(*DAEMON_ARGS)
    script = tmp_path / "again.py"
    script.write_text(AGAIN)
    ckpt = tmp_path / "ckpt"
    for run, (resumed, start, end) in enumerate([(False, 1, 2), (True, 3, 4)]):
        for out in _run_ranks(d, 2, [script, ckpt]):
            got = json.loads(out.strip().splitlines()[-1])
            assert (got["resumed"], got["start"], got["saved"], got["loaded"]) == \
                (resumed, start, end, end), (run, got)
            assert got["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]

    train = SOURCE_DIR / "examples" / "train.py"
    small = ["--d-model", "32", "--layers", "1", "--global-batch", "2"]
    (first,) = _run_ranks(d, 1, [train, "--steps", "2", *small], job="demo-again")
    assert re.findall(r"^step +(\d+) +loss", first, re.M) == ["1", "2"], first
    (second,) = _run_ranks(d, 1, [train, "--steps", "4", *small], job="demo-again")
    assert "trained to step 2: going on from step 3 to 4" in second, second
    assert re.findall(r"^step +(\d+) +loss", second, re.M) == ["3", "4"], second
