"""Trainer sessions through a real fsdpd: Attach, KeepAlive, Detach and the lease, with the
rules a trainer can break (rank range, local world size, duplicate rank, foreign pid, job
name) each answered with its status and a message naming the field and the value."""

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from fsdpd_harness import (PROTOCOL_VERSION, PYTHON_GEN, fsdpd, operator_pb2, poll,  # noqa: F401
                           status_code_and_details, trainer_pb2)
from test_unshard import Rank, values_for

ATTACH = "/fsdp.v1.Trainer/Attach"
DETACH = "/fsdp.v1.Trainer/Detach"
KEEPALIVE = "/fsdp.v1.Trainer/KeepAlive"


def attach(d, job="job-1", rank=0, world=2, pid=None, version=PROTOCOL_VERSION):
    return d.call(ATTACH, trainer_pb2.AttachRequest(
        protocol_version=version, job=job, local_rank=rank, local_world_size=world,
        pid=os.getpid() if pid is None else pid), trainer_pb2.AttachReply)


def refused(call, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as excinfo:
        call(*args, **kwargs)
    return status_code_and_details(excinfo)


def sessions(d):
    return {(s.job, s.local_rank): s for s in d.status().sessions}


def test_attach_keepalive_detach(fsdpd):
    d = fsdpd()
    a = attach(d, rank=0)
    b = attach(d, rank=1)
    assert a.session_id != b.session_id and 0 not in (a.session_id, b.session_id)
    assert (a.protocol_version, a.lease_ms) == (PROTOCOL_VERSION, 30000)
    s = sessions(d)
    assert set(s) == {("job-1", 0), ("job-1", 1)}
    assert s[("job-1", 0)].session_id == a.session_id
    assert s[("job-1", 0)].pid == os.getpid()
    assert s[("job-1", 1)].local_world_size == 2

    reply = d.call(KEEPALIVE, trainer_pb2.KeepAliveRequest(session_id=a.session_id),
                   trainer_pb2.KeepAliveReply)
    assert reply.lease_ms == 30000
    d.call(DETACH, trainer_pb2.DetachRequest(session_id=a.session_id), trainer_pb2.DetachReply)
    assert set(sessions(d)) == {("job-1", 1)}
    # The rank is free again, and the old id is gone.
    c = attach(d, rank=0)
    assert c.session_id != a.session_id
    code, details = refused(d.call, DETACH, trainer_pb2.DetachRequest(session_id=a.session_id),
                            trainer_pb2.DetachReply)
    assert code == grpc.StatusCode.NOT_FOUND
    assert f"session {a.session_id:016x} is not attached" in details

    r = d.fsdpctl("status")
    assert f"{b.session_id:016x}" in r.stdout and "1/2" in r.stdout, r.stdout
    assert d.stop() == 0


@pytest.mark.parametrize("kwargs,code,text", [
    (dict(rank=2, world=2), grpc.StatusCode.INVALID_ARGUMENT,
     "field 'local_rank' = 2 is outside [0, 2) (local_world_size)"),
    (dict(world=0), grpc.StatusCode.INVALID_ARGUMENT,
     "field 'local_world_size' = 0 is outside [1, 256]"),
    (dict(world=257), grpc.StatusCode.INVALID_ARGUMENT,
     "field 'local_world_size' = 257 is outside [1, 256]"),
    (dict(job=""), grpc.StatusCode.INVALID_ARGUMENT,
     "field 'job' = '' must be 1 to 64 of [A-Za-z0-9._-]"),
    (dict(job="a/b"), grpc.StatusCode.INVALID_ARGUMENT,
     "field 'job' = 'a/b' must be 1 to 64 of [A-Za-z0-9._-]"),
    (dict(job="j" * 65), grpc.StatusCode.INVALID_ARGUMENT, "must be 1 to 64"),
    (dict(pid=0), grpc.StatusCode.INVALID_ARGUMENT, "field 'pid' = 0 must be the caller's"),
    (dict(pid=1), grpc.StatusCode.PERMISSION_DENIED,
     f"field 'pid' = 1, but the connection belongs to pid {os.getpid()}"),
    (dict(version=9), grpc.StatusCode.FAILED_PRECONDITION, "protocol_version 9"),
], ids=["rank-outside", "world-0", "world-257", "job-empty", "job-slash", "job-long", "pid-0",
        "foreign-pid", "version"])
def test_bad_attach(fsdpd, kwargs, code, text):
    d = fsdpd()
    got_code, details = refused(attach, d, **kwargs)
    assert got_code == code, details
    assert text in details
    assert ATTACH in details
    assert sessions(d) == {}
    d.assert_serving()


# Another process, talking to the daemon on its own connection: prints "CODE details".
_OTHER_PROCESS = r"""
import os, sys
sys.path.append(sys.argv[2]); sys.path.append(sys.argv[2] + "/grpc/health/v1")
import grpc
from fsdp.v1 import trainer_pb2 as t
ch = grpc.insecure_channel("unix:" + sys.argv[1])
what = sys.argv[3]
try:
    if what == "attach":
        call = ch.unary_unary("/fsdp.v1.Trainer/Attach",
                              request_serializer=t.AttachRequest.SerializeToString,
                              response_deserializer=t.AttachReply.FromString)
        r = call(t.AttachRequest(protocol_version=PROTOCOL_VERSION, job=sys.argv[4],
                                 local_rank=int(sys.argv[5]), local_world_size=int(sys.argv[6]),
                                 pid=os.getpid()), timeout=5)
        print("OK", r.session_id)
    else:
        call = ch.unary_unary("/fsdp.v1.Trainer/" + what,
                              request_serializer=t.DetachRequest.SerializeToString,
                              response_deserializer=t.DetachReply.FromString)
        call(t.DetachRequest(session_id=int(sys.argv[4])), timeout=5)
        print("OK")
except grpc.RpcError as e:
    print(e.code().name, e.details())
""".replace("PROTOCOL_VERSION", str(PROTOCOL_VERSION))


def other_process(d, *args):
    r = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(d.socket_path),
                        str(PYTHON_GEN), *map(str, args)], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_duplicate_rank_and_world_size_mismatch(fsdpd):
    d = fsdpd()
    a = attach(d, job="j", rank=1, world=4)
    # The same process attaching again (a lost reply, a retry) gets its session back.
    assert attach(d, job="j", rank=1, world=4).session_id == a.session_id
    out = other_process(d, "attach", "j", 1, 4)
    assert out.startswith("ALREADY_EXISTS "), out
    assert out.endswith(f"job 'j' local rank 1 is already attached "
                        f"(session {a.session_id:016x}, pid {os.getpid()})")
    code, details = refused(attach, d, job="j", rank=0, world=2)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "job 'j' has local_world_size 4 (local rank 1 attached with it), not 2" in details
    # Another job is independent.
    attach(d, job="k", rank=1, world=2)
    assert len(sessions(d)) == 2


