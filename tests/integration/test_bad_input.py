"""Bad input from clients: each gets the right gRPC status and a message that names the
problem, and the daemon still answers a health Check SERVING afterwards."""

import mmap
import os
import random
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from fsdpd_harness import (PROTOCOL_VERSION, SERVING, common_pb2, fsdpd,  # noqa: F401
                           operator_pb2, peer_pb2, poll, run_fsdpd, trainer_pb2)


# --- hand encoding, for bytes a well-behaved protobuf library refuses to produce ---------

def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_varint(number, value):
    return varint(number << 3 | 0) + varint(value)


def field_bytes(number, data):
    return varint(number << 3 | 2) + varint(len(data)) + data


def expect_error(d, path, payload, code, *fragments, tcp=False):
    """Sends payload to path; asserts the status code and that the details contain every
    fragment; then asserts the daemon still serves on that transport and on the unix socket.
    Returns the details."""
    with pytest.raises(grpc.RpcError) as e:
        d.raw_call(path, payload, tcp=tcp)
    details = e.value.details()
    assert e.value.code() == code, details
    for f in fragments:
        assert f in details, f"{f!r} not in {details!r}"
    d.assert_serving(tcp=tcp)
    d.assert_serving()
    return details


ATTACH = "/fsdp.v1.Trainer/Attach"
CHECK = "/grpc.health.v1.Health/Check"
STATUS = "/fsdp.v1.Operator/Status"


# --- malformed messages ------------------------------------------------------------------

def test_truncated_protobuf(fsdpd):
    d = fsdpd()
    whole = trainer_pb2.AttachRequest(protocol_version=PROTOCOL_VERSION, job="job-0", local_rank=3)
    data = whole.SerializeToString()[:-3]  # the job string's length now runs past the end
    expect_error(d, ATTACH, data, grpc.StatusCode.INVALID_ARGUMENT,
                 ATTACH, "malformed fsdp.v1.AttachRequest", f"{len(data)} bytes")


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_truncated_health_check(fsdpd, tcp):
    d = fsdpd()
    data = field_bytes(1, b"fsdp.v1.Trainer")[:-4]
    expect_error(d, CHECK, data, grpc.StatusCode.INVALID_ARGUMENT,
                 CHECK, "malformed grpc.health.v1.HealthCheckRequest", tcp=tcp)


def test_garbage_bytes_as_message(fsdpd):
    d = fsdpd()
    expect_error(d, STATUS, b"\xff\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT,
                 STATUS, "malformed fsdp.v1.StatusRequest", "4 bytes")


def test_invalid_enum_value(fsdpd):
    # Decoding refuses the enum before any handler or session lookup runs.
    d = fsdpd()
    # RegisterUnitRequest{session_id: 1, unit: "layer0", strategy: 99}
    data = field_varint(1, 1) + field_bytes(2, b"layer0") + field_varint(4, 99)
    expect_error(d, "/fsdp.v1.Trainer/RegisterUnit", data, grpc.StatusCode.INVALID_ARGUMENT,
                 "strategy", "99")


@pytest.mark.parametrize("bad", [b"\xc3\x28", b"\xff\xfe", b"\xed\xa0\x80", b"\xc0\xaf"],
                         ids=["bad-continuation", "ff-fe", "surrogate", "overlong"])
def test_invalid_utf8_in_string_field(fsdpd, bad):
    d = fsdpd()
    data = field_varint(1, PROTOCOL_VERSION) + field_bytes(2, b"job-" + bad)
    expect_error(d, ATTACH, data, grpc.StatusCode.INVALID_ARGUMENT,
                 ATTACH, "'job'", "UTF-8")


def test_invalid_utf8_in_health_check_over_tcp(fsdpd):
    d = fsdpd()
    expect_error(d, CHECK, field_bytes(1, b"fsdp.v1.\xffTrainer"),
                 grpc.StatusCode.INVALID_ARGUMENT, "'service'", "UTF-8", tcp=True)


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_nul_byte_in_string_field(fsdpd, tcp):
    # Read as a C string, "\0fsdp.v1.Nope" would be "" and answer SERVING.
    d = fsdpd()
    expect_error(d, CHECK, field_bytes(1, b"\x00fsdp.v1.Nope"), grpc.StatusCode.INVALID_ARGUMENT,
                 "field 'service' holds a NUL byte at offset 0", tcp=tcp)


