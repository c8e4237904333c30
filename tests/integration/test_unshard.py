"""Unit buffers and Unshard/Reshard through a real fsdpd: L = 1..4 ranks (one process may hold
several ranks' sessions) map their job's arena, each writes its own fp32 master shard, and
Unshard yields the whole unit in param_dtype, equal to a reference computed here (fp32
exact, bf16 and fp16 rounded to nearest even). Unshard is a collective of the local ranks:
the gather of a step runs once every rank asked for it, the copy then serves that step (also
after a Reshard) until a newer step gathers the masters again; ranks that disagree on the
step, or do not come, are told so; bad requests get their status."""

import array
import json
import mmap
import os
import socket
import struct
import threading

import grpc
import pytest

from fsdpd_harness import (PROTOCOL_VERSION, common_pb2, fsdpd, poll,  # noqa: F401
                           status_code_and_details, trainer_pb2)
from fsdp.v1 import channel_pb2

FP32, BF16, FP16 = common_pb2.DTYPE_FP32, common_pb2.DTYPE_BF16, common_pb2.DTYPE_FP16
SIZE = {FP32: 4, BF16: 2, FP16: 2}


class Rank:
    """One local rank: a session, its memory channel and its mapping of the job's arena."""

    def __init__(self, d, rank, world, job="j", generation=0, job_token=""):
        self.d = d
        self.rank = rank
        a = d.call("/fsdp.v1.Trainer/Attach", trainer_pb2.AttachRequest(
            protocol_version=PROTOCOL_VERSION, job=job, local_rank=rank, local_world_size=world,
            pid=os.getpid(), generation=generation, job_token=job_token),
            trainer_pb2.AttachReply)
        self.session = a.session_id
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(a.memory_socket)
        hello = channel_pb2.ChannelHello(protocol_version=PROTOCOL_VERSION,
                                         session_id=a.session_id)
        h = hello.SerializeToString()
        self.sock.send(struct.pack("<I", len(h)) + h + b"\0" * (4092 - len(h)))
        msg, fds, _, _ = socket.recv_fds(self.sock, 4096, 8)
        w = channel_pb2.ChannelWelcome.FromString(msg[4:4 + struct.unpack("<I", msg[:4])[0]])
        assert w.status == 0, w.message
        # Memory 0: what trainers write; memory 1: the unsharded buffers, read-only.
        self.memory = mmap.mmap(fds[0], w.memories[0].bytes)
        self.shared = mmap.mmap(fds[1], w.memories[1].bytes, prot=mmap.PROT_READ)
        for fd in fds:
            os.close(fd)
        self.lent = {}  # unit: the last Unshard's reply, saying where its buffers are

    def register(self, unit="u", shapes=((37, 11),), param_dtype=FP32,
                 strategy=common_pb2.FULL_SHARD, requires_grad=False,
                 layout=common_pb2.LAYOUT_FLAT):
        return self.d.call("/fsdp.v1.Trainer/RegisterUnit", trainer_pb2.RegisterUnitRequest(
            session_id=self.session, unit=unit, strategy=strategy,
            param_dtype=param_dtype, layout=layout,
            params=[trainer_pb2.ParamSpec(name=f"p{i}", shape=list(s), dtype=FP32,
                                          requires_grad=requires_grad)
                    for i, s in enumerate(shapes)]), trainer_pb2.RegisterUnitReply)

    def op(self, name, unit="u", step=0, timeout=10, **fields):
        """fields: the UnitOpRequest's others (backward, accumulate, defer_all_reduce)."""
        reply = self.d.call(f"/fsdp.v1.Trainer/{name}",
                            trainer_pb2.UnitOpRequest(session_id=self.session, unit=unit,
                                                      step=step, **fields),
                            trainer_pb2.UnitOpReply, timeout=timeout)
        if name == "Unshard":
            self.lent[unit] = reply
        return reply

    def write_master_shard(self, layout, values):
        """This rank's slice of the flat values into its master shard (the host's master
        buffer holds its shards only, from host_first_shard)."""
        lo = layout.shard * layout.shard_numel
        shard = array.array("f", values[lo:lo + layout.shard_numel])
        start = layout.master_offset + host_element(layout) * 4
        self.memory[start:start + len(shard) * 4] = shard.tobytes()

    def unsharded(self, layout, dtype, unit="u"):
        """The copy the last Unshard of unit lent: in the read-only copies, or the masters."""
        lent = self.lent[unit]
        memory = self.memory if lent.unsharded_memory == 0 else self.shared
        start = lent.unsharded_offset
        return bytes(memory[start:start + layout.padded_numel * SIZE[dtype]])

    def write_full_grad(self, values, dtype, unit="u"):
        """Into the full-gradient buffer the last backward Unshard of unit lent."""
        data = encode(values, dtype)
        start = self.lent[unit].full_grad_offset
        assert self.lent[unit].full_grad_bytes >= len(data)
        self.memory[start:start + len(data)] = data


