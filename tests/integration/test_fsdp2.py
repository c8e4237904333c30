"""fsdpd against PyTorch's FSDP2 (issue 30 item 2). The same model (the small transformer of
examples/transformer.py, as test_shard_model trains it), the same initial weights and the
same batches train for STEPS steps under fsdpd (L trainer processes through a real daemon,
`fsdpd.torch.shard_model`) and under FSDP2 (`fully_shard` per block and at the root, gloo,
L processes), each with torch.optim.AdamW (the daemon's optimizer is compared with
torch.optim in test_shard_model). Compared: each rank's loss, the reduced gradients (each
side's shards put together into whole tensors by original parameter name) and the
parameters after the optimizer's step, at every step where both sides sum in the same order.

Tolerances. L is 2 (4 for HYBRID_SHARD), so that both sides sum in the same order: a sum of
two is the same either way round, HYBRID_SHARD's is (g0 + g1) + (g2 + g3) on both (each
host's, or each shard group's, then among the replicas), and 1/L is a power of two, so
FSDP2's division by L (gloo has no AVG) is fsdpd's multiplication by 1/L exactly. Each rank
computes its forward and backward on the same values with the same kernels, and AdamW
(foreach=False on both) is elementwise. Where this holds the comparison is bit for bit:
FULL_SHARD, SHARD_GRAD_OP, bf16 parameters, HYBRID_SHARD, and accumulation against FSDP2
reducing every micro-batch. Where the order differs (accumulation under
set_requires_gradient_sync(False); the clipping norm, though equal norms clip to equal bits)
the bound is what that order explains, stated at each comparison, on the first step: from the second on, the first step's rounding
differences have gone through the model, which no order argument bounds.

FSDP2 runs every case on the CPU with gloo (MixedPrecisionPolicy with bf16, the 2-D mesh),
so FSDP1 stands in for none.

torch runs in the workers (fsdp2_worker.py) and in this process, to read their tensors.
"""

import os
import subprocess
import sys

import pytest

from fsdpd_harness import BUILD_DIR, SOURCE_DIR, built_with, fsdpd  # noqa: F401
from worker_records import finish, losses

PYTHON = sys.executable  # .venv/bin/python, with torch (scripts/venv.sh)
LIB = BUILD_DIR / "lib" / "libfsdp.so"
WORKER = SOURCE_DIR / "tests" / "integration" / "fsdp2_worker.py"
DAEMON_ARGS = ("--set", "memory.job_limit=64MiB")
CHILD_TIMEOUT = 120
STEPS = 3


pytestmark = pytest.mark.skipif(built_with("FSDP_SANITIZE"),
                                reason="ASan/UBSan build: libfsdp.so would need libasan "
                                       "preloaded into the interpreter")


os.environ.setdefault("FSDP_SOURCE_DIR", str(SOURCE_DIR))  # fsdp2_worker's imports need it
U = 2.0 ** -24  # fp32's unit roundoff: a rounding errs by at most U times the result