# --- size limits -------------------------------------------------------------------------

def oversized_attach(total):
    """An AttachRequest of exactly `total` bytes on the wire (valid in every other way)."""
    head = field_varint(1, PROTOCOL_VERSION)
    for k in range(1, 11):  # k: the size of the string's length prefix
        n = total - len(head) - 1 - k
        if len(varint(n)) == k:
            return head + field_bytes(2, b"a" * n)
    raise AssertionError(total)


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_message_over_default_size_limit(fsdpd, tcp):
    d = fsdpd()
    size = (16 << 20) + 1
    if tcp:
        data = field_bytes(1, b"a" * (size - 5))
        path = CHECK
    else:
        data = oversized_attach(size)
        path = ATTACH
    details = expect_error(d, path, data, grpc.StatusCode.RESOURCE_EXHAUSTED, tcp=tcp)
    assert "max" in details, details
    assert str(len(data)) in details or "16MiB" in details, details


def test_message_over_lowered_size_limit(fsdpd):
    d = fsdpd("--set", "rpc.max_message_size=64KiB")
    entry = d.config_entry("rpc.max_message_size")
    assert (entry.value, entry.origin) == ("64KiB", "--set rpc.max_message_size")
    data = oversized_attach(64 * 1024 + 1)
    assert len(data) == 64 * 1024 + 1
    details = expect_error(d, ATTACH, data, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "max" in details, details
    # Exactly at the limit passes the size check and reaches the handler, which refuses the
    # 64 KiB job name on its own grounds.
    expect_error(d, ATTACH, oversized_attach(64 * 1024), grpc.StatusCode.INVALID_ARGUMENT,
                 "field 'job'", "must be 1 to 64")


# --- wrong addresses ---------------------------------------------------------------------

@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
@pytest.mark.parametrize("path", ["/fsdp.v1.Trainer/Nope", "/grpc.health.v1.Health/Nope",
                                  "/fsdp.v1.Nope/Status", "/nonsense"])
def test_unknown_method_or_service(fsdpd, path, tcp):
    d = fsdpd()
    expect_error(d, path, b"", grpc.StatusCode.UNIMPLEMENTED, f"unknown method '{path}'",
                 tcp=tcp)


# --- protocol versions -------------------------------------------------------------------

@pytest.mark.parametrize("path,request_,who", [
    (ATTACH, trainer_pb2.AttachRequest(protocol_version=PROTOCOL_VERSION + 1, job="j"),
     "trainer"),
    (ATTACH, trainer_pb2.AttachRequest(job="j"), "trainer"),
], ids=["attach-newer", "attach-0"])
def test_wrong_protocol_version(fsdpd, path, request_, who):
    d = fsdpd()
    details = expect_error(d, path, request_.SerializeToString(),
                           grpc.StatusCode.FAILED_PRECONDITION,
                           f"protocol_version {request_.protocol_version}",
                           f"protocol {PROTOCOL_VERSION}", who)
    assert path in details


@pytest.mark.parametrize("path,request_,code,text", [
    (ATTACH, trainer_pb2.AttachRequest(protocol_version=PROTOCOL_VERSION, job="j"),
     grpc.StatusCode.INVALID_ARGUMENT, "field 'local_world_size' = 0 is outside [1, 256]"),
], ids=["attach"])
def test_right_protocol_version_gets_past_the_gate(fsdpd, path, request_, code, text):
    d = fsdpd()
    expect_error(d, path, request_.SerializeToString(), code, text)


@pytest.mark.parametrize("path", ["/fsdp.v1.Peer/Join", "/fsdp.v1.Peer/Heartbeat",
                                  "/fsdp.v1.Peer/Leave"])
def test_peer_service_is_not_on_the_unix_socket(fsdpd, path):
    """Daemons talk on their peer port (with its token and TLS); the unix socket does not
    take a Join from anyone in the socket's group. The peer port's own checks, the protocol
    version gate included, are in test_peers."""
    d = fsdpd()
    join = peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION)
    expect_error(d, path, join.SerializeToString(),
                 grpc.StatusCode.UNIMPLEMENTED, f"unknown method '{path}' on the local endpoint")


