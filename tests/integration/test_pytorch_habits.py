"""What PyTorch users write, through fsdpd.torch and fsdpd.optim against a real fsdpd (issue
30 item 4): fsdpd.optim's optimizers made over model.parameters() or torch's groups of
tensors, with param_groups that hold them and an LR schedule that reaches the daemon;
gradient accumulation written for torch ((loss / K).backward() K times, then one step());
activation checkpointing with torch.utils.checkpoint (use_reentrant=False); NO_SHARD.

Local ranks train the small transformer of shard_model_worker.py (pytorch_habits_worker.py)
and a single process trains it with torch's own optimizer on the ranks' gradients summed as
the daemon sums them (in fp32, in rank order, times the fp32 nearest 1/world; added over
micro-batches in fp32): the same arithmetic, so the losses and parameters are compared bit
for bit. Where both sides are the daemon's (its AdamW in two forms), bit for bit too.
"""

import json
import os

import pytest

from fsdpd_harness import SOURCE_DIR
from test_shard_model import CHILD_TIMEOUT, DAEMON_ARGS, LIB, PYTHON, _assert_matches, \
    _finish, fsdpd, pytestmark  # noqa: F401
from worker_records import final as _final, losses as _losses

WORKER = SOURCE_DIR / "tests" / "integration" / "pytorch_habits_worker.py"
STEPS = 4


