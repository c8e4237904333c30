"""The daemon's optimizer (Trainer.SetOptimizer) through a real fsdpd: what it refuses (every
field torch checks, parameters it does not know, changes of kind or groups), what a
ReduceScatter with step_optimizer does to the masters and the state (values chosen so that
every operation is exact), and with step_only too (the step alone), where the state lies in
the job's memory, and that it outlives the trainers. The training equivalence with torch.optim is test_shard_model's."""

import array
import json

import grpc
import pytest

from fsdpd_harness import common_pb2, fsdpd, trainer_pb2  # noqa: F401
from test_unshard import FP32, Rank, on_all

SHAPES = ((4, 3), (5,))  # "p0": 12 elements, "p1": 5; 17 padded to 18 over 2 ranks


def set_optimizer(rank, kind, *groups):
    return rank.d.call("/fsdp.v1.Trainer/SetOptimizer", trainer_pb2.SetOptimizerRequest(
        session_id=rank.session, kind=kind, groups=list(groups)),
        trainer_pb2.SetOptimizerReply)


def group(params=(), **hyper):
    return trainer_pb2.OptimizerGroup(params=list(params), **hyper)


ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def two_ranks(d):
    ranks = [Rank(d, r, 2) for r in range(2)]
    layouts = [r.register(shapes=SHAPES, param_dtype=FP32, requires_grad=True) for r in ranks]
    return ranks, layouts


