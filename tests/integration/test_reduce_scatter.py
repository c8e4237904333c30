"""ReduceScatter (and AllReduce for NO_SHARD) through a real fsdpd: L = 1..4 ranks write
their full gradients, all submit, and every rank's fp32 gradient shard equals a reference
computed here bit for bit (sum in reduce_dtype, averaging by the gradient factors, write or
accumulate); a rank that does not submit in time, or whose process dies, makes every waiter
get ABORTED naming it, the unit and the step, and the daemon serves on."""

import array
import math
import struct
import threading
import time

import grpc
import pytest

from fsdpd_harness import common_pb2, fsdpd, poll, status_code_and_details  # noqa: F401
from test_unshard import BF16, FP16, FP32, SIZE, Rank, bf16_bits, encode, on_all

FULL_SHARD, NO_SHARD = common_pb2.FULL_SHARD, common_pb2.NO_SHARD


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def fp16(x):
    try:
        return struct.unpack("<e", struct.pack("<e", f32(x)))[0]
    except OverflowError:  # rounds past 65504: Inf, as the arithmetic gives
        return math.copysign(math.inf, x)


def rounder(dtype):
    if dtype == FP32:
        return f32
    if dtype == FP16:
        return fp16
    return lambda x: struct.unpack("<f", struct.pack("<I", bf16_bits(f32(x)) << 16))[0]


def decode(data, dtype):
    if dtype == FP32:
        return list(array.array("f", data))
    if dtype == FP16:
        return [v for (v,) in struct.iter_unpack("<e", data)]
    return [struct.unpack("<f", struct.pack("<I", h << 16))[0]
            for (h,) in struct.iter_unpack("<H", data)]


def reference(grads, reduce_dtype, pre, post, previous=None):
    """The kernel's contract (kernels/kernels.h), element by element."""
    R = rounder(reduce_dtype)
    pre32, post32 = f32(1 / pre), f32(1 / post)
    out = []
    for i in range(len(grads[0])):
        v = [R(f32(R(g[i]) * pre32)) for g in grads]
        s = v[0]
        for x in v[1:]:
            s = R(f32(s + x))
        o = R(f32(s * post32))
        out.append(f32(previous[i] + o) if previous else o)
    return out


def register(rank, unit, param_dtype, reduce_dtype, strategy=FULL_SHARD, **factors):
    from fsdpd_harness import trainer_pb2
    return rank.d.call("/fsdp.v1.Trainer/RegisterUnit", trainer_pb2.RegisterUnitRequest(
        session_id=rank.session, unit=unit, strategy=strategy, param_dtype=param_dtype,
        reduce_dtype=reduce_dtype, params=[
            trainer_pb2.ParamSpec(name="w", shape=[13, 17], dtype=FP32),
            trainer_pb2.ParamSpec(name="b", shape=[13], dtype=FP32)], **factors),
        trainer_pb2.RegisterUnitReply)