def _start(d, world, rank, *args, extra_env=None):
    """Local rank `rank` of `world` on daemon d, or the reference when d is None."""
    import subprocess
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FSDPD_") and
           k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
               FSDP_SOURCE_DIR=str(SOURCE_DIR), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", **(extra_env or {}))
    if d is not None:
        env.update(FSDPD_SOCKET=str(d.socket_path), FSDPD_JOB="habits", LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world))
    mode = "rank" if d is not None else "reference"
    return subprocess.Popen([PYTHON, str(WORKER), mode, "--steps", str(STEPS), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _train(fsdpd, world, *args, reference=(), extra_env=None, expect_rc=0):
    """The ranks on a new daemon, and with reference= the single process: their records."""
    d = fsdpd(*DAEMON_ARGS)
    procs = [_start(d, world, r, *args, extra_env=extra_env) for r in range(world)]
    if reference is not None:
        procs.append(_start(None, world, 0, "--world", str(world), *reference))
    return d, _finish(procs) if expect_rc == 0 else _finish(procs, expect_rc)


@pytest.mark.parametrize("form", ["params", "groups"])
def test_the_daemons_optimizer_takes_torchs_forms_of_parameters(fsdpd, form):
    """fsdpd.optim.SGD(model.parameters(), ...) and SGD([{"params": [tensors]}, {"params":
    [biases and norms], "weight_decay": 0.0}], ...), momentum 0.9 and an LR halved every 2
    steps by torch's StepLR: exactly torch.optim.SGD's training with the same groups and
    schedule. param_groups hold the parameters (this rank's parts) and their names, and
    the scheduler's LR is in them."""
    args = ("--optim", "daemon-sgd", "--form", form)
    _, (r0, r1, ref) = _train(fsdpd, 2, *args, reference=args)
    _assert_matches([r0, r1], ref, 0.0)
    for records in (r0, r1):
        last = next(r for r in records if r.get("final"))
        groups = last["groups"]
        assert len(groups) == (1 if form == "params" else 2)
        names = [n for g in groups for n in g["names"]]
        assert sorted(names) == sorted(_final(ref))  # every parameter, under its name
        assert all(len(g["names"]) == len(g["numel"]) for g in groups)
        assert all(g["lr"] == 0.5 ** (STEPS // 2) for g in groups)  # StepLR's
        assert last["optimizer_steps"] == STEPS
    # The two ranks' parts of the parameters make each of them whole.
    numel = [sum(g["numel"]) for records in (r0, r1)
             for g in next(r for r in records if r.get("final"))["groups"]]
    assert sum(numel) == sum(len(v) for v in _final(ref).values())


def test_adamw_over_model_parameters_is_adamw_over_the_model(fsdpd):
    """fsdpd.optim.AdamW(model.parameters(), lr=...) and torch's groups of tensors step as
    the older AdamW(model, groups=[names]) does, bit for bit (the daemon's arithmetic on
    both sides; torch.optim.AdamW's is another engineer's comparison)."""
    runs = {}
    for form in ("groups", "named"):
        _, (r0, r1) = _train(fsdpd, 2, "--optim", "daemon-adamw", "--form", form,
                             reference=None)
        runs[form] = (r0, r1)
        assert all(next(r for r in rs if r.get("final"))["optimizer_steps"] == STEPS
                   for rs in (r0, r1))
    for a, b in zip(runs["groups"], runs["named"]):
        assert _losses(a) == _losses(b) and _final(a) == _final(b)


def test_the_daemons_optimizer_refuses_tensors_of_no_sharded_model(fsdpd, tmp_path):
    """A tensor that is no parameter of a shard_model is refused at once, saying what to
    use instead."""
    import subprocess
    script = tmp_path / "refuse.py"
    script.write_text("import torch, fsdpd.optim\n"
                      "try:\n"
                      "    fsdpd.optim.AdamW([torch.zeros(3, requires_grad=True)], lr=1e-3)\n"
                      "except TypeError as e:\n"
                      "    print(e)\n")
    env = {**os.environ, "PYTHONPATH": str(SOURCE_DIR / "python"), "FSDPD_LIB": str(LIB)}
    out = subprocess.run([PYTHON, str(script)], env=env, capture_output=True, text=True,
                         timeout=CHILD_TIMEOUT)
    assert "made by fsdpd.torch.shard_model" in out.stdout, out.stderr
    assert "use a torch.optim optimizer for other tensors" in out.stdout


@pytest.mark.parametrize("optim", ["sgd", "daemon-sgd"])
def test_gradient_accumulation_steps_once_per_step(fsdpd, optim):
    """Four (loss / 4).backward() and one step(), no no_sync: torch's accumulation exactly,
    with a torch optimizer and with the daemon's (which steps once per step(): its step
    count is the steps'). Before, the daemon stepped in each backward, four times a step.
    The daemon's step reduces nothing: each unit's reduces are the backwards'."""
    args = ("--optim", optim, "--micro", "4")
    d, (r0, r1, ref) = _train(fsdpd, 2, *args, reference=args)
    _assert_matches([r0, r1], ref, 0.0)
    if optim != "sgd":
        assert next(r for r in r0 if r.get("final"))["optimizer_steps"] == STEPS
        unit = json.loads(d.fsdpctl("--json", "unit", "blocks.0").stdout)
        assert (unit["reduces"], unit["optimizer_steps"]) == (4 * STEPS, STEPS)


def test_accumulation_under_no_sync_and_without_are_one(fsdpd):
    """The daemon's AdamW: four micro-batches, the first three under model.no_sync() (the
    explicit form), end where the same four without it end, bit for bit."""
    args = ("--optim", "daemon-adamw", "--form", "groups", "--micro", "4")
    _, plain = _train(fsdpd, 2, *args, reference=None)
    _, explicit = _train(fsdpd, 2, *args, "--no-sync", reference=None)
    for a, b in zip(plain, explicit):
        assert _losses(a) == _losses(b) and _final(a) == _final(b)
        assert next(r for r in a if r.get("final"))["optimizer_steps"] == STEPS


def test_step_in_backward_refuses_a_second_backward(fsdpd):
    """step_in_backward=True steps in the backward: a second backward before step() would
    step again, and is refused at once, saying how to accumulate."""
    _, ranks = _train(fsdpd, 2, "--optim", "daemon-sgd", "--micro", "2", "--step-in-backward",
                      reference=None, expect_rc=3)
    for records in ranks:
        (error,) = [r["error"] for r in records if "error" in r]
        assert "a second backward before optimizer.step()" in error, error
        assert "model.no_sync()" in error


@pytest.mark.parametrize("how", ["default", "no-early-stop"])
def test_activation_checkpointing_trains_like_without(fsdpd, how):
    """Each block under torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False),
    bf16 copies from the daemon's pool and one unit in flight, buffers fenced once given
    back (FSDP_FENCES=1): the same losses and parameters as without checkpointing, bit for
    bit. The recomputed forward's hooks keep the unit's copy for its backward; before, they
    gave it back (a segfault with fences, else another unit's weights read: with torch's
    early stop off, step 3's loss differed)."""
    base = ("--param-dtype", "bf16", "--max-inflight", "1")
    env = {"FSDP_FENCES": "1"}
    _, plain = _train(fsdpd, 2, *base, reference=None, extra_env=env)
    _, ckpt = _train(fsdpd, 2, *base, "--checkpoint", how, reference=None, extra_env=env)
    for a, b in zip(plain, ckpt):
        assert _losses(a) == _losses(b)
        assert _final(a) == _final(b)
    assert _losses(plain[0])[STEPS] != _losses(plain[0])[1]


def test_no_shard_trains_like_one_process(fsdpd):
    """NO_SHARD (DDP's layout: every rank computes with the whole parameters and all-reduces
    its gradients): torch's SGD over model.parameters() on 2 ranks trains exactly like one
    process; each host's replica is stepped once (local rank 0's parameters are whole, the
    other's empty)."""
    args = ("--strategy", "NO_SHARD", "--micro", "2")
    d, (r0, r1, ref) = _train(fsdpd, 2, *args, reference=("--micro", "2"))
    _assert_matches([r0, r1], ref, 0.0)
    numel = [sum(g["numel"]) for records in (r0, r1)
             for g in next(r for r in records if r.get("final"))["groups"]]
    assert numel == [sum(len(v) for v in _final(ref).values()), 0]
    unit = json.loads(d.fsdpctl("--json", "unit", "blocks.0").stdout)
    assert unit["strategy"] == "NO_SHARD", unit