# --- misbehaving connections -------------------------------------------------------------

def read_until_closed(sock, timeout):
    """Reads until EOF; True if the peer closed the connection within timeout seconds."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_garbage_byte_stream_on_the_socket(fsdpd, tcp):
    d = fsdpd()
    rng = random.Random(1234)
    for garbage in (bytes(rng.getrandbits(8) for _ in range(8192)),
                    b"GET / HTTP/1.1\r\nHost: fsdpd\r\n\r\n",
                    b"\x00" * 64):
        if tcp:
            s = socket.create_connection(("127.0.0.1", d.health_port), timeout=5)
        else:
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(d.socket_path))
        with s:
            try:
                s.sendall(garbage)
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert read_until_closed(s, 5), "the daemon kept a non-HTTP/2 connection open"
        d.assert_serving(tcp=tcp)
        d.assert_serving()


def test_connect_and_disconnect_without_a_request(fsdpd):
    d = fsdpd()
    for _ in range(50):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(d.socket_path))
        s.close()
        socket.create_connection(("127.0.0.1", d.health_port), timeout=5).close()
    d.assert_serving()
    d.assert_serving(tcp=True)


def test_idle_connections_do_not_block_others(fsdpd):
    d = fsdpd()
    idle = []
    try:
        for _ in range(20):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(d.socket_path))
            idle.append(s)
            idle.append(socket.create_connection(("127.0.0.1", d.health_port), timeout=5))
        d.assert_serving()
        d.assert_serving(tcp=True)
        assert d.status().state == operator_pb2.SERVING_STATE_SERVING
    finally:
        for s in idle:
            s.close()


def test_many_concurrent_calls_all_answered(fsdpd):
    d = fsdpd()
    n_threads, n_channels = 200, 20
    channels = [d.new_channel() for _ in range(n_channels)]
    barrier = threading.Barrier(n_threads)

    def one(i):
        barrier.wait(10)
        return d.call(STATUS, operator_pb2.StatusRequest(), operator_pb2.StatusReply,
                      channel=channels[i % n_channels], timeout=20)

    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(n_threads) as pool:
            replies = list(pool.map(one, range(n_threads)))
    finally:
        for ch in channels:
            ch.close()
    elapsed = time.monotonic() - t0
    assert len(replies) == n_threads
    assert all(r.pid == d.pid and r.version for r in replies)
    assert d.status().rpc_calls_total >= n_threads
    print(f"{n_threads} concurrent Status calls in {elapsed * 1000:.0f} ms")
    d.assert_serving()


def test_streams_beyond_max_streams_are_refused_and_checks_still_served(fsdpd):
    d = fsdpd("--set", "rpc.max_streams=2", "--set", "rpc.max_inflight_calls=2")
    watches = [d.watch(""), d.watch("fsdp.v1.Peer")]
    try:
        for w in watches:
            assert next(w).status == SERVING
        # Two parked Watch streams fill the streams' budget: a third is refused, not queued...
        with pytest.raises(grpc.RpcError) as e:
            next(d.watch("fsdp.v1.Trainer"))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already holds 2 streams (rpc.max_streams = 2)" in e.value.details()
        # ... while Checks and operators, on budgets of their own, are answered.
        for _ in range(8):
            assert d.check("") == SERVING
        assert d.status().version
    finally:
        for w in watches:
            w.cancel()


def test_watches_on_the_unix_socket_do_not_lock_out_trainers(fsdpd):
    """Watch streams held on the unix socket used to fill rpc.max_inflight_calls (1,024
    locked out every trainer): streams have a budget of their own."""
    d = fsdpd("--set", "rpc.max_inflight_calls=16")
    watches = [d.watch("") for _ in range(20)]
    try:
        for w in watches:
            assert next(w).status == SERVING
        reply = d.call("/fsdp.v1.Trainer/Attach", trainer_pb2.AttachRequest(
            protocol_version=PROTOCOL_VERSION, job="watched", local_rank=0, local_world_size=1,
            pid=os.getpid()), trainer_pb2.AttachReply)
        assert reply.session_id
        assert d.check("") == SERVING
    finally:
        for w in watches:
            w.cancel()


def test_health_port_cannot_use_up_the_unix_sockets_budget(fsdpd):
    """Anyone on the host reaches the TCP health port; Watch streams held open there fill only
    that endpoint's streams, while Checks there, and trainers and operators on the unix socket,
    are served (a scheduler must not see the node down because of other clients' streams)."""
    d = fsdpd("--set", "rpc.max_inflight_calls=4")
    watches = [d.watch("", tcp=True) for _ in range(64)]
    try:
        for w in watches:
            assert next(w).status == SERVING
        with pytest.raises(grpc.RpcError) as e:
            next(d.watch("", tcp=True))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the health endpoint already holds 64 streams (rpc.max_streams = 64)" \
            in e.value.details()
        for _ in range(8):
            assert d.check("", tcp=True) == SERVING
        assert d.status().version
        d.assert_serving()
    finally:
        for w in watches:
            w.cancel()


def test_watch_streams_on_connections_of_their_own_leave_room_for_probes(fsdpd):
    """Each Watch on a connection of its own: the streams' budget (rpc.max_streams) fills
    before the health port's connections (health.max_connections) do, so a probe on a new
    connection is still let in and answered."""
    d = fsdpd()
    channels = [d.new_channel(tcp=True) for _ in range(64)]
    watches = [d.watch("", channel=ch) for ch in channels]
    try:
        for w in watches:
            assert next(w).status == SERVING
        for _ in range(8):
            assert d.check_on_new_connection(tcp=True) == SERVING
    finally:
        for w in watches:
            w.cancel()
        for ch in channels:
            ch.close()


def test_health_connections_must_outnumber_the_streams():
    r = run_fsdpd("--check-config", "--set", "health.max_connections=64")
    assert r.returncode == 78, r.stdout + r.stderr
    assert "key 'health.max_connections': value 64 (from --set health.max_connections) must " \
        "exceed rpc.max_streams = 64 (the default)" in r.stderr, r.stderr


# --- steps ---------------------------------------------------------------------------------

class FastPath:
    """A session's fast path (proto/fastpath.h) driven by hand: one request at a time."""
    REQUEST, REPLY_BYTES = "<QQIBBBBH6x", 40 + 512  # fsdp_fast_request_t, _reply_t
    REQUESTS, REPLIES = 448, 448 + 64 * struct.calcsize(REQUEST)

    def __init__(self, welcome, fds):
        self.region = mmap.mmap(fds[welcome.fast_path.memory],
                                welcome.memories[welcome.fast_path.memory].bytes)
        self.bell = fds[3]
        self.seq = 0

    def op(self, kind, unit_id, step, backward=0, event=0):
        """kind: 1 Unshard, 3 ReduceScatter, 4 AllReduce; returns (code, message)."""
        head = struct.unpack_from("<I", self.region, 64)[0]
        struct.pack_into(self.REQUEST, self.region,
                         self.REQUESTS + head % 64 * struct.calcsize(self.REQUEST), self.seq,
                         step, unit_id, kind, backward, 0, 0, event)
        struct.pack_into("<I", self.region, 64, head + 1)
        os.write(self.bell, struct.pack("<Q", 1))
        tail = struct.unpack_from("<I", self.region, 256)[0]
        poll(lambda: struct.unpack_from("<I", self.region, 192)[0] != tail, 5, what="a reply")
        at = self.REPLIES + tail % 64 * self.REPLY_BYTES
        seq, code = struct.unpack_from("<Qi", self.region, at)
        message = self.region[at + 40:at + self.REPLY_BYTES].split(b"\0")[0].decode()
        struct.pack_into("<I", self.region, 256, tail + 1)
        assert seq == self.seq
        self.seq += 1
        return code, message


def test_a_step_far_ahead_is_refused_and_leaves_the_unit_working(fsdpd):
    """Issue 29 item 3: an Unshard of step 2^64 - 1 was accepted and then held the unit for
    the rest of the job (every later step was older than the one it held). Unshard,
    ReduceScatter and AllReduce, through gRPC and through the fast path, refuse a step more
    than 64 past the job's last one, naming the field, the value and the range; the unit then
    trains on, and the range follows the job's steps."""
    from test_memory_channel import attach, hello
    d = fsdpd()
    session = attach(d, 0, world=1).session_id
    s, welcome, fds = hello(str(d.run_dir / "fsdpd.mem.sock"), session)
    fast = FastPath(welcome, fds)
    ids = {}
    for unit, strategy in (("u", common_pb2.FULL_SHARD), ("n", common_pb2.NO_SHARD)):
        ids[unit] = d.call("/fsdp.v1.Trainer/RegisterUnit", trainer_pb2.RegisterUnitRequest(
            session_id=session, unit=unit, strategy=strategy, params=[
                trainer_pb2.ParamSpec(name="w", shape=[8], dtype=common_pb2.DTYPE_FP32,
                                      requires_grad=True)]), trainer_pb2.RegisterUnitReply).unit_id

    def op(name, unit="u", step=0, **fields):
        return d.call(f"/fsdp.v1.Trainer/{name}", trainer_pb2.UnitOpRequest(
            session_id=session, unit=unit, step=step, **fields), trainer_pb2.UnitOpReply)

    def refused(name, unit, step, last, **fields):
        expected = (f"unit '{unit}': field 'step' = {step} is outside [0, {last + 64}]: job 'j' "
                    f"is at step {last}, and an operation may name at most 64 steps past it")
        with pytest.raises(grpc.RpcError) as e:
            op(name, unit, step, **fields)
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE, e.value.details()
        assert expected in e.value.details()
        kind = {"Unshard": 1, "ReduceScatter": 3, "AllReduce": 4}[name]
        code, message = fast.op(kind, ids[unit], step, fields.get("backward", 0))
        assert code == -5008 and expected in message, (code, message)  # FSDP_E_OUT_OF_RANGE

    huge = 2 ** 64 - 1
    for name, unit, fields in (("Unshard", "u", {}), ("Unshard", "u", {"backward": True}),
                               ("ReduceScatter", "u", {}), ("AllReduce", "n", {})):
        refused(name, unit, huge, 0, **fields)
    refused("Unshard", "u", 65, 0)
    for step in (1, 2):  # the unit was not held
        op("Unshard", step=step)
        op("Unshard", step=step, backward=True)
        refused("ReduceScatter", "u", huge, step)
        op("ReduceScatter", step=step)
    refused("Unshard", "u", 67, 2)
    code, message = fast.op(1, ids["u"], 66)
    assert code == 0, message
    d.assert_serving()
    fast.region.close()
    for fd in fds:
        os.close(fd)
    s.close()


def test_a_cuda_event_the_session_lacks_is_refused_naming_it(fsdpd):
    """UnitOpRequest.event names one of the session's CUDA events, which only a job on a GPU
    has: on a host job any event is refused through gRPC and the fast path, naming the field
    and its value, and the unit trains on."""
    from test_memory_channel import attach, hello
    d = fsdpd()
    session = attach(d, 0, world=1).session_id
    s, welcome, fds = hello(str(d.run_dir / "fsdpd.mem.sock"), session)
    assert not welcome.cuda_events  # host memory: no events
    fast = FastPath(welcome, fds)
    unit_id = d.call("/fsdp.v1.Trainer/RegisterUnit", trainer_pb2.RegisterUnitRequest(
        session_id=session, unit="u", strategy=common_pb2.FULL_SHARD, params=[
            trainer_pb2.ParamSpec(name="w", shape=[8], dtype=common_pb2.DTYPE_FP32,
                                  requires_grad=True)]), trainer_pb2.RegisterUnitReply).unit_id
    for name, kind, event in (("Unshard", 1, 1), ("ReduceScatter", 3, 17), ("Reshard", 2, 65535)):
        expected = (f"event {event}: the session has no CUDA events (its job's memory is the "
                    "host's)")
        with pytest.raises(grpc.RpcError) as e:
            d.call(f"/fsdp.v1.Trainer/{name}", trainer_pb2.UnitOpRequest(
                session_id=session, unit="u", step=1, event=event), trainer_pb2.UnitOpReply)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert expected in e.value.details()
        code, message = fast.op(kind, unit_id, 1, event=event)
        assert code == -5001 and expected in message, (code, message)  # INVALID_ARGUMENT
    assert fast.op(1, unit_id, 1) == (0, "")  # the unit was not touched
    d.assert_serving()
    fast.region.close()
    for fd in fds:
        os.close(fd)
    s.close()