def refused(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("kind,hyper,text", [
    (trainer_pb2.OPTIMIZER_KIND_UNSPECIFIED, ADAMW, "kind 0 is not ADAMW, ADAM or SGD"),
    (trainer_pb2.ADAMW, dict(ADAMW, lr=-0.1), "groups[0].lr = -0.1 is outside [0, inf)"),
    (trainer_pb2.ADAMW, dict(ADAMW, beta1=1.0), "groups[0].beta1 = 1 is outside [0, 1)"),
    (trainer_pb2.ADAM, dict(ADAMW, beta2=-0.5), "groups[0].beta2 = -0.5 is outside [0, 1)"),
    (trainer_pb2.ADAMW, dict(ADAMW, eps=float("nan")), "groups[0].eps = nan"),
    (trainer_pb2.SGD, dict(lr=0.1, momentum=-1), "groups[0].momentum = -1 is outside"),
    (trainer_pb2.SGD, dict(lr=0.1, nesterov=True),
     "groups[0].nesterov needs momentum > 0 and dampening 0 (momentum 0, dampening 0)"),
])
def test_values_torch_refuses_are_refused_naming_the_field(fsdpd, kind, hyper, text):
    d = fsdpd()
    ranks, _ = two_ranks(d)
    code, details = refused(lambda: set_optimizer(ranks[0], kind, group(**hyper)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and text in details, details


def test_a_negative_max_grad_norm_is_refused(fsdpd):
    d = fsdpd()
    ranks, _ = two_ranks(d)
    code, details = refused(lambda: ranks[0].d.call(
        "/fsdp.v1.Trainer/SetOptimizer", trainer_pb2.SetOptimizerRequest(
            session_id=ranks[0].session, kind=trainer_pb2.ADAMW, groups=[group(**ADAMW)],
            max_grad_norm=-1.0), trainer_pb2.SetOptimizerReply))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_grad_norm = -1 is outside [0, inf)" in details, details


def test_groups_name_registered_trainable_parameters_once(fsdpd):
    d = fsdpd()
    ranks, _ = two_ranks(d)
    cases = [
        ([group(["p0", "nope"], **ADAMW)],
         "groups[0].params[1] 'nope' is no parameter of a unit registered in job 'j'"),
        ([group(["p0"], **ADAMW), group(["p1", "p0"], **ADAMW)],
         "groups[1].params[1] 'p0' is groups[0].params[0] already"),
        ([group(**ADAMW), group(**ADAMW)],
         "groups[0] and groups[1] both name no parameter"),
        ([], "groups is empty"),
    ]
    for groups, text in cases:
        code, details = refused(lambda: set_optimizer(ranks[0], trainer_pb2.ADAMW, *groups))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and text in details, details
    # Nothing was set: a reduce that asks for a step hears there is no optimizer.
    assert on_all(ranks, "Unshard", step=1, backward=True) == [None, None]
    errors = on_all(ranks, "ReduceScatter", step=1, step_optimizer=True)
    assert all(e.code() == grpc.StatusCode.FAILED_PRECONDITION for e in errors)
    assert "step_optimizer, but job 'j' has no optimizer in the daemon" in errors[0].details()


def test_hyperparameters_change_but_kind_and_groups_stay(fsdpd):
    d = fsdpd()
    ranks, _ = two_ranks(d)
    set_optimizer(ranks[0], trainer_pb2.ADAMW, group(["p1"], **dict(ADAMW, weight_decay=0)),
                  group(**ADAMW))
    set_optimizer(ranks[1], trainer_pb2.ADAMW, group(["p1"], **dict(ADAMW, lr=5e-4)),
                  group(**ADAMW))  # an LR schedule's next step
    code, details = refused(lambda: set_optimizer(ranks[0], trainer_pb2.SGD, group(lr=0.1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "kind SGD, but the job's optimizer is ADAMW" in details, details
    code, details = refused(lambda: set_optimizer(ranks[0], trainer_pb2.ADAMW,
                                                  group(["p0"], **ADAMW), group(**ADAMW)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "groups[0] names other parameters than the job's optimizer gave it" in details


def with_masters(d):
    """two_ranks' ranks and layouts, their master shards written with small integers (every
    product and sum of the tests' steps on them is exact): and those values."""
    ranks, layouts = two_ranks(d)
    masters = [float(i % 7) for i in range(layouts[0].padded_numel)]
    for r, x in zip(ranks, layouts):
        r.write_master_shard(x, masters)
    return ranks, layouts, masters


def floats(memory, offset, n):
    return list(array.array("f", bytes(memory[offset:offset + 4 * n])))


def test_a_step_updates_masters_and_state_and_outlives_the_trainers(fsdpd):
    """SGD with momentum 0.5, lr 0.25, on values where every product and sum is exact: after
    two steps with gradient g, the momentum buffer is g then 0.5 g + g, and each master went
    down by 0.25 times it. p1's group has lr 0. The unit's step count and state are in the
    job's memory, where trainers that attach again find them."""
    d = fsdpd()
    ranks, layouts, masters = with_masters(d)
    lay = layouts[0]
    n = lay.padded_numel
    reply = set_optimizer(ranks[0], trainer_pb2.SGD, group(["p1"], lr=0.0, momentum=0.5),
                          group(lr=0.25, momentum=0.5))
    (state,) = reply.units
    assert (state.unit, state.arrays) == ("u", 1)
    g = [float((i % 5) - 2) for i in range(n)]  # the mean of the two ranks' equal gradients
    for step in (1, 2):
        assert on_all(ranks, "Unshard", step=step, backward=True) == [None, None]
        for r in ranks:
            r.write_full_grad(g, FP32)
        assert on_all(ranks, "ReduceScatter", step=step, step_optimizer=True) == [None, None]
    # p1 (elements 12 to 16) keeps its values at lr 0, but its momentum moves, as torch's
    # does; the padding (17) is never stepped.
    p0, numel = 12, 17
    buf = [1.5 * x if i < numel else 0.0 for i, x in enumerate(g)]
    want = [m - 0.25 * x - 0.25 * y if i < p0 else m
            for i, (m, x, y) in enumerate(zip(masters, g, buf))]
    assert floats(ranks[0].memory, lay.master_offset, n) == want
    assert floats(ranks[0].memory, state.arrays_offset, n) == buf
    steps = array.array("Q", bytes(ranks[0].memory[state.steps_offset:state.steps_offset + 8]))
    assert list(steps) == [2]
    unit = json.loads(d.fsdpctl("--json", "unit", "u").stdout)
    assert unit["optimizer_steps"] == 2
    (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
    assert job["optimizer"] == "SGD" and job["optimizer_bytes"] >= 4 * n
    # The trainers go; new ones find the state as it was, and step 2 is not taken again.
    for r in ranks:
        d.call("/fsdp.v1.Trainer/Detach", trainer_pb2.DetachRequest(session_id=r.session),
               trainer_pb2.DetachReply)
    again = [Rank(d, r, 2) for r in range(2)]
    for r in again:
        r.register(shapes=SHAPES, param_dtype=FP32, requires_grad=True)
    reply = set_optimizer(again[1], trainer_pb2.SGD, group(["p1"], lr=0.0, momentum=0.5),
                          group(lr=0.25, momentum=0.5))
    assert reply.units[0].arrays_offset == state.arrays_offset
    assert on_all(again, "Unshard", step=2, backward=True) == [None, None]
    for r in again:
        r.write_full_grad(g, FP32)
    assert on_all(again, "ReduceScatter", step=2, step_optimizer=True) == [None, None]
    assert floats(again[0].memory, lay.master_offset, n) == want
    assert json.loads(d.fsdpctl("--json", "unit", "u").stdout)["optimizer_steps"] == 2


def test_a_step_alone_steps_with_what_the_reduces_wrote(fsdpd):
    """step_only, as torch's opt.step() after the backwards: no gradient is submitted and
    nothing is reduced; the masters step with what the gradient shards hold. SGD, lr 0.25,
    on exact values: step 1's reduce writes g, step 2's two reduces (the second
    accumulating) write 2 g; each step alone moves the masters down by 0.25 times that.
    What it refuses: other flags with it, a rank holding a gradient buffer; a second step
    alone of the same step is not taken."""
    d = fsdpd()
    ranks, layouts, masters = with_masters(d)
    lay = layouts[0]
    n = lay.padded_numel
    set_optimizer(ranks[0], trainer_pb2.SGD, group(lr=0.25))
    g = [float((i % 5) - 2) for i in range(n)]
    for step, micro_batches in ((1, 1), (2, 2)):
        for k in range(micro_batches):
            assert on_all(ranks, "Unshard", step=step, backward=True) == [None, None]
            for r in ranks:
                r.write_full_grad(g, FP32)
            assert on_all(ranks, "ReduceScatter", step=step, accumulate=k > 0) == [None, None]
        if step == 2:  # refused, and nothing lost: the step alone then runs
            errors = on_all(ranks, "ReduceScatter", step=step, step_optimizer=True,
                            step_only=True, accumulate=True)
            assert all(e.code() == grpc.StatusCode.INVALID_ARGUMENT for e in errors)
            assert "step_only = true goes with step_optimizer = true and neither accumulate " \
                   "nor defer_all_reduce (here true, true, false)" in errors[0].details()
        assert on_all(ranks, "ReduceScatter", step=step, step_optimizer=True,
                      step_only=True) == [None, None]
    numel = 17
    want = [m - 0.25 * x - 0.25 * 2 * x if i < numel else m
            for i, (m, x) in enumerate(zip(masters, g))]
    assert floats(ranks[0].memory, lay.master_offset, n) == want
    unit = json.loads(d.fsdpctl("--json", "unit", "u").stdout)
    assert (unit["reduces"], unit["optimizer_steps"]) == (3, 2)
    # The same step alone again: taken already, the masters stay.
    assert on_all(ranks, "ReduceScatter", step=2, step_optimizer=True,
                  step_only=True) == [None, None]
    assert floats(ranks[0].memory, lay.master_offset, n) == want
    # A rank holding a gradient buffer reduces it first.
    assert on_all(ranks, "Unshard", step=3, backward=True) == [None, None]
    errors = on_all(ranks, "ReduceScatter", step=3, step_optimizer=True, step_only=True)
    assert all(e.code() == grpc.StatusCode.FAILED_PRECONDITION for e in errors)
    assert "step_only, but local rank 0 holds a full-gradient buffer: reduce it first" in \
        errors[0].details()
    assert on_all(ranks, "ReduceScatter", step=3) == [None, None]
    unit = json.loads(d.fsdpctl("--json", "unit", "u").stdout)
    assert (unit["reduces"], unit["optimizer_steps"]) == (4, 2)


def test_per_param_units_step_each_parameter_with_its_group(fsdpd):
    """A LAYOUT_PER_PARAM unit (FSDP2's pieces): its step finds each parameter's elements in
    each shard, stepped with the parameter's group (p1's lr 0 keeps it), padding never. SGD,
    lr 0.25, on exact values, three ranks (p0's 4 rows: 2, 2 and none)."""
    from test_unshard import host_element, in_shards, per_param_map
    d = fsdpd()
    shapes = ((4, 3), (5,))
    ranks = [Rank(d, r, 3) for r in range(3)]
    layouts = [r.register(shapes=shapes, param_dtype=FP32, requires_grad=True,
                          layout=common_pb2.LAYOUT_PER_PARAM) for r in ranks]
    lay = layouts[0]
    where = per_param_map(lay, shapes)
    values = [float(i % 7) for i in range(lay.numel)]
    for r, x in zip(ranks, layouts):
        r.write_master_shard(x, in_shards(where, values))
    set_optimizer(ranks[0], trainer_pb2.SGD, group(["p1"], lr=0.0), group(lr=0.25))
    g = [float((i % 5) - 2) for i in range(lay.numel)]
    assert on_all(ranks, "Unshard", step=1, backward=True) == [None] * 3
    for r in ranks:
        r.write_full_grad(g, FP32)
    assert on_all(ranks, "ReduceScatter", step=1, step_optimizer=True) == [None] * 3
    want = in_shards(where, [v - 0.25 * x if i < 12 else v
                             for i, (v, x) in enumerate(zip(values, g))])
    for r, x in zip(ranks, layouts):
        lo, at = x.shard * x.shard_numel, x.master_offset + host_element(x) * 4
        assert floats(r.memory, at, x.shard_numel) == want[lo:lo + x.shard_numel]
    unit = json.loads(d.fsdpctl("--json", "unit", "u").stdout)
    assert unit["layout"] == "LAYOUT_PER_PARAM" and unit["optimizer_steps"] == 1


def test_adam_with_amsgrad_steps_as_torch_does(fsdpd):
    """Adam (weight decay added to the gradient) with amsgrad, three steps whose gradients
    shrink, so that max_exp_avg_sq keeps an earlier step's value: the masters and the three
    state arrays are torch.optim.Adam's on the same parameters, bit for bit."""
    import torch
    d = fsdpd()
    ranks, layouts = two_ranks(d)
    lay = layouts[0]
    n, numel = lay.padded_numel, 17
    start = [((i * 7) % 11 - 5) * 0.125 for i in range(n)]
    for r, x in zip(ranks, layouts):
        r.write_master_shard(x, start)
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, amsgrad=True)
    (state,) = set_optimizer(ranks[0], trainer_pb2.ADAM, group(
        lr=hyper["lr"], beta1=0.9, beta2=0.99, eps=hyper["eps"],
        weight_decay=hyper["weight_decay"], amsgrad=True)).units
    assert state.arrays == 3
    # torch's parameters: the unit's two (12 and 5 elements), not the padding.
    params = [torch.nn.Parameter(torch.tensor(start[:12])), torch.nn.Parameter(
        torch.tensor(start[12:numel]))]
    opt = torch.optim.Adam(params, **hyper)
    for step, scale in ((1, 1.0), (2, 0.25), (3, 0.5)):
        g = [((i * 5) % 9 - 4) * scale for i in range(n)]
        assert on_all(ranks, "Unshard", step=step, backward=True) == [None, None]
        for r in ranks:
            r.write_full_grad(g, FP32)
        assert on_all(ranks, "ReduceScatter", step=step, step_optimizer=True) == [None, None]
        params[0].grad, params[1].grad = torch.tensor(g[:12]), torch.tensor(g[12:numel])
        opt.step()
    pad = [0.0] * (n - numel)

    def flat(key):
        return [float(x) for p in params for x in (p.detach() if key is None
                                                    else opt.state[p][key])]
    assert floats(ranks[0].memory, lay.master_offset, n) == flat(None) + start[numel:]
    stride = state.array_stride
    for k, key in enumerate(("exp_avg", "exp_avg_sq", "max_exp_avg_sq")):
        got = floats(ranks[0].memory, state.arrays_offset + k * stride, n)
        assert got == flat(key) + pad, key


TORCH_CASES = {  # torch.optim's class and hyperparameters, and the daemon's kind
    "adamw": ("AdamW", dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)),
    "adamw-amsgrad-maximize-beta1-0.3": ("AdamW", dict(lr=1e-2, betas=(0.3, 0.99), eps=1e-8,
                                                       weight_decay=0.1, amsgrad=True,
                                                       maximize=True)),
    "adam-weight-decay": ("Adam", dict(lr=1e-2, betas=(0.5, 0.999), eps=1e-6,
                                       weight_decay=0.05)),
    "sgd-momentum-dampening": ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1,
                                           weight_decay=1e-2)),
    "sgd-nesterov-maximize": ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True,
                                          weight_decay=1e-2, maximize=True)),
}


@pytest.mark.parametrize("case", TORCH_CASES)
def test_every_rule_steps_as_torch_optim_does(fsdpd, case):
    """Three steps of each rule and flag that changes the arithmetic (lerp's two forms for
    exp_avg: a weight 1 - beta1 below and above 0.5) on values whose every operation rounds,
    over two parameters of 1320 and 41 elements (the vector loops and their tails): the
    masters and the state arrays are torch.optim's single-tensor step's on the same
    parameters bit for bit, with the IEEE square root the daemon takes (ieee_sqrt.py)."""
    import torch
    from ieee_sqrt import ieee_sqrt
    name, hyper = TORCH_CASES[case]
    d = fsdpd()
    shapes = ((40, 33), (41,))
    ranks = [Rank(d, r, 2) for r in range(2)]
    layouts = [r.register(shapes=shapes, param_dtype=FP32, requires_grad=True) for r in ranks]
    lay = layouts[0]
    n, numel = lay.padded_numel, 40 * 33 + 41
    rng = torch.Generator().manual_seed(7)

    def values(scale):  # fp32 values
        return (torch.randn(n, generator=rng) * scale).tolist()
    start = values(1.0)
    for r, x in zip(ranks, layouts):
        r.write_master_shard(x, start)
    fields = {k: v for k, v in hyper.items() if k != "betas"}
    if "betas" in hyper:
        fields.update(beta1=hyper["betas"][0], beta2=hyper["betas"][1])
    kind = trainer_pb2.SGD if name == "SGD" else getattr(trainer_pb2, name.upper())
    (state,) = set_optimizer(ranks[0], kind, group(**fields)).units
    params = [torch.nn.Parameter(torch.tensor(start[:1320])),
              torch.nn.Parameter(torch.tensor(start[1320:numel]))]
    opt = getattr(torch.optim, name)(params, **hyper)
    for step, scale in ((1, 1.0), (2, 0.01), (3, 0.3)):
        g = values(scale)
        assert on_all(ranks, "Unshard", step=step, backward=True) == [None, None]
        for r in ranks:  # both write g: the reduce's mean is g exactly
            r.write_full_grad(g, FP32)
        assert on_all(ranks, "ReduceScatter", step=step, step_optimizer=True) == [None, None]
        params[0].grad, params[1].grad = torch.tensor(g[:1320]), torch.tensor(g[1320:numel])
        with ieee_sqrt():
            opt.step()
    keys = ["momentum_buffer"] if name == "SGD" else ["exp_avg", "exp_avg_sq"]
    keys += ["max_exp_avg_sq"] if hyper.get("amsgrad") else []
    assert state.arrays == len(keys)

    def flat(key):
        return [float(x) for p in params for x in (p.detach() if key is None
                                                    else opt.state[p][key])]
    got = floats(ranks[0].memory, lay.master_offset, n)[:numel]
    assert got == flat(None), [i for i, (a, b) in enumerate(zip(got, flat(None))) if a != b]
    for k, key in enumerate(keys):
        got = floats(ranks[0].memory, state.arrays_offset + k * state.array_stride, n)[:numel]
        assert got == flat(key), key
