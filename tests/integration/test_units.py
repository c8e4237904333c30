"""RegisterUnit through a real fsdpd: the FlatParameter layout in the reply (padding below
the shard count, equal shards, parameter offsets), the same spec from every local rank,
idempotent re-registration, a mismatch named by field, values and ranks, bad specs, and jobs
that outlive their sessions."""

import json
import os

import grpc
import pytest

from fsdpd_harness import (PROTOCOL_VERSION, common_pb2, fsdpd,  # noqa: F401
                           status_code_and_details, trainer_pb2)

ATTACH = "/fsdp.v1.Trainer/Attach"
DETACH = "/fsdp.v1.Trainer/Detach"
REGISTER = "/fsdp.v1.Trainer/RegisterUnit"
SET_SCHEDULE = "/fsdp.v1.Trainer/SetSchedule"
FP32, BF16 = common_pb2.DTYPE_FP32, common_pb2.DTYPE_BF16
FULL_SHARD, NO_SHARD = common_pb2.FULL_SHARD, common_pb2.NO_SHARD


def attach(d, rank, world, job="j"):
    return d.call(ATTACH, trainer_pb2.AttachRequest(
        protocol_version=PROTOCOL_VERSION, job=job, local_rank=rank, local_world_size=world,
        pid=os.getpid()),
        trainer_pb2.AttachReply).session_id


def spec(session, unit="layer3", shapes=((4096, 1023), (1023,)), names=("weight", "bias"),
         dtype=FP32, strategy=FULL_SHARD, **extra):
    return trainer_pb2.RegisterUnitRequest(
        session_id=session, unit=unit, strategy=strategy,
        params=[trainer_pb2.ParamSpec(name=n, shape=list(s), dtype=dtype, requires_grad=True)
                for n, s in zip(names, shapes)], **extra)


def register(d, request):
    return d.call(REGISTER, request, trainer_pb2.RegisterUnitReply)


def refused(d, request):
    with pytest.raises(grpc.RpcError) as excinfo:
        register(d, request)
    return status_code_and_details(excinfo)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_layout_for_every_local_world_size(fsdpd, world):
    d = fsdpd()
    sessions = [attach(d, r, world) for r in range(world)]
    numel = 4096 * 1023 + 1023
    replies = [register(d, spec(s)) for s in sessions]
    for r in replies:
        assert r.numel == numel
        assert r.padded_numel % world == 0 and 0 <= r.padded_numel - numel < world
        assert r.shard_numel * world == r.padded_numel
        assert list(r.param_offsets) == [0, 4096 * 1023]
    # Registering again is idempotent.
    assert register(d, spec(sessions[0])) == replies[0]


def test_no_shard_keeps_one_whole_copy(fsdpd):
    d = fsdpd()
    s = [attach(d, r, 3) for r in range(3)]
    r = register(d, spec(s[1], unit="emb", shapes=((7, 5),), names=("w",), strategy=NO_SHARD))
    assert (r.numel, r.padded_numel, r.shard_numel) == (35, 35, 35)


@pytest.mark.parametrize("change,field,mine,theirs", [
    (dict(shapes=((4096, 1024), (1023,))), "params[0].shape", "[4096,1024]", "[4096,1023]"),
    (dict(names=("weight", "b")), "params[1].name", "b", "bias"),
    (dict(dtype=BF16), "params[0].dtype", "DTYPE_BF16", "DTYPE_FP32"),
    (dict(param_dtype=BF16), "param_dtype", "DTYPE_BF16", "DTYPE_UNSPECIFIED"),
    (dict(strategy=NO_SHARD), "strategy", "NO_SHARD", "FULL_SHARD"),
    (dict(shapes=((4096, 1023),), names=("weight",)), "params (count)", "1", "2"),
], ids=["shape", "name", "dtype", "param_dtype", "strategy", "count"])
def test_mismatched_spec_names_field_values_and_ranks(fsdpd, change, field, mine, theirs):
    d = fsdpd()
    s0, s1 = attach(d, 0, 2), attach(d, 1, 2)
    register(d, spec(s0))
    code, details = refused(d, spec(s1, **change))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert details == (f"{REGISTER}: unit 'layer3' {field} {mine} on rank 1, "
                       f"expected {theirs} as on rank 0")
    # The unit is unchanged and rank 1 can still register the real spec.
    register(d, spec(s1))