def per_param_map(lay, shapes):
    """LAYOUT_PER_PARAM as FSDP2 lays a module's parameters out: each cut on dim 0 into
    pieces of ceil(dim0 / S) rows (torch.chunk's), every shard its piece of each parameter in
    order, rows past the parameter's last zero, the shard padded at its end. For each element
    of the shards' space, its offset in the unsharded buffer (the parameters one after the
    other), or None for padding. The reply's pieces must be these."""
    shards = lay.padded_numel // lay.shard_numel
    pieces, at, start = [], 0, 0
    for shape in shapes:
        dim0 = shape[0] if shape else 1
        row = 1
        for s in shape[1:]:
            row *= s
        rows = -(-dim0 // shards)
        pieces.append((at, rows, row, dim0, start))
        at += rows * row
        start += dim0 * row
    assert list(lay.param_shard_offsets) == [p[0] for p in pieces]
    assert list(lay.param_rows_per_shard) == [p[1] for p in pieces]
    where = []
    for s in range(shards):
        shard = [None] * lay.shard_numel
        for at, rows, row, dim0, start in pieces:
            for i in range(rows * row):
                if s * rows + i // row < dim0:
                    shard[at + i] = start + (s * rows + i // row) * row + i % row
        where += shard
    return where


def in_shards(where, values):
    """Values of the unsharded buffer laid out as the shards are (padding 0)."""
    return [0.0 if w is None else values[w] for w in where]


def host_element(layout):
    """Where the rank's shard starts in the host's master and gradient buffers."""
    return (layout.shard - layout.host_first_shard) * layout.shard_numel


def on_all(ranks, name, unit="u", step=0, **fields):
    """name on every rank at once (one thread each), as the ranks' processes would; returns
    the errors, in rank order (None for success)."""
    errors = [None] * len(ranks)

    def run(i):
        try:
            ranks[i].op(name, unit=unit, step=step, **fields)
        except grpc.RpcError as e:
            errors[i] = e
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def bf16_bits(x):
    (u,) = struct.unpack("<I", struct.pack("<f", x))
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even (finite inputs)


def encode(values, dtype):
    if dtype == FP32:
        return array.array("f", values).tobytes()
    if dtype == FP16:
        return b"".join(struct.pack("<e", v) for v in values)
    return b"".join(struct.pack("<H", bf16_bits(v)) for v in values)


def values_for(n, seed):
    # Values whose rounding matters: fractions, ties, large and tiny magnitudes.
    return [((i * 7919 + seed) % 2003 - 1001) * 0.0371 + (1e-3 if i % 5 == 0 else 0.0)
            for i in range(n)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
def test_unshard_gathers_every_rank_shard(fsdpd, world, dtype):
    d = fsdpd("--set", "memory.job_limit=64MiB")
    ranks = [Rank(d, r, world) for r in range(world)]
    shapes = ((37, 11), (5,), (3, 7))  # 433 elements: no world size above 1 divides it
    layouts = [r.register(shapes=shapes, param_dtype=dtype) for r in ranks]
    layout = layouts[0]
    assert [lay.shard for lay in layouts] == list(range(world))
    values = values_for(layout.padded_numel, world)
    for r, lay in zip(ranks, layouts):
        r.write_master_shard(lay, values)
    assert on_all(ranks, "Unshard", step=1) == [None] * world
    expected = encode(values, dtype)
    for r in ranks:  # every rank sees the same, whole unit
        assert r.unsharded(layout, dtype) == expected
    # fp32 on one host: the masters are the copy; else the copy is in the read-only memory.
    assert {r.lent["u"].unsharded_memory for r in ranks} == {0 if dtype == FP32 else 1}
    ranks[-1].op("Reshard", step=1)
    # FULL_SHARD reshards after the forward: the backward's Unshard is the step's second
    # gather, which every rank joins (while another still holds the first copy too), and it
    # lends each rank a full-gradient buffer of its own.
    assert on_all(ranks, "Unshard", step=1, backward=True) == [None] * world
    for r in ranks:
        assert r.unsharded(layout, dtype) == expected
        assert r.lent["u"].full_grad_bytes >= layout.padded_numel * SIZE[dtype]
    assert len({r.lent["u"].full_grad_offset for r in ranks}) == world  # one per rank
    for r in ranks:
        r.op("Reshard", step=1)
    # The masters change (an optimizer step); the next step's Unshard gathers again.
    values = [v * -2.5 for v in values]
    for r, lay in zip(ranks, layouts):
        r.write_master_shard(lay, values)
    assert on_all(ranks, "Unshard", step=2) == [None] * world
    assert ranks[0].unsharded(layout, dtype) == encode(values, dtype)
    # A trainer registering again (after a restart) learns where the unit's steps stand.
    again = ranks[0].register(shapes=shapes, param_dtype=dtype)
    assert (again.gathered_step, again.reduced_step) == (2, 0)


PER_PARAM_SHAPES = ((10, 3), (7,), (), (0, 4), (3, 2, 2))  # 50 elements; a scalar, an empty


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_per_param_layout_gathers_and_reduces_as_fsdp2_lays_out(fsdpd, world, dtype):
    """LAYOUT_PER_PARAM: each rank's master shard holds its rows of each parameter
    (per_param_map); Unshard gives the parameters one after the other, as the masters say;
    ReduceScatter sums the ranks' full gradients (laid out as the copy) into each rank's
    piece of each parameter, bit for bit as the reduce's contract says, padding zero."""
    from test_reduce_scatter import decode, reference
    d = fsdpd("--set", "memory.job_limit=64MiB")
    ranks = [Rank(d, r, world) for r in range(world)]
    layouts = [r.register(shapes=PER_PARAM_SHAPES, param_dtype=dtype, requires_grad=True,
                          layout=common_pb2.LAYOUT_PER_PARAM) for r in ranks]
    lay = layouts[0]
    where = per_param_map(lay, PER_PARAM_SHAPES)
    values = values_for(lay.numel, world)
    for r, x in zip(ranks, layouts):
        r.write_master_shard(x, in_shards(where, values))
    assert on_all(ranks, "Unshard", step=1, backward=True) == [None] * world
    n = lay.numel * SIZE[dtype]
    for r in ranks:  # never the masters themselves: they are laid out otherwise
        assert r.lent["u"].unsharded_memory == 1
        assert r.unsharded(lay, dtype)[:n] == encode(values, dtype)
    grads = [[((i * 31 + 7 * g) % 41 - 20) * 0.5 for i in range(lay.numel)]
             for g in range(world)]
    for r, g in zip(ranks, grads):
        r.write_full_grad(g, dtype)
    assert on_all(ranks, "ReduceScatter", step=1) == [None] * world
    want = in_shards(where, reference(grads, dtype, 1, world))
    for r, x in zip(ranks, layouts):
        lo, at = x.shard * x.shard_numel, x.grad_offset + host_element(x) * 4
        assert decode(bytes(r.memory[at:at + x.shard_numel * 4]), FP32) == \
            want[lo:lo + x.shard_numel]


def test_a_gather_waits_for_every_rank_of_the_step(fsdpd):
    """A rank that asks for step 2 first does not get the copy until the last rank asked:
    until then that rank may still be writing its master shard (its optimizer step)."""
    d = fsdpd("--set", "memory.job_limit=64MiB")
    ranks = [Rank(d, r, 2) for r in range(2)]
    layouts = [r.register() for r in ranks]
    values = values_for(layouts[0].padded_numel, 3)
    for r, lay in zip(ranks, layouts):
        r.write_master_shard(lay, values)
    assert on_all(ranks, "Unshard", step=1) == [None, None]
    early = []
    t = threading.Thread(target=lambda: early.append(ranks[0].op("Unshard", step=2)))
    t.start()
    t.join(0.3)
    assert t.is_alive(), "rank 0 got step 2 before rank 1 asked for it"
    # The operator sees the gather being collected, and who is missing.
    r = d.fsdpctl("--json", "unit", "u")
    assert r.returncode == 0, r.stderr
    unit = json.loads(r.stdout)
    assert (unit["gathered_step"], unit["reduced_step"]) == (1, 0)
    (c,) = unit["collectives"]
    assert (c["kind"], c["step"], c["ranks"], c["running"]) == ("UNSHARD", 2, [0], False)
    assert 0 < c["deadline_in_ms"] <= 30000
    assert "j u: unshard of step 2: rank 0 of 2 asked" in d.fsdpctl("units").stdout
    values = [v + 1 for v in values]  # rank 1's optimizer step, while rank 0 waits
    for r, lay in zip(ranks, layouts):
        r.write_master_shard(lay, values)
    ranks[1].op("Unshard", step=2)
    t.join(10)
    assert early and ranks[0].unsharded(layouts[0], FP32) == encode(values, FP32)


def test_ranks_that_disagree_or_stay_away_are_named(fsdpd):
    d = fsdpd("--set", "memory.job_limit=64MiB", "--set", "store.collective_timeout=300ms",
              "--set", "daemon.housekeeping_interval=20ms")
    ranks = [Rank(d, r, 3) for r in range(3)]
    for r in ranks:
        r.register()
    # Rank 2 never asks: the others hear who is missing once the timeout passes.
    errors = on_all(ranks[:2], "Unshard", step=1)
    for e in errors:
        assert e.code() == grpc.StatusCode.ABORTED
        assert ("unit 'u' step 1: local rank(s) 2 of job 'j' did not ask to unshard in time"
                in e.details())
    # Steps that disagree abort the gather for everyone, naming both steps.
    t = threading.Thread(target=lambda: errors.append(
        refused(lambda: ranks[0].op("Unshard", step=5))))
    t.start()
    poll(lambda: d.status().rpc_work_inflight >= 1, 5, what="rank 0's Unshard to wait")
    code, details = refused(lambda: ranks[1].op("Unshard", step=6))
    t.join(10)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "local rank 1 asked to unshard step 6 while the other ranks asked for step 5" in details
    assert errors[-1][0] == grpc.StatusCode.FAILED_PRECONDITION
    # A step older than the copy's is refused.
    assert on_all(ranks, "Unshard", step=7) == [None] * 3
    code, details = refused(lambda: ranks[2].op("Unshard", step=6))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "asked for step 6, but the unsharded copy already holds step 7" in details
    d.assert_serving()


def test_ranks_of_two_runs_of_a_job_do_not_mix_in_a_collective(fsdpd):
    """A rank of the job's next run (a higher generation) and one of the run before it
    cannot complete a collective together: it aborts for both, naming the generations."""
    d = fsdpd("--set", "memory.job_limit=64MiB")
    ranks = [Rank(d, 0, 2, generation=3), Rank(d, 1, 2, generation=4)]
    for r in ranks:
        r.register()
    assert sorted(s.generation for s in d.status().sessions) == [3, 4]
    # Only an Unshard lends the gradient buffers a ReduceScatter needs, so this one is
    # where ranks of two runs meet first.
    t = threading.Thread(target=lambda: errors.append(
        refused(lambda: ranks[0].op("Unshard", backward=True))))
    errors = []
    t.start()
    poll(lambda: d.status().rpc_work_inflight >= 1, 5, what="rank 0's Unshard to wait")
    code, details = refused(lambda: ranks[1].op("Unshard", backward=True))
    t.join(10)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert ("local rank 1 attached with generation 4 while the other ranks attached with "
            "generation 3: ranks of two runs of job 'j' cannot unshard together") in details
    assert errors == [(code, details)]
    code, details = refused(lambda: ranks[0].op("ReduceScatter"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "local rank 0 holds no full-gradient buffer to reduce" in details
    d.assert_serving()


def test_concurrent_unshards_share_one_gather_and_big_units_work(fsdpd):
    d = fsdpd("--set", "memory.job_limit=512MiB")
    ranks = [Rank(d, r, 4) for r in range(4)]
    layouts = [r.register(unit="big", shapes=((4096, 4097),)) for r in ranks]
    values = array.array("f", range(layouts[0].padded_numel))
    for r, lay in zip(ranks, layouts):
        lo = lay.shard * lay.shard_numel
        start = lay.master_offset + host_element(lay) * 4
        r.memory[start:start + lay.shard_numel * 4] = values[lo:lo + lay.shard_numel].tobytes()
    assert on_all(ranks, "Unshard", unit="big") == [None] * 4
    got = array.array("f")
    got.frombytes(ranks[2].unsharded(layouts[0], FP32, unit="big"))
    assert got == values


def refused(call):
    with pytest.raises(grpc.RpcError) as excinfo:
        call()
    return status_code_and_details(excinfo)


def test_bad_unit_ops(fsdpd):
    d = fsdpd("--set", "memory.job_limit=64MiB")
    r0, r1 = Rank(d, 0, 2), Rank(d, 1, 2)
    r0.register()
    code, details = refused(lambda: r0.op("Unshard", unit="nope"))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "unit 'nope' is not registered by job 'j' local rank 0" in details
    code, details = refused(lambda: r1.op("Unshard"))  # registered by rank 0 only
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "unit 'u' is not registered by job 'j' local rank 1" in details
    # More than the job's arena holds: the message says what was needed and what is free,
    # and which option sets the limit.
    code, details = refused(lambda: r0.register(unit="huge", shapes=((4096, 4096),)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "job 'j': need" in details and "free" in details
    assert "of the 64.0 MiB limit (memory.job_limit)" in details, details
    d.assert_serving()


@pytest.mark.parametrize("strategy", [common_pb2.SHARD_GRAD_OP, common_pb2.HYBRID_SHARD],
                         ids=["SHARD_GRAD_OP", "HYBRID_SHARD"])
def test_other_strategies_shard_over_the_host(fsdpd, strategy):
    """On one host SHARD_GRAD_OP and HYBRID_SHARD (one host per shard group) shard over the
    local ranks like FULL_SHARD; SHARD_GRAD_OP's longer hold is the trainer's to keep."""
    d = fsdpd("--set", "memory.job_limit=64MiB")
    ranks = [Rank(d, r, 3) for r in range(3)]
    layouts = [r.register(strategy=strategy) for r in ranks]
    assert [lay.shard for lay in layouts] == [0, 1, 2]
    assert layouts[0].shard_numel * 3 == layouts[0].padded_numel
    values = values_for(layouts[0].padded_numel, 5)
    for r, lay in zip(ranks, layouts):
        r.write_master_shard(lay, values)
    assert on_all(ranks, "Unshard") == [None] * 3
    assert ranks[2].unsharded(layouts[0], FP32) == encode(values, FP32)


def test_status_shows_each_jobs_memory(fsdpd):
    d = fsdpd("--set", "memory.job_limit=64MiB", "--set", "memory.limit=8GiB")
    r = Rank(d, 0, 1, job="llama")
    lay = r.register(shapes=((1024, 1024),))
    st = d.status()
    jobs = {j.job: j for j in st.jobs}
    assert jobs["llama"].arena_bytes == 2 * (64 << 20)  # two arenas of memory.job_limit
    assert jobs["llama"].units == 1 and jobs["llama"].local_world_size == 1
    # master + grad shards, fp32: 8 bytes an element at least; the copy and the full
    # gradient are lent per operation (and an fp32 copy on one host is the masters)
    assert jobs["llama"].used_bytes >= 8 * lay.padded_numel
    assert st.memory.in_use_bytes == jobs["llama"].used_bytes
    assert st.memory.reserved_bytes == jobs["llama"].arena_bytes  # reserved whole
    out = d.fsdpctl("status").stdout
    assert "job llama:" in out and "of its 128.0 MiB arena, 1 unit, 1 local ranks" in out
    assert "128.0 MiB reserved of 8.0 GiB limit (2%), " in out
    assert json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["reserved_bytes"] == \
        128 << 20


def test_memory_comes_back_after_job_retention(fsdpd):
    """A job outlives its sessions for store.job_retention (trainers may come back); then its
    units and memory are freed, and the job name is free for any local world size."""
    d = fsdpd("--set", "memory.job_limit=64MiB", "--set", "store.job_retention=300ms",
              "--set", "daemon.housekeeping_interval=20ms")
    r = Rank(d, 0, 2, job="gone")
    r.register(shapes=((512, 512),))
    assert [j.job for j in d.status().jobs] == ["gone"]
    assert d.status().memory.in_use_bytes > 0
    r.sock.close()  # the trainer's process dies
    poll(lambda: not d.status().jobs, 5, what="the idle job to be freed")
    assert d.status().memory.in_use_bytes == 0
    assert "job 'gone': no session for" in d.stderr() and "freeing its 1 unit" in d.stderr()
    # Within the retention a trainer comes back to the same job ...
    r = Rank(d, 0, 1, job="kept")
    first = r.register(shapes=((64,),))
    r.sock.close()
    poll(lambda: not d.status().sessions, 5, what="the session to end")
    r = Rank(d, 0, 1, job="kept")
    assert r.register(shapes=((64,),)) == first
    # ... and after it, the name starts afresh, here with another local world size.
    r.sock.close()
    poll(lambda: not d.status().jobs, 5, what="the second job to be freed")
    Rank(d, 1, 4, job="kept").register(shapes=((64,),))


def test_ops_on_a_unit_without_buffers_are_refused(fsdpd):
    """A unit whose RegisterUnit failed (too big) has no buffers: Unshard and ReduceScatter
    are refused, not run over memory that is not there (review finding)."""
    d = fsdpd("--set", "memory.job_limit=64MiB")
    r = Rank(d, 0, 1)
    with pytest.raises(grpc.RpcError) as excinfo:
        r.register(unit="huge", shapes=((4096, 4096),))
    assert excinfo.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for op in ("Unshard", "ReduceScatter"):
        with pytest.raises(grpc.RpcError) as excinfo:
            r.op(op, unit="huge")
        code, details = status_code_and_details(excinfo)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "unit 'huge' has no buffers yet" in details
    d.assert_serving()


def test_memory_limit_holds_over_all_jobs(fsdpd):
    """memory.limit bounds the jobs' arenas, whole (what their trainers can make resident),
    not the buffers allocated in them: a second job whose arenas do not fit is refused at its
    first RegisterUnit, however little the first one allocated."""
    d = fsdpd("--set", "memory.job_limit=64MiB", "--set", "memory.limit=191MiB")
    a = Rank(d, 0, 1, job="a")  # its channel keeps the session: job 'a' is in use
    a.register(unit="u", shapes=((64,),))
    b = d.call("/fsdp.v1.Trainer/Attach", trainer_pb2.AttachRequest(
        protocol_version=PROTOCOL_VERSION, job="b", local_rank=0, local_world_size=1,
        pid=os.getpid()),
        trainer_pb2.AttachReply)
    with pytest.raises(grpc.RpcError) as excinfo:
        d.call("/fsdp.v1.Trainer/RegisterUnit", trainer_pb2.RegisterUnitRequest(
            session_id=b.session_id, unit="u", strategy=common_pb2.FULL_SHARD,
            params=[trainer_pb2.ParamSpec(name="p", shape=[64], dtype=FP32)]),
            trainer_pb2.RegisterUnitReply)
    code, details = status_code_and_details(excinfo)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.endswith("RegisterUnit: job 'b': its two arenas of 64MiB (memory.job_limit) "
                            "need 128MiB, but 128MiB of memory.limit = 191MiB is reserved by 1 "
                            "job in use")
    st = d.status().memory
    assert (st.reserved_bytes, st.limit_bytes) == (128 << 20, 191 << 20)
    assert [j.job for j in d.status().jobs] == ["a"]
    a.sock.close()  # job 'a' has no session now: retained, it gives way to job 'b'
    poll(lambda: [x.job for x in d.status().sessions] == ["b"], 5,
         what="job 'a''s session to end")
    d.call("/fsdp.v1.Trainer/RegisterUnit", trainer_pb2.RegisterUnitRequest(
        session_id=b.session_id, unit="u", strategy=common_pb2.FULL_SHARD,
        params=[trainer_pb2.ParamSpec(name="p", shape=[64], dtype=FP32)]),
        trainer_pb2.RegisterUnitReply)
    assert [j.job for j in d.status().jobs] == ["b"]
    assert ("job 'a': retained with no session, but job 'b' needs the room (memory.limit); "
            "freeing its 1 unit and memory") in d.stderr()


def test_a_cancelled_unshard_does_not_count_in_the_gather(fsdpd):
    """An Unshard whose client gives up before the other ranks came no longer counts: the
    gather must not run before the rank asks again (its master shard may still change)."""
    d = fsdpd("--set", "memory.job_limit=64MiB")
    r0, r1 = Rank(d, 0, 2), Rank(d, 1, 2)
    lays = [r0.register(), r1.register()]
    for r, lay in zip((r0, r1), lays):
        r.write_master_shard(lay, [1.0] * lay.padded_numel)
    with pytest.raises(grpc.RpcError) as excinfo:
        r0.op("Unshard", step=1, timeout=0.2)
    assert excinfo.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    poll(lambda: d.status().rpc_work_inflight == 0, 5, what="the cancelled call to end")
    t = threading.Thread(target=lambda: r1.op("Unshard", step=1))
    t.start()
    t.join(0.3)
    assert t.is_alive(), "the gather ran without rank 0"
    r0.write_master_shard(lays[0], [7.0] * lays[0].padded_numel)
    r0.op("Unshard", step=1)
    t.join(10)
    got = array.array("f")
    got.frombytes(r0.unsharded(lays[0], FP32))
    assert set(got[:lays[0].shard_numel]) == {7.0} and set(got[lays[0].shard_numel:]) == {1.0}


def test_a_rank_stopped_holding_the_pool_fails_the_others_and_gives_it_back(fsdpd):
    """Rank 1 stops (it never lets go) while it holds the pool's only copy: the next unit's
    gather waits for a buffer, and when the deadline passes every rank hears which unit and
    rank hold the pool; when rank 1's session ends, the buffer comes back."""
    d = fsdpd("--set", "memory.job_limit=64MiB", "--set", "store.collective_timeout=500ms")
    ranks = [Rank(d, r, 2) for r in range(2)]
    for unit in ("u", "v"):
        for r in ranks:
            r.register(unit, param_dtype=BF16)
    d.call("/fsdp.v1.Trainer/SetSchedule",
           trainer_pb2.SetScheduleRequest(session_id=ranks[0].session, max_inflight=1),
           trainer_pb2.SetScheduleReply)
    assert on_all(ranks, "Unshard", unit="u", step=1) == [None, None]
    ranks[0].op("Reshard", unit="u", step=1)
    errors = on_all(ranks, "Unshard", unit="v", step=1)
    for e in errors:
        code, details = e.code(), e.details()
        assert code == grpc.StatusCode.ABORTED, details
        assert ("unit 'v' step 1: no unsharded copy of job 'j' came free in time "
                "(store.collective_timeout): its 1 (max_inflight) are held by 'u' (ranks 1)"
                in details), details
    (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
    assert job["copies"]["lent"] == 1 and job["copies"]["waits"] == 1
    d.call("/fsdp.v1.Trainer/Detach", trainer_pb2.DetachRequest(session_id=ranks[1].session),
           trainer_pb2.DetachReply)
    (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
    assert job["copies"]["lent"] == 0
    d.assert_serving()