@pytest.mark.parametrize("method", ["Detach", "KeepAlive"])
def test_only_the_owning_process_uses_a_session(fsdpd, method):
    """Session ids are visible to operators; another process cannot act with one."""
    d = fsdpd()
    a = attach(d, rank=0)
    out = other_process(d, method, a.session_id)
    assert out == (f"PERMISSION_DENIED /fsdp.v1.Trainer/{method}: session {a.session_id:016x} "
                   f"belongs to pid {os.getpid()}, not to the calling pid "
                   f"{out.rsplit(' ', 1)[-1]}"), out
    assert out.rsplit(" ", 1)[-1] != str(os.getpid())
    assert set(sessions(d)) == {("job-1", 0)}


def test_lease_ends_idle_sessions_and_keepalive_renews(fsdpd):
    d = fsdpd("--set", "session.lease=600ms", "--set", "daemon.housekeeping_interval=20ms")
    idle = attach(d, rank=0)
    kept = attach(d, rank=1)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        d.call(KEEPALIVE, trainer_pb2.KeepAliveRequest(session_id=kept.session_id),
               trainer_pb2.KeepAliveReply)
        time.sleep(0.1)
    assert set(sessions(d)) == {("job-1", 1)}
    assert f"session {idle.session_id:016x}" in d.stderr() and "session.lease" in d.stderr()
    code, details = refused(d.call, KEEPALIVE,
                            trainer_pb2.KeepAliveRequest(session_id=idle.session_id),
                            trainer_pb2.KeepAliveReply)
    assert code == grpc.StatusCode.NOT_FOUND
    # The expired rank can attach again.
    attach(d, rank=0)


def test_max_sessions(fsdpd):
    d = fsdpd("--set", "session.max_sessions=2")
    attach(d, rank=0)
    attach(d, rank=1)
    code, details = refused(attach, d, job="other", rank=0)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the daemon holds 2 sessions (session.max_sessions = 2)" in details


def test_draining_refuses_attach_and_keeps_sessions(fsdpd):
    d = fsdpd()
    attach(d, rank=0)
    assert d.fsdpctl("drain").returncode == 0
    code, details = refused(attach, d, rank=1)
    assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details
    assert set(sessions(d)) == {("job-1", 0)}
    assert d.fsdpctl("resume").returncode == 0
    attach(d, rank=1)
    assert d.stop(signal.SIGTERM) == 0


def test_a_rank_waiting_in_a_collective_outlives_a_shorter_lease(fsdpd):
    """The lease counts from the end of a session's last call: a rank parked in an Unshard
    for three leases, waiting for a slower rank, is alive and gets its unit; once its call
    has ended, the lease runs again."""
    d = fsdpd("--set", "session.lease=500ms", "--set", "daemon.housekeeping_interval=20ms",
              "--set", "store.collective_timeout=20s", "--set", "memory.job_limit=64MiB")
    fast, slow = Rank(d, 0, 2), Rank(d, 1, 2)
    layouts = [fast.register(), slow.register()]
    values = values_for(layouts[0].padded_numel, 5)
    for r, lay in zip((fast, slow), layouts):
        r.write_master_shard(lay, values)
    outcome = {}

    def unshard():
        try:
            fast.op("Unshard", step=1, timeout=30)
            outcome["fast"] = "OK"
        except grpc.RpcError as e:
            outcome["fast"] = f"{e.code().name} {e.details()}"
    t = threading.Thread(target=unshard)
    t.start()
    try:
        poll(lambda: any(s.local_rank == 0 and s.idle_ms == 0 for s in d.status().sessions)
             and d.call("/fsdp.v1.Operator/ListUnits", operator_pb2.ListUnitsRequest(),
                        operator_pb2.ListUnitsReply).units[0].collectives,
             5, what="rank 0's Unshard to wait for rank 1")
        # The slow rank computes for three leases, renewing its own lease as a trainer
        # between calls does; the fast one makes no call but the one it waits in.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            d.call(KEEPALIVE, trainer_pb2.KeepAliveRequest(session_id=slow.session),
                   trainer_pb2.KeepAliveReply)
            time.sleep(0.05)
        assert set(sessions(d)) == {("j", 0), ("j", 1)}
        slow.op("Unshard", step=1)
    finally:
        t.join(30)
    assert outcome == {"fast": "OK"}, (outcome, d.stderr())
    assert "session.lease" not in d.stderr()
    # The call is over: an idle session ends a lease later.
    poll(lambda: ("j", 0) not in sessions(d), 5, what="rank 0's lease to end")
    assert f"session {fast.session:016x}" in d.stderr()