@pytest.mark.parametrize("request_kwargs,text", [
    (dict(unit=""), "field 'unit' is empty"),
    (dict(strategy=0), "field 'strategy' is unspecified"),
    (dict(shapes=((1 << 32, 1 << 32),), names=("w",)),
     "params[0] 'w' shape[1] = 4294967296 takes the product of its nonzero dimensions past"),
    (dict(shapes=((0, (1 << 64) - 1),), names=("w",)),
     "params[0] 'w' shape[1] = 18446744073709551615 takes the product of its nonzero "
     "dimensions past the limit of 1099511627776 elements"),
    (dict(shapes=((0,), (3, 0)), names=("a", "b")), "has no elements: every parameter has size 0"),
    (dict(names=("w", "w")), "parameter name 'w' appears more than once"),
    (dict(dtype=0), "params[0].dtype of 'weight' is unspecified"),
    (dict(gradient_predivide_factor=-1.0), "gradient_predivide_factor = -1, outside"),
    (dict(gradient_predivide_factor=1e-310), "gradient_predivide_factor = 1e-310, outside"),
    (dict(gradient_postdivide_factor=1e308), "gradient_postdivide_factor = 1e+308, outside"),
    (dict(gradient_predivide_factor=2.0 ** -24),
     "gradient_postdivide_factor (0: data-parallel size 2 / gradient_predivide_factor "
     "5.96046e-08) = 3.35544e+07, outside [5.96046e-08 (2^-24), 1.67772e+07 (2^24)]"),
], ids=["unit-empty", "strategy", "overflow", "zero-dim-hides-overflow", "zero-size",
        "duplicate", "dtype", "factor", "factor-subnormal", "factor-huge", "factor-derived"])
def test_bad_specs(fsdpd, request_kwargs, text):
    d = fsdpd()
    s = attach(d, 0, 2)
    code, details = refused(d, spec(s, **request_kwargs))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert text in details
    d.assert_serving()