def _start(mode, out, rank, world, per_host, args, daemon=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FSDPD_", "TORCHELASTIC_", "MASTER_")) and
           k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(SOURCE_DIR / "python"), FSDPD_LIB=str(LIB),
               FSDP_SOURCE_DIR=str(SOURCE_DIR), OMP_NUM_THREADS="1", RANK=str(rank),
               WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_host),
               LOCAL_WORLD_SIZE=str(per_host), GLOO_SOCKET_IFNAME="lo",
               # The parameters are views at other offsets on each side (of fsdpd's flat
               # copy, of FSDP2's all-gather output): MKL's strict reproducible mode makes
               # its sgemm's sums independent of the operands' alignment, on any x86 CPU.
               MKL_CBWR="AUTO,STRICT")
    if daemon is not None:
        env.update(FSDPD_SOCKET=str(daemon.socket_path), FSDPD_JOB="fsdp2-compare")
        if world == per_host and mode == "fsdpd":  # one host: the daemon's ranks alone
            del env["RANK"], env["WORLD_SIZE"]
    return subprocess.Popen([PYTHON, str(WORKER), mode, "--out", str(out), *map(str, args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Run:
    """One side's results: each rank's records, and {step: {"grads"|"params": {name: whole
    flat fp32 tensor}}} put together from the ranks' parts."""

    def __init__(self, records, out, world, steps):
        import torch
        self.records = records
        self.steps = {}
        for step in range(1, steps + 1):
            parts = {"grads": {}, "params": {}}
            for rank in range(world):
                path = out / f"step-{step}-rank-{rank}.pt"
                if path.exists():
                    for kind, named in torch.load(path).items():
                        for name, part in named.items():
                            parts[kind].setdefault(name, []).append(part)
            self.steps[step] = parts

    def losses(self, step):
        return [losses(r)[step] for r in self.records]

    def norm(self, step):
        return next(r["norm"] for r in self.records[0] if r.get("step") == step)

    def whole(self, step, kind, numel):
        """{name: tensor}; elements given by several ranks (replicas) agree bit for bit."""
        import torch
        out = {}
        for name, parts in self.steps[step][kind].items():
            t = torch.full((numel[name],), float("nan"))
            for offset, part in parts:
                seg = t[offset:offset + part.numel()]
                known = ~seg.isnan()
                assert torch.equal(seg[known], part.float()[known]), (name, "replicas differ")
                seg.copy_(part.float())
            assert not t.isnan().any(), (name, "not every element was given")
            out[name] = t
        return out


def _train(fsdpd, tmp_path, args, others, world=2, hosts=1, steps=STEPS, ours="fsdpd"):
    """fsdpd's run with args and FSDP2's with args + each of others, all at once; returns
    [fsdpd's Run, FSDP2's Run for each of others]. ours: "fsdpd" (shard_model) or
    "fully_shard" (FSDP2's script with fsdpd.torch's fully_shard)."""
    per_host = world // hosts
    if hosts == 1:
        daemons = [fsdpd(*DAEMON_ARGS)]
    else:
        from test_peers import Cluster, wait_all_joined
        c = Cluster(fsdpd, hosts, lws=per_host, extra=list(DAEMON_ARGS))
        wait_all_joined(c)
        daemons = c.daemons
    sides = [(ours, [], steps)] + [("fsdp2", extra, n) for extra, n in others]
    outs, procs = [], []
    for k, (mode, extra, n) in enumerate(sides):
        out = tmp_path / f"{mode}-{k}"
        out.mkdir()
        outs.append(out)
        procs += [_start(mode, out, g, world, per_host, ["--steps", n, *args, *extra],
                         daemons[g // per_host] if mode != "fsdp2" else None)
                  for g in range(world)]
    records = finish(procs, CHILD_TIMEOUT)
    runs = [Run(records[k * world:(k + 1) * world], out, world, n)
            for k, (out, (_, _, n)) in enumerate(zip(outs, sides))]
    runs[0].daemons = daemons
    return runs



def _sizes(run):
    """Each parameter's numel: FSDP2's rank 0 saves them whole."""
    return {n: parts[0][1].numel() for n, parts in run.steps[1]["params"].items()}


def _assert_bit_for_bit(ours, theirs, steps=STEPS):
    """Every rank's loss, every reduced gradient and every parameter after the step, equal
    bit for bit at every step; returns the largest difference seen (0)."""
    import torch
    numel = _sizes(theirs)
    assert sorted(numel) == sorted(ours.steps[1]["params"])
    for step in range(1, steps + 1):
        assert ours.losses(step) == theirs.losses(step), step
        assert ours.norm(step) == theirs.norm(step), step
        for kind in ("grads", "params"):
            a, b = ours.whole(step, kind, numel), theirs.whole(step, kind, numel)
            for name in numel:
                assert torch.equal(a[name], b[name]), \
                    (step, kind, name, float((a[name] - b[name]).abs().max()))
    # Training moved the parameters: the loss changed by far more than any rounding.
    first, last = sum(ours.losses(1)), sum(ours.losses(steps))
    assert abs(last - first) > 1e-3 * abs(first)


def _adamw_step_bound(g, h, p):
    """How far AdamW's first step (torch.optim.AdamW, ADAMW of the worker) can take a
    parameter apart given gradients g and h: its update is lr * g / (|g| + eps) (m / sqrt(v)
    after the bias corrections), whose derivative eps / (|g| + eps)^2 is largest where the
    gradient is smallest (1 / eps at 0, where a sign flips), so the updates differ by at
    most lr |g - h| eps / (m + eps)^2, m the smaller magnitude (0 across a sign); plus each
    side's own roundings of the update (a few U of lr) and of the new parameter (an ulp)."""
    import torch
    from fsdp2_worker import ADAMW
    lr, eps = ADAMW["lr"], 1e-8
    m = torch.where(g.sign() == h.sign(), torch.minimum(g.abs(), h.abs()), torch.zeros_like(g))
    ulp = torch.where(p == 0, torch.zeros_like(p), 2.0 ** (torch.frexp(p).exponent - 24).float())
    return lr * (g - h).abs() * eps / (m + eps) ** 2 + 16 * U * lr + 2 * ulp


@pytest.mark.parametrize("strategy,dtype", [("FULL_SHARD", "fp32"), ("SHARD_GRAD_OP", "fp32"),
                                            ("FULL_SHARD", "bf16")])
def test_fsdpd_trains_bit_for_bit_like_fsdp2(fsdpd, tmp_path, strategy, dtype):
    """L = 2 trainers: FULL_SHARD against fully_shard's default, SHARD_GRAD_OP against
    reshard_after_forward=False; bf16 parameters (fsdpd's param_dtype=bfloat16,
    reduce_dtype=float32) against MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32): both cast the fp32 shards to bf16 rounding to nearest even,
    compute in bf16, cast the bf16 gradients to fp32 and sum those. Bit for bit."""
    args = ["--strategy", strategy, *(["--bf16"] if dtype == "bf16" else [])]
    ours, theirs = _train(fsdpd, tmp_path, args, [([], STEPS)])
    _assert_bit_for_bit(ours, theirs)


@pytest.mark.parametrize("strategy,dtype", [("FULL_SHARD", "fp32"), ("SHARD_GRAD_OP", "fp32"),
                                            ("FULL_SHARD", "bf16")])
def test_an_fsdp2_script_trains_on_fsdpd_by_changing_its_import(fsdpd, tmp_path, strategy,
                                                                 dtype):
    """FSDP2's script (fully_shard per block and at the root, MixedPrecisionPolicy, torch's
    AdamW over model.parameters(), DTensor gradients read with full_tensor()) run twice at
    L = 2: once under FSDP2, once with fully_shard and MixedPrecisionPolicy imported from
    fsdpd.torch. Each parameter's pieces are FSDP2's, the sums the same (two ranks, in rank
    order, then 1/2): bit for bit."""
    args = ["--strategy", strategy, *(["--bf16"] if dtype == "bf16" else [])]
    ours, theirs = _train(fsdpd, tmp_path, args, [([], STEPS)], ours="fully_shard")
    _assert_bit_for_bit(ours, theirs)
    # The daemon's units did it: one per fully_shard call, in FSDP2's layout.
    import json
    units = json.loads(ours.daemons[0].fsdpctl("--json", "units").stdout)["units"]
    assert sorted(u["unit"] for u in units) == \
        ["fully_shard.0.Block", "fully_shard.1.Block", "fully_shard.2.TinyGPT"]
    assert {(u["layout"], u["reduces"]) for u in units} == {("LAYOUT_PER_PARAM", STEPS)}


@pytest.mark.parametrize("case", ["accumulate", "clip"])
def test_an_fsdp2_script_accumulates_and_clips_on_fsdpd(fsdpd, tmp_path, case):
    """The same script with two micro-batches a step (set_requires_gradient_sync(False) on
    the first), against FSDP2 reducing each micro-batch and adding the reduced shards, as
    fsdpd does; and with torch.nn.utils.clip_grad_norm_ over the DTensor parameters, which
    sums the same per-parameter pieces' squares on both sides. Bit for bit, the norms
    too."""
    args = ["--accumulate"] if case == "accumulate" else ["--clip"]
    theirs_args = ["--sync-every"] if case == "accumulate" else []
    ours, theirs = _train(fsdpd, tmp_path, args, [(theirs_args, STEPS)], ours="fully_shard")
    _assert_bit_for_bit(ours, theirs)


def test_fsdp2s_module_methods_as_fsdp2_runs_them(fsdpd, tmp_path):
    """The same script using FSDP2's module methods: reshard_after_forward as an int (1 on
    one block, keeping the copy for the backward; the world size on the other, giving it
    back), forward and backward prefetch lists, the first block gathered before each
    forward with unshard(async_op=True) and wait(), the last given back with reshard()
    after each step, set_is_last_backward(True). Bit for bit; the prefetched gathers were
    the daemon's (every block's copy was asked for ahead of its forward)."""
    ours, theirs = _train(fsdpd, tmp_path, ["--explicit"], [([], STEPS)], ours="fully_shard")
    _assert_bit_for_bit(ours, theirs)


def test_frozen_unused_and_checkpointed_blocks_as_fsdp2_trains_them(fsdpd, tmp_path):
    """FSDP2's script on a model whose blocks each hold a frozen parameter (in the block's
    own unit) and a layer never called, each block's call under activation checkpointing
    (torch.utils.checkpoint, use_reentrant=False: the block's forward runs again inside the
    backward, its hooks too). On both sides the frozen and unused parameters get no .grad,
    the others' gradients and every parameter after AdamW are equal bit for bit, and so are
    the losses."""
    import torch
    args = ["--odd-parameters", "--checkpoint"]
    ours, theirs = _train(fsdpd, tmp_path, args, [([], STEPS)], ours="fully_shard")
    numel = _sizes(theirs)
    no_grad = {n for n in numel if "ln1.weight" in n or "unused" in n}
    assert len(no_grad) == 3 * len([n for n in numel if n.endswith("ln1.weight")])
    for step in range(1, STEPS + 1):
        assert ours.losses(step) == theirs.losses(step), step
        for run in (ours, theirs):
            assert set(run.steps[step]["grads"]) == set(numel) - no_grad
        grads = {n: k for n, k in numel.items() if n not in no_grad}
        for kind, sizes in (("grads", grads), ("params", numel)):
            a = ours.whole(step, kind, sizes) if kind == "params" else _grads(ours, step, sizes)
            b = theirs.whole(step, kind, sizes) if kind == "params" else \
                _grads(theirs, step, sizes)
            for name in sizes:
                assert torch.equal(a[name], b[name]), (step, kind, name)


def test_a_model_built_on_the_meta_device_as_fsdp2s_docs_write_it(fsdpd, tmp_path):
    """The model built on the meta device, fully_shard per block and at the root, then
    to_empty(device="cpu") and each parameter written from its name into its DTensor
    shards: fsdpd's masters hold the values (to_empty keeps the parameters over the daemon's
    pieces), and the training is FSDP2's bit for bit."""
    ours, theirs = _train(fsdpd, tmp_path, ["--meta"], [([], STEPS)], ours="fully_shard")
    _assert_bit_for_bit(ours, theirs)


def _grads(run, step, sizes):
    """The whole gradients of the parameters that have one."""
    saved = run.steps[step]["grads"]
    return run.whole(step, "grads", {n: k for n, k in sizes.items() if n in saved})


@pytest.mark.parametrize("ours", ["fsdpd", "fully_shard"])
def test_hybrid_shard_on_two_daemons_trains_bit_for_bit_like_a_2d_mesh(fsdpd, tmp_path, ours):
    """HYBRID_SHARD on 2 daemons as 2 hosts x 2 trainers against FSDP2 on a 2-D DeviceMesh
    (replicate 2, shard 2) of 4 gloo processes: fsdpd sums each host's two in rank order and
    then the two hosts' sums, FSDP2 reduce-scatters in each shard group and all-reduces among
    the replicas: (g0 + g1) + (g2 + g3) on both, and 1/4 is exact. Bit for bit; the replicas'
    shards (ranks 0 and 2, 1 and 3) are equal too. Both through shard_model and through
    FSDP2's own script with fully_shard from fsdpd.torch on the same 2-D mesh."""
    ours, theirs = _train(fsdpd, tmp_path, ["--strategy", "HYBRID_SHARD"], [([], STEPS)],
                          world=4, hosts=2, ours=ours)
    _assert_bit_for_bit(ours, theirs)


def test_hybrid_accumulation_without_the_replicas_all_reduce_as_fsdp2s(fsdpd, tmp_path):
    """HSDP's accumulation as FSDP2 writes it: two micro-batches a step, the first under
    set_requires_all_reduce(False) (reduce-scatter in the shard group, no all-reduce among
    the replicas), the second all-reducing the sum of both, on 2 daemons x 2 trainers against
    FSDP2 on the 2-D mesh. Bit for bit."""
    args = ["--strategy", "HYBRID_SHARD", "--accumulate", "--defer-all-reduce"]
    ours, theirs = _train(fsdpd, tmp_path, args, [([], STEPS)], world=4, hosts=2,
                          ours="fully_shard")
    _assert_bit_for_bit(ours, theirs)


def test_accumulation_against_fsdp2_with_and_without_gradient_sync(fsdpd, tmp_path):
    """Each step two micro-batches, the first under fsdpd's no_sync(). fsdpd reduces each
    micro-batch and adds the reduced shards: (a1 + b1) / 2 + (a2 + b2) / 2 for ranks a, b.
    FSDP2 doing the same (set_requires_gradient_sync left True) is bit for bit at every step.
    FSDP2 with set_requires_gradient_sync(False) on the first keeps each rank's unsharded
    gradient and reduces once, (a1 + a2) / 2 + (b1 + b2) / 2: three additions in another
    order. Each side's three roundings err by at most U times a partial sum; with the
    partial sums at most twice the tensor's largest gradient (the micro-batches' gradients
    are of one size), |difference| <= 2 * 3 * U * 2 max|g| = 12 U max|g| per tensor. Its
    parameters after the step: within _adamw_step_bound of those gradients. Its losses are
    computed before any reduce: bit for bit. On the first step only (see the module's
    docstring)."""
    import torch
    ours, same, unsynced = _train(fsdpd, tmp_path, ["--accumulate"],
                                  [(["--sync-every"], STEPS), ([], 1)])
    _assert_bit_for_bit(ours, same)
    numel = _sizes(unsynced)
    assert ours.losses(1) == unsynced.losses(1)
    g, h = ours.whole(1, "grads", numel), unsynced.whole(1, "grads", numel)
    p, q = ours.whole(1, "params", numel), unsynced.whole(1, "params", numel)
    worst_g = worst_p = 0.0
    for name in numel:
        d = (g[name] - h[name]).abs()
        bound = 12 * U * float(g[name].abs().max())
        assert float(d.max()) <= bound, (name, float(d.max()), bound)
        worst_g = max(worst_g, float(d.max()) / (U * float(g[name].abs().max())))
        d = (p[name] - q[name]).abs()
        bound = _adamw_step_bound(g[name], h[name], p[name])
        assert bool((d <= bound).all()), (name, float((d - bound).max()))
        worst_p = max(worst_p, float((d / bound).max()))
    print(f"accumulation: gradients within {worst_g:.2f} U max|g|, parameters within "
          f"{worst_p:.3f} of the AdamW bound")


def test_clipping_against_fsdp2s_clip_grad_norm(fsdpd, tmp_path):
    """fsdpd's model.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on FSDP2's
    DTensor gradients, to a norm (MAX_NORM) below the gradient's, then AdamW. The gradients
    before clipping are summed in the same order: bit for bit, and so are the losses. The
    norms need not be: fsdpd sums the squares of its flat shards in double, torch those of
    FSDP2's per-parameter shards in fp32 (a blocked sum of n terms errs by at most
    ceil(log2 n) U relative, the squares, the norms of norms and the root a few U more):
    |difference| <= (ceil(log2 n) + 6) U norm. From its fp32 norm each side makes torch's
    coefficient with torch's arithmetic (clamp(max_norm / (norm + 1e-6), max=1) on an fp32
    tensor: fsdpd follows torch 2.13's clip_grad_norm_ rounding for rounding) and multiplies
    it into the gradients in fp32, so each side's clipped gradients are known exactly here.
    Equal norms (as measured on the AMD EPYC test VM) then clip to equal bits, and the
    parameters after the step are equal bit for bit; norms apart, the parameters lie within
    _adamw_step_bound of the two clipped gradients. On the first step only (see the module's
    docstring)."""
    import math

    import torch
    from fsdp2_worker import MAX_NORM
    ours, theirs = _train(fsdpd, tmp_path, ["--clip"], [([], 1)], steps=1)
    numel = _sizes(theirs)
    assert ours.losses(1) == theirs.losses(1)
    g, h = ours.whole(1, "grads", numel), theirs.whole(1, "grads", numel)
    assert all(torch.equal(g[n], h[n]) for n in numel)
    n = sum(numel.values())
    a, b = ours.norm(1), theirs.norm(1)
    assert a > MAX_NORM  # it clips
    norm_bound = (math.ceil(math.log2(n)) + 6) * U * a
    assert abs(a - b) <= norm_bound, (a, b, norm_bound)

    def coef(norm):  # torch.nn.utils.clip_grads_with_norm_'s, from an fp32 norm
        return torch.clamp(MAX_NORM / (torch.tensor(norm, dtype=torch.float32) + 1e-6),
                           max=1.0)

    ca, cb = coef(a), coef(b)
    p, q = ours.whole(1, "params", numel), theirs.whole(1, "params", numel)
    worst = 0.0
    for name in numel:
        if a == b:  # the same clipped gradients, the same AdamW
            assert torch.equal(p[name], q[name]), \
                (name, float((p[name] - q[name]).abs().max()))
            continue
        x, y = g[name] * ca, g[name] * cb  # each side's clipped gradient, exactly
        d = (p[name] - q[name]).abs()
        bound = _adamw_step_bound(x, y, p[name])
        assert bool((d <= bound).all()), (name, float((d - bound).max()))
        worst = max(worst, float((d / bound).max()))
    print(f"clipping: norms {a!r} and {b!r} ({abs(a - b) / (U * a):.1f} U apart, bound "
          f"{norm_bound / (U * a):.0f} U), parameters "
          + ("bit for bit" if a == b else f"within {worst:.3f} of the AdamW bound"))