def submit_all(ranks, unit, step, accumulate=False, method="ReduceScatter"):
    from fsdpd_harness import trainer_pb2
    results = [None] * len(ranks)

    def run(i):
        try:
            ranks[i].d.call(f"/fsdp.v1.Trainer/{method}", trainer_pb2.UnitOpRequest(
                session_id=ranks[i].session, unit=unit, step=step, accumulate=accumulate),
                trainer_pb2.UnitOpReply)
            results[i] = "OK"
        except grpc.RpcError as e:
            results[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def lend(ranks, unit, step):
    """Every rank's Unshard for the backward of step: each is lent its full-gradient buffer
    (and lets go of the copy, which the tests here do not read)."""
    assert on_all(ranks, "Unshard", unit=unit, step=step, backward=True) == [None] * len(ranks)
    assert on_all(ranks, "Reshard", unit=unit, step=step) == [None] * len(ranks)


def write_full_grad(rank, layout, values, dtype, unit="u"):
    rank.write_full_grad(values, dtype, unit)


def grad_shards(rank, layout):
    data = rank.memory[layout.grad_offset:layout.grad_offset + layout.padded_numel * 4]
    return list(array.array("f", bytes(data)))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("param_dtype,reduce_dtype", [
    (FP32, FP32), (BF16, BF16), (BF16, FP32), (FP16, FP16), (FP16, FP32), (FP32, BF16)],
    ids=["fp32", "bf16", "bf16-in-fp32", "fp16", "fp16-in-fp32", "fp32-in-bf16"])
def test_reduce_scatter_matches_the_reference(fsdpd, world, param_dtype, reduce_dtype):
    d = fsdpd("--set", "memory.job_limit=64MiB")
    ranks = [Rank(d, r, world) for r in range(world)]
    layouts = [register(r, "u", param_dtype, reduce_dtype) for r in ranks]
    n = layouts[0].padded_numel
    R = rounder(param_dtype)
    grads = [[R(((i * 31 + 7 * r) % 101 - 50) * 0.173) for i in range(n)] for r in range(world)]
    lend(ranks, "u", 1)
    for r, lay in zip(ranks, layouts):
        write_full_grad(r, lay, grads[r.rank], param_dtype)
    assert submit_all(ranks, "u", step=1) == ["OK"] * world
    expected = reference(grads, reduce_dtype, 1, world)
    assert grad_shards(ranks[0], layouts[0]) == expected
    # A no_sync-style step adds to the shards instead.
    lend(ranks, "u", 2)
    for r, lay in zip(ranks, layouts):
        write_full_grad(r, lay, grads[r.rank], param_dtype)
    assert submit_all(ranks, "u", step=2, accumulate=True) == ["OK"] * world
    assert grad_shards(ranks[-1], layouts[0]) == reference(grads, reduce_dtype, 1, world, expected)
    assert register(ranks[0], "u", param_dtype, reduce_dtype).reduced_step == 2


@pytest.mark.parametrize("pre,post", [(2.0 ** 24, 2.0 ** -24), (2.0 ** -24, 2.0 ** 24),
                                      (2.0 ** 12, 2.0 ** 12), (2.0 ** -24, 0.0)],
                         ids=["pre-max", "pre-min", "product-max", "derived"])
def test_divide_factors_at_their_bounds_reduce_in_fp16(fsdpd, pre, post):
    """Issue 10 finding 14: factors such as 1e-310 or 1e308 passed RegisterUnit and then every
    ReduceScatter failed with INTERNAL. Now RegisterUnit bounds them (test_units.py), and at
    the bounds a reduce in fp16, the narrowest range, still gives the reference's values,
    neither all zero nor all Inf."""
    d = fsdpd("--set", "memory.job_limit=64MiB")
    ranks = [Rank(d, 0, 1)]  # derived: postdivide = data-parallel size 1 / 2^-24 = 2^24
    lay = register(ranks[0], "u", FP16, FP16, gradient_predivide_factor=pre,
                   gradient_postdivide_factor=post)
    n = lay.padded_numel
    R = rounder(FP16)
    grads = [[R(2.0 ** (i % 40 - 24) * (1 + i % 3)) for i in range(n)]]
    lend(ranks, "u", 1)
    write_full_grad(ranks[0], lay, grads[0], FP16)
    assert submit_all(ranks, "u", step=1) == ["OK"]
    got = grad_shards(ranks[0], lay)
    assert got == reference(grads, FP16, pre, post or 1 / pre)
    assert any(0 < abs(v) < float("inf") for v in got)


def test_divide_factors_and_all_reduce(fsdpd):
    d = fsdpd("--set", "memory.job_limit=64MiB")
    ranks = [Rank(d, r, 2) for r in range(2)]
    layouts = [register(r, "f", FP32, FP32, gradient_predivide_factor=2.0,
                        gradient_postdivide_factor=4.0) for r in ranks]
    n = layouts[0].padded_numel
    grads = [[f32(i * 0.5 + r) for i in range(n)] for r in range(2)]
    lend(ranks, "f", 7)
    for r, lay in zip(ranks, layouts):
        write_full_grad(r, lay, grads[r.rank], FP32, unit="f")
    assert submit_all(ranks, "f", step=7) == ["OK", "OK"]
    assert grad_shards(ranks[0], layouts[0]) == reference(grads, FP32, 2.0, 4.0)
    # NO_SHARD: one whole gradient every rank reads, through AllReduce.
    layouts = [register(r, "rep", FP32, FP32, strategy=NO_SHARD) for r in ranks]
    assert layouts[0].shard_numel == layouts[0].padded_numel
    lend(ranks, "rep", 1)
    for r, lay in zip(ranks, layouts):
        write_full_grad(r, lay, grads[r.rank][:lay.padded_numel], FP32, unit="rep")
    results = submit_all(ranks, "rep", step=1)
    assert all(isinstance(x, grpc.RpcError) for x in results)
    assert "unit 'rep' is NO_SHARD: use AllReduce" in results[0].details()
    assert submit_all(ranks, "rep", step=1, method="AllReduce") == ["OK", "OK"]
    assert grad_shards(ranks[1], layouts[0]) == reference(
        [g[:layouts[0].padded_numel] for g in grads], FP32, 1, 2)


def test_a_missing_rank_aborts_every_waiter_naming_it(fsdpd):
    d = fsdpd("--set", "memory.job_limit=64MiB", "--set", "store.collective_timeout=300ms",
              "--set", "daemon.housekeeping_interval=20ms")
    ranks = [Rank(d, r, 3) for r in range(3)]
    for r in ranks:
        register(r, "u", FP32, FP32)
    lend(ranks, "u", 41)
    t0 = time.monotonic()
    results = submit_all(ranks[:2], "u", step=41)  # rank 2 never submits
    elapsed = time.monotonic() - t0
    for e in results:
        code, details = e.code(), e.details()
        assert code == grpc.StatusCode.ABORTED
        assert "unit 'u' step 41: local rank(s) 2 of job 'j' did not ask to reduce-scatter " \
            "in time (store.collective_timeout); the job's flight record: " in details, details
    assert 0.25 < elapsed < 2, elapsed
    # The unit is usable again: all three submit the next step. The aborted reduce gave the
    # submitters' buffers back; rank 2 still holds its own.
    lend(ranks, "u", 42)
    assert submit_all(ranks, "u", step=42) == ["OK"] * 3


def test_a_dying_rank_aborts_the_others_at_once(fsdpd):
    d = fsdpd("--set", "memory.job_limit=64MiB")  # collective timeout: 30 s
    ranks = [Rank(d, r, 2) for r in range(2)]
    for r in ranks:
        register(r, "u", FP32, FP32)
    lend(ranks, "u", 5)
    box = {}

    def wait():
        box["result"] = submit_all(ranks[:1], "u", step=5)[0]
    waiter = threading.Thread(target=wait)
    t0 = time.monotonic()
    waiter.start()
    poll(lambda: d.status().rpc_work_inflight >= 1, 5, what="rank 0 to be waiting")
    ranks[1].sock.close()  # what the kernel does when rank 1's process dies
    waiter.join(10)
    elapsed = time.monotonic() - t0
    e = box["result"]
    assert isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.ABORTED
    assert "unit 'u' step 5: local rank 1 of job 'j' is gone (its process closed the memory " \
           "channel" in e.details()
    assert elapsed < 3, elapsed
    # A rank that is gone fails the next collectives at once too, until it attaches again.
    (e,) = on_all(ranks[:1], "Unshard", step=6, backward=True)
    assert e.code() == grpc.StatusCode.ABORTED
    assert ("unit 'u' step 6: local rank(s) 1 of job 'j' ended their session and have not "
            "attached again; the unshard cannot complete without them") in e.details()
    again = Rank(d, 1, 2)
    register(again, "u", FP32, FP32)
    lend([ranks[0], again], "u", 6)
    assert submit_all([ranks[0], again], "u", step=6) == ["OK", "OK"]
    d.assert_serving()


def test_restarted_ranks_wait_for_each_other(fsdpd):
    """Trainers that attach after a rank died (the job restarting) wait for it to come back
    instead of failing: the rank is only late."""
    d = fsdpd("--set", "memory.job_limit=64MiB")
    first = [Rank(d, r, 2) for r in range(2)]
    for r in first:
        register(r, "u", FP32, FP32)
        r.sock.close()  # both processes die
    poll(lambda: not d.status().sessions, 5, what="the sessions to end")
    again = [Rank(d, 0, 2)]
    register(again[0], "u", FP32, FP32)
    box = {}
    waiter = threading.Thread(target=lambda: box.update(
        r=on_all(again, "Unshard", step=1, backward=True)))
    waiter.start()
    poll(lambda: d.status().rpc_work_inflight >= 1 or box, 5, what="rank 0 to be waiting")
    assert not box, box["r"][0].details()
    again.append(Rank(d, 1, 2))
    register(again[1], "u", FP32, FP32)
    assert on_all(again[1:], "Unshard", step=1, backward=True) == [None]
    waiter.join(10)
    assert box["r"] == [None]
    assert submit_all(again, "u", step=1) == ["OK", "OK"]


def test_mismatched_steps_abort_the_collection_at_once(fsdpd):
    d = fsdpd("--set", "memory.job_limit=64MiB")
    ranks = [Rank(d, r, 2) for r in range(2)]
    for r in ranks:
        register(r, "u", FP32, FP32)
    from fsdpd_harness import trainer_pb2
    lend(ranks, "u", 3)
    box = {}
    t = threading.Thread(target=lambda: box.update(r=submit_all(ranks[:1], "u", step=3)))
    t.start()
    poll(lambda: d.status().rpc_work_inflight >= 1, 5, what="rank 0 to be waiting")
    with pytest.raises(grpc.RpcError) as excinfo:
        d.call("/fsdp.v1.Trainer/ReduceScatter", trainer_pb2.UnitOpRequest(
            session_id=ranks[1].session, unit="u", step=4), trainer_pb2.UnitOpReply)
    code, details = status_code_and_details(excinfo)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    message = "local rank 1 asked to reduce-scatter step 4 while the other ranks asked for step 3"
    assert message in details
    t.join(5)  # rank 0 hears at once, not after store.collective_timeout
    e = box["r"][0]
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and message in e.details()
    # The same step, but one rank accumulates (no_sync) and the other does not. The aborted
    # reduce gave rank 0's buffer back (rank 1's, refused, it keeps).
    lend(ranks, "u", 4)
    t = threading.Thread(target=lambda: box.update(r=submit_all(ranks[:1], "u", step=4)))
    t.start()
    poll(lambda: d.status().rpc_work_inflight >= 1, 5, what="rank 0 to be waiting")
    with pytest.raises(grpc.RpcError) as excinfo:
        d.call("/fsdp.v1.Trainer/ReduceScatter", trainer_pb2.UnitOpRequest(
            session_id=ranks[1].session, unit="u", step=4, accumulate=True),
            trainer_pb2.UnitOpReply)
    code, details = status_code_and_details(excinfo)
    t.join(5)
    message = ("unit 'u' step 4: local rank 1 submitted with accumulate true while the other "
               "ranks submitted with accumulate false")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and message in details
    assert message in box["r"][0].details()
    lend(ranks, "u", 5)
    assert submit_all(ranks, "u", step=5) == ["OK", "OK"]


def test_a_cancelled_submission_is_withdrawn(fsdpd):
    """A rank whose ReduceScatter call gave up is no longer counted: it can submit again."""
    d = fsdpd("--set", "memory.job_limit=64MiB")
    ranks = [Rank(d, r, 2) for r in range(2)]
    for r in ranks:
        register(r, "u", FP32, FP32)
    from fsdpd_harness import trainer_pb2
    lend(ranks, "u", 1)
    with pytest.raises(grpc.RpcError) as excinfo:
        d.call("/fsdp.v1.Trainer/ReduceScatter", trainer_pb2.UnitOpRequest(
            session_id=ranks[0].session, unit="u", step=1), trainer_pb2.UnitOpReply,
            timeout=0.2)
    assert excinfo.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    poll(lambda: d.status().rpc_work_inflight == 0, 5, what="the cancelled call to end")
    assert submit_all(ranks, "u", step=1) == ["OK", "OK"]