def test_the_most_parameters_the_api_promises_register(fsdpd):
    """65,536 parameters, each with every field set (name, shape, dtype, requires_grad),
    register: the request's field budget refused them at about 13,100. One more gets the
    unit's own error naming the count and the limit."""
    d = fsdpd()
    s = attach(d, 0, 1)

    def many(n, unit):
        return trainer_pb2.RegisterUnitRequest(
            session_id=s, unit=unit, strategy=FULL_SHARD,
            params=[trainer_pb2.ParamSpec(name=f"p{i}", shape=[2], dtype=FP32,
                                          requires_grad=True) for i in range(n)])

    reply = register(d, many(65536, "wide"))
    assert reply.numel == 2 * 65536 and len(reply.param_offsets) == 65536
    assert reply.param_offsets[-1] == 2 * 65535
    code, details = refused(d, many(65537, "wider"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "unit 'wider' has 65537 parameters, more than 65536" in details
    d.assert_serving()


def test_unknown_session(fsdpd):
    d = fsdpd()
    code, details = refused(d, spec(12345))
    assert code == grpc.StatusCode.NOT_FOUND
    assert "session 0000000000003039 is not attached" in details


def test_set_schedule_names_what_it_refuses(fsdpd):
    d = fsdpd()
    s = attach(d, 0, 1)

    def set_schedule(**fields):
        return d.call(SET_SCHEDULE, trainer_pb2.SetScheduleRequest(session_id=s, **fields),
                      trainer_pb2.SetScheduleReply)

    def refused_with(code, text, **fields):
        with pytest.raises(grpc.RpcError) as excinfo:
            set_schedule(**fields)
        got, details = status_code_and_details(excinfo)
        assert got == code and text in details, details

    refused_with(grpc.StatusCode.FAILED_PRECONDITION,
                 "SetSchedule: job 'j' has no units yet: register them first", max_inflight=3)
    register(d, spec(s))
    refused_with(grpc.StatusCode.INVALID_ARGUMENT,
                 "SetSchedule: max_inflight 65 is outside [1, 64] (0 keeps the job's 2)",
                 max_inflight=65)
    refused_with(grpc.StatusCode.NOT_FOUND,
                 "SetSchedule: units[1].unit 'layer4' is not registered in job 'j'",
                 units=[trainer_pb2.UnitSchedule(unit="layer3"),
                        trainer_pb2.UnitSchedule(unit="layer4")])
    # Two entries for one unit: the last won silently; now refused naming both.
    register(d, spec(s, unit="layer4"))
    refused_with(grpc.StatusCode.INVALID_ARGUMENT,
                 "SetSchedule: units[2].unit 'layer3' is units[0].unit already: a unit takes "
                 "one entry",
                 units=[trainer_pb2.UnitSchedule(unit="layer3", reshard_after_forward=True),
                        trainer_pb2.UnitSchedule(unit="layer4"),
                        trainer_pb2.UnitSchedule(unit="layer3", reshard_after_forward=False)])
    refused_with(grpc.StatusCode.INVALID_ARGUMENT,
                 "SetSchedule: backward_prefetch 65 is outside [0, 64]", backward_prefetch=65)
    refused_with(grpc.StatusCode.NOT_FOUND,
                 "SetSchedule: forward_order[0] 'layer9' is not registered in job 'j'",
                 forward_order=["layer9"])
    refused_with(grpc.StatusCode.INVALID_ARGUMENT,
                 "SetSchedule: forward_order[1] 'layer3' is forward_order[0] already",
                 forward_order=["layer3", "layer3"])
    set_schedule(max_inflight=64, units=[trainer_pb2.UnitSchedule(unit="layer3")],
                 forward_order=["layer3"], forward_prefetch=2, backward_prefetch=1)
    (job,) = json.loads(d.fsdpctl("--json", "status").stdout)["memory"]["jobs"]
    assert (job["max_inflight"], job["forward_prefetch"], job["backward_prefetch"],
            job["order_given"]) == (64, 2, 1, True)
    unit = json.loads(d.fsdpctl("--json", "unit", "layer3").stdout)
    assert unit["forward_index"] == 0 and unit["reshard_after_forward"] is False
    d.assert_serving()


def test_units_outlive_sessions(fsdpd):
    d = fsdpd()
    s0 = attach(d, 0, 2)
    first = register(d, spec(s0))
    d.call(DETACH, trainer_pb2.DetachRequest(session_id=s0), trainer_pb2.DetachReply)
    # The job keeps its units: a different local world size cannot attach to it ...
    with pytest.raises(grpc.RpcError) as excinfo:
        attach(d, 0, 4)
    code, details = status_code_and_details(excinfo)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "job 'j' holds units laid out for local_world_size 2, not 4" in details
    # ... while the same rank comes back to the same layout.
    s0 = attach(d, 0, 2)
    assert register(d, spec(s0)) == first


def test_fsdpctl_units_and_shard_map(fsdpd):
    d = fsdpd()
    s = [attach(d, r, 3, job="llama") for r in range(3)]
    shapes, names = ((96, 32), (96,), (64, 32)), ("qkv.weight", "qkv.bias", "mlp.weight")
    for session in s:
        register(d, spec(session, unit="layers.0", shapes=shapes, names=names, param_dtype=BF16))
    register(d, spec(s[0], unit="embed", shapes=((500, 32),), names=("weight",),
                     strategy=NO_SHARD))
    other = attach(d, 0, 1, job="other")
    register(d, spec(other, unit="embed", shapes=((8,),), names=("w",)))

    r = d.fsdpctl("--json", "--job", "llama", "units")
    assert r.returncode == 0, r.stderr
    units = {u["unit"]: u for u in json.loads(r.stdout)["units"]}
    assert set(units) == {"layers.0", "embed"}
    assert (units["layers.0"]["numel"], units["layers.0"]["padded_numel"],
            units["layers.0"]["shards"], units["layers.0"]["registered_ranks"]) == (5216, 5217, 3, 3)
    assert (units["layers.0"]["param_dtype"], units["layers.0"]["reduce_dtype"]) == ("bf16", "bf16")
    assert (units["embed"]["strategy"], units["embed"]["registered_ranks"]) == ("NO_SHARD", 1)

    r = d.fsdpctl("--json", "--job", "llama", "unit", "layers.0")
    assert r.returncode == 0, r.stderr
    u = json.loads(r.stdout)
    assert [(p["name"], p["offset"], p["numel"]) for p in u["param_list"]] == [
        ("qkv.weight", 0, 3072), ("qkv.bias", 3072, 96), ("mlp.weight", 3168, 2048)]
    assert [(m["local_rank"], m["begin"], m["end"], m["padding"]) for m in u["shard_map"]] == [
        (0, 0, 1739, 0), (1, 1739, 3478, 0), (2, 3478, 5217, 1)]

    r = d.fsdpctl("unit", "layers.0")  # one job has it: no --job needed
    assert r.returncode == 0, r.stderr
    assert "5216 elements + 1 padding = 3 shards of 1739" in r.stdout
    assert "|................................cccccccccccccccc|" in r.stdout

    r = d.fsdpctl("unit", "embed")  # two jobs have one
    assert r.returncode == 1
    assert "unit 'embed' exists in 2 jobs; name the job (field 'job')" in r.stderr
    r = d.fsdpctl("--job", "other", "unit", "embed")
    assert r.returncode == 0 and "[8]" in r.stdout, r.stdout + r.stderr
    r = d.fsdpctl("unit", "nope")
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr and "no job has a unit 'nope'" in r.stderr
    r = d.fsdpctl("--job", "ghost", "units")
    assert r.returncode == 1 and "no job 'ghost' holds units" in r.stderr


@pytest.mark.parametrize("limits,full", [
    (("session.max_sessions=2",), "the daemon holds 2 sessions"),
    (("memory.limit=256MiB",), "but 256MiB of memory.limit = 256MiB is reserved by 2 jobs in use"),
], ids=["job-slots", "memory"])
def test_finished_jobs_never_keep_new_ones_out(fsdpd, limits, full):
    """Issue 10 finding 13: a finished job is retained for store.job_retention (10 minutes)
    so that its trainers may come back, but a job with no session gives way to a new one:
    more short jobs than the daemon holds at once run one after another. Jobs in use are
    never freed: with every slot or byte in use, a new job is refused."""
    args = ["--set", "memory.job_limit=64MiB"]
    for limit in limits:
        args += ["--set", limit]
    d = fsdpd(*args)
    for i in range(5):
        s = attach(d, 0, 1, job=f"short{i}")
        register(d, spec(s, shapes=((64,),), names=("w",)))
        d.call(DETACH, trainer_pb2.DetachRequest(session_id=s), trainer_pb2.DetachReply)
    assert len(d.status().jobs) == 2
    assert ("job 'short0': retained with no session, but job 'short2' needs the room"
            in d.stderr())
    in_use = [attach(d, 0, 1, job=f"live{i}") for i in range(2)]
    for s in in_use:
        register(d, spec(s, shapes=((64,),), names=("w",)))
    with pytest.raises(grpc.RpcError) as excinfo:
        s = attach(d, 0, 1, job="one-too-many")
        register(d, spec(s, shapes=((64,),), names=("w",)))
    code, details = status_code_and_details(excinfo)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert full in details, details
    assert sorted(j.job for j in d.status().jobs) == ["live0", "live1"]
    d.assert_serving()


def test_the_job_idle_longest_gives_way_even_within_one_millisecond(fsdpd):
    """Issue 29 item 3: of two jobs whose last sessions end one after the other, the first
    gives way to a new job first, also when both ended in the same millisecond (the loop's
    clock); before, such a tie freed the newer job, and
    test_finished_jobs_never_keep_new_ones_out failed now and then. Each round detaches two
    jobs back to back (a tie, more often than not) and makes two new ones."""
    d = fsdpd("--set", "memory.job_limit=64MiB", "--set", "memory.limit=256MiB")
    for i in range(12):
        sessions = []
        for name in (f"a{i}", f"b{i}"):
            s = attach(d, 0, 1, job=name)
            register(d, spec(s, shapes=((64,),), names=("w",)))
            sessions.append(s)
            if i:
                gone = f"a{i - 1}" if name == f"a{i}" else f"b{i - 1}"
                assert (f"job '{gone}': retained with no session, but job '{name}' needs the "
                        "room" in d.stderr()), (i, name)
        for s in sessions:
            d.call(DETACH, trainer_pb2.DetachRequest(session_id=s), trainer_pb2.DetachReply)
    assert sorted(j.job for j in d.status().jobs) == ["a11", "b11"]
