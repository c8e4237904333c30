"""The memory channel through a real fsdpd: after Attach a trainer gets its job's arena as a
file descriptor (SCM_RIGHTS) and maps it; every rank of a job maps the same memory; the
connection is the session's lifeline, so a trainer killed with SIGKILL loses its session at
once; and every bad hello is answered with a status naming the problem."""

import fcntl
import json
import mmap
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

import grpc
import pytest

from fsdpd_harness import PROTOCOL_VERSION, PYTHON_GEN, fsdpd, poll, trainer_pb2  # noqa: F401
from fsdp.v1 import channel_pb2

FRAME = 4096
OK, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION = \
    0, 3, 5, 6, 7, 9
DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED = 4, 8


def attach(d, rank=0, world=2, job="j"):
    return d.call("/fsdp.v1.Trainer/Attach", trainer_pb2.AttachRequest(
        protocol_version=PROTOCOL_VERSION, job=job, local_rank=rank, local_world_size=world,
        pid=os.getpid()),
        trainer_pb2.AttachReply)


def frame(message_bytes):
    return struct.pack("<I", len(message_bytes)) + message_bytes + \
        b"\0" * (FRAME - 4 - len(message_bytes))


def hello(path, session_id, version=PROTOCOL_VERSION, raw=None):
    """Connects, says hello, returns (socket, ChannelWelcome, fds)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(path)
    s.send(raw if raw is not None else frame(
        channel_pb2.ChannelHello(protocol_version=version, session_id=session_id)
        .SerializeToString()))
    msg, fds, _, _ = socket.recv_fds(s, FRAME, 8)
    n = struct.unpack("<I", msg[:4])[0]
    return s, channel_pb2.ChannelWelcome.FromString(msg[4:4 + n]), fds


def closed_by_daemon(s, seconds=5):
    s.settimeout(seconds)
    return s.recv(FRAME) == b""


def sessions(d):
    return {(x.job, x.local_rank) for x in d.status().sessions}


def test_ranks_of_a_job_share_its_arena(fsdpd):
    d = fsdpd("--set", "memory.job_limit=64MiB")
    a, b = attach(d, 0), attach(d, 1)
    assert a.memory_socket == str(d.run_dir / "fsdpd.mem.sock")
    sa, wa, fa = hello(a.memory_socket, a.session_id)
    sb, wb, fb = hello(b.memory_socket, b.session_id)
    assert (wa.status, len(fa)) == (OK, 5)  # three memories, the fast path's two doorbells
    assert [(m.name, m.bytes, m.writable) for m in wa.memories[:2]] == [
        ("job 'j' arena", 64 << 20, True), ("job 'j' unsharded buffers", 64 << 20, False)]
    fast = wa.memories[wa.fast_path.memory]
    assert wa.fast_path.memory == 2 and fast.writable and fast.bytes % mmap.PAGESIZE == 0
    assert fast.name == f"session {a.session_id:016x} fast path"
    ma = mmap.mmap(fa[0], 64 << 20)
    mb = mmap.mmap(fb[0], 64 << 20)
    ma[12345:12350] = b"shard"
    assert mb[12345:12350] == b"shard"  # one memory, two mappings
    # The unsharded buffers come as a read-only descriptor and map read-only; the kernel
    # refuses a writable mapping, even of a read-write reopening and even as root (the seal).
    assert fcntl.fcntl(fa[1], fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    mmap.mmap(fa[1], 64 << 20, prot=mmap.PROT_READ)
    with pytest.raises(PermissionError):
        mmap.mmap(fa[1], 64 << 20)
    if os.geteuid() == 0:
        reopened = os.open(f"/proc/self/fd/{fa[1]}", os.O_RDWR)
        with pytest.raises(PermissionError):
            mmap.mmap(reopened, 64 << 20)
        os.close(reopened)
    # Another job gets memory of its own.
    c = attach(d, 0, job="other")
    _, wc, fc = hello(c.memory_socket, c.session_id)
    assert mmap.mmap(fc[0], wc.memories[0].bytes)[12345:12350] == b"\0" * 5
    # Nothing has a name in /dev/shm.
    assert not [n for n in os.listdir("/dev/shm") if "fsdp" in n]
    # Detach closes the channel from the daemon's side.
    d.call("/fsdp.v1.Trainer/Detach", trainer_pb2.DetachRequest(session_id=a.session_id),
           trainer_pb2.DetachReply)
    assert closed_by_daemon(sa)
    for f in fa + fb + fc:
        os.close(f)


_TRAINER = r"""
import os, socket, struct, sys, time
sys.path.append(sys.argv[2])
import grpc
from fsdp.v1 import trainer_pb2 as t, channel_pb2 as c
ch = grpc.insecure_channel("unix:" + sys.argv[1])
r = ch.unary_unary("/fsdp.v1.Trainer/Attach", request_serializer=t.AttachRequest.SerializeToString,
                   response_deserializer=t.AttachReply.FromString)(
    t.AttachRequest(protocol_version=PROTOCOL_VERSION, job="victim", local_rank=0,
                    local_world_size=1, pid=os.getpid()), timeout=5)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(r.memory_socket)
h = c.ChannelHello(protocol_version=PROTOCOL_VERSION, session_id=r.session_id).SerializeToString()
s.send(struct.pack("<I", len(h)) + h + b"\0" * (4092 - len(h)))
socket.recv_fds(s, 4096, 4)
print(r.session_id, flush=True)
time.sleep(60)
""".replace("PROTOCOL_VERSION", str(PROTOCOL_VERSION))


def test_a_forged_fast_path_cannot_hold_the_daemon(fsdpd):
    """The fast path's ring counters are in the trainer's memory. A trainer that claims two
    billion requests read up to a ring's worth per turn, for as long as it went on; now its
    fast path stops at the first look, with a warning saying why: its doorbell rung again
    wakes nothing, its session goes on through gRPC, and every other caller is served."""
    d = fsdpd()
    a = attach(d, 0, world=1)
    s, w, fds = hello(a.memory_socket, a.session_id)
    assert w.status == OK and w.fast_path.version == 3
    region = mmap.mmap(fds[w.fast_path.memory], w.memories[w.fast_path.memory].bytes)
    struct.pack_into("<I", region, 64, 1 << 31)  # the request ring's head
    os.write(fds[3], struct.pack("<Q", 1))         # the daemon's doorbell
    stopped = (f"session {a.session_id:016x} (job 'j' local rank 0): its fast path's request "
               "ring claims 2147483648 unread entries, more than its 64: the trainer forged "
               "its counters; its fast path stops (the session goes on through gRPC)")
    poll(lambda: stopped in d.stderr(), 5, what="the fast path stopped")
    for _ in range(1000):
        os.write(fds[3], struct.pack("<Q", 1))
    d.assert_serving()
    assert sessions(d)  # the session stays, on gRPC
    assert d.stderr().count(stopped) == 1
    assert struct.unpack_from("<I", region, 192)[0] == 0  # nothing was read, nor answered
    region.close()
    for fd in fds:
        os.close(fd)
    s.close()


def test_dropped_fast_path_replies_are_logged_once_with_their_count(fsdpd):
    """Replies that find no room in the ring (a trainer that says it read none) were logged
    one line each: tens of thousands of lines. Now the first is logged, and the count when
    the session ends."""
    from test_unshard import Rank
    d = fsdpd()
    a = attach(d, 0, world=2)
    s, w, fds = hello(a.memory_socket, a.session_id)
    other = Rank(d, 1, 2)
    unit_id = d.call("/fsdp.v1.Trainer/RegisterUnit", trainer_pb2.RegisterUnitRequest(
        session_id=a.session_id, unit="u", strategy=1, param_dtype=1,
        params=[trainer_pb2.ParamSpec(name="p0", shape=[37, 11], dtype=1)]),
        trainer_pb2.RegisterUnitReply).unit_id
    other.register()
    region = mmap.mmap(fds[w.fast_path.memory], w.memories[w.fast_path.memory].bytes)
    for seq in range(5):  # five Unshards of step 1, waiting for rank 1
        struct.pack_into("<QQIBBBBH6x", region, 448 + seq * 32, seq, 1, unit_id, 1, 0, 0, 0, 0)
    struct.pack_into("<I", region, 64, 5)
    os.write(fds[3], struct.pack("<Q", 1))
    poll(lambda: struct.unpack_from("<I", region, 128)[0] == 5, 5, what="the requests taken")
    struct.pack_into("<I", region, 256, (0 - 64) & 0xffffffff)  # "64 replies unread"
    other.op("Unshard", step=1)  # the gather runs: five replies find no room
    d.call("/fsdp.v1.Trainer/Detach", trainer_pb2.DetachRequest(session_id=a.session_id),
           trainer_pb2.DetachReply)
    log = d.stderr()
    assert log.count("fast path reply to") == 1, log
    assert (f"session {a.session_id:016x}: 5 fast path replies dropped in all: the trainer "
            "consumed none of them") in log
    d.assert_serving()
    region.close()
    for fd in fds:
        os.close(fd)
    s.close()


def test_a_killed_trainer_loses_its_session_at_once(fsdpd):
    d = fsdpd()  # the lease is 30 s: only the channel can end the session this soon
    p = subprocess.Popen([sys.executable, "-c", _TRAINER, str(d.socket_path), str(PYTHON_GEN)],
                         stdout=subprocess.PIPE, text=True)
    try:
        session_id = int(p.stdout.readline())
        assert sessions(d) == {("victim", 0)}
        t0 = time.monotonic()
        p.send_signal(signal.SIGKILL)
        poll(lambda: not sessions(d), 2, what="the killed trainer's session to end")
        elapsed = time.monotonic() - t0
        assert f"session {session_id:016x}" in d.stderr()
        assert "closed the memory channel (it exited or died)" in d.stderr()
        print(f"session ended {elapsed * 1000:.0f} ms after SIGKILL")
        # The rank can attach again, and the job kept its memory.
        attach(d, 0, world=1, job="victim")
    finally:
        p.kill()
        p.wait()


def test_bad_hellos(fsdpd):
    d = fsdpd()
    a = attach(d, 0)
    s, w, fds = hello(a.memory_socket, 0xDEAD)
    assert (w.status, fds) == (NOT_FOUND, [])
    assert "session 000000000000dead is not attached" in w.message
    assert closed_by_daemon(s)

    s, w, _ = hello(a.memory_socket, a.session_id, version=3)
    assert w.status == FAILED_PRECONDITION and "protocol_version 3" in w.message

    s, w, _ = hello(a.memory_socket, a.session_id, raw=b"short")
    assert w.status == INVALID_ARGUMENT and "frame of 5 bytes, expected 4096" in w.message

    s, w, _ = hello(a.memory_socket, a.session_id, raw=struct.pack("<I", 9999) + b"\0" * 4092)
    assert w.status == INVALID_ARGUMENT and "says 9999 bytes" in w.message

    first, w, fds = hello(a.memory_socket, a.session_id)
    assert w.status == OK
    s, w, _ = hello(a.memory_socket, a.session_id)
    assert w.status == ALREADY_EXISTS and "already has its memory channel" in w.message
    assert sessions(d) == {("j", 0)}  # a refused second channel changes nothing
    for fd in fds:
        os.close(fd)
    d.assert_serving()


def test_only_the_sessions_process_gets_its_memory(fsdpd):
    d = fsdpd()
    a = attach(d, 0)
    code = r"""
import socket, struct, sys
sys.path.append(sys.argv[3])
from fsdp.v1 import channel_pb2 as c
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); s.connect(sys.argv[1])
h = c.ChannelHello(protocol_version=PROTOCOL_VERSION,
                   session_id=int(sys.argv[2])).SerializeToString()
s.send(struct.pack("<I", len(h)) + h + b"\0" * (4092 - len(h)))
msg, fds, _, _ = socket.recv_fds(s, 4096, 4)
w = c.ChannelWelcome.FromString(msg[4:4 + struct.unpack("<I", msg[:4])[0]])
print(w.status, len(fds), w.message)
""".replace("PROTOCOL_VERSION", str(PROTOCOL_VERSION))
    r = subprocess.run([sys.executable, "-c", code, a.memory_socket, str(a.session_id),
                        str(PYTHON_GEN)], capture_output=True, text=True, timeout=30)
    status, n_fds, message = r.stdout.strip().split(" ", 2)
    assert (int(status), int(n_fds)) == (PERMISSION_DENIED, 0), r.stdout + r.stderr
    assert f"belongs to pid {os.getpid()}" in message


def welcome_of(s, seconds=8):
    """The ChannelWelcome the daemon sends on a connection it refuses, then its end."""
    s.settimeout(seconds)
    msg = s.recv(FRAME)
    n = struct.unpack("<I", msg[:4])[0]
    return channel_pb2.ChannelWelcome.FromString(msg[4:4 + n])


def test_silence_after_connecting_is_cut_off(fsdpd):
    d = fsdpd()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(str(d.run_dir / "fsdpd.mem.sock"))
    t0 = time.monotonic()
    w = welcome_of(s)
    assert (w.status, DEADLINE_EXCEEDED) == (DEADLINE_EXCEEDED, DEADLINE_EXCEEDED)
    assert "no hello within 5000 ms" in w.message
    assert closed_by_daemon(s, 8)
    assert 4.5 < time.monotonic() - t0 < 8
    assert "no hello within 5000 ms" in d.stderr()


def test_idle_connections_do_not_lock_out_trainers(fsdpd):
    """One group member holding many connections that never say hello (64 made every trainer
    start fail with only "connection reset") costs only its own: trainers still get their
    memory, and the idle ones are told why they are closed."""
    d = fsdpd("--set", "memory.job_limit=64MiB")
    path = str(d.run_dir / "fsdpd.mem.sock")
    idle = []
    try:
        for _ in range(100):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(path)
            idle.append(s)
        for rank in range(13):
            reply = attach(d, rank=rank, world=13, job="idle")
            s, w, fds = hello(path, reply.session_id)
            assert w.status == OK, w.message
            assert len(fds) >= 1
            for fd in fds:
                os.close(fd)
            idle.append(s)
        # The oldest silent ones were closed with a reason a client can show.
        w = welcome_of(idle[0], 2)
        assert w.status == RESOURCE_EXHAUSTED
        assert "sent no hello, to make room" in w.message
    finally:
        for s in idle:
            s.close()


def test_a_uid_holds_at_most_max_connections_per_uid_channels(fsdpd):
    """The memory channel counts each uid's connections against rpc.max_connections_per_uid,
    as the gRPC socket does: at the limit the oldest that has not said hello is closed for a
    newcomer, and when every one holds a session the newcomer is refused; both hear why."""
    d = fsdpd("--set", "rpc.max_connections_per_uid=2")
    path = str(d.run_dir / "fsdpd.mem.sock")
    bound = []
    try:
        s, w, fds = hello(path, attach(d, 0).session_id)
        bound.append(s)
        assert w.status == OK, w.message
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        idle.connect(path)
        s, w, fds2 = hello(path, attach(d, 1).session_id)
        bound.append(s)
        assert w.status == OK, w.message
        for fd in fds + fds2:
            os.close(fd)
        w = welcome_of(idle, 2)
        assert w.status == RESOURCE_EXHAUSTED
        assert "sent no hello, to make room" in w.message
        assert "rpc.max_connections_per_uid = 2" in w.message
        assert closed_by_daemon(idle)

        late = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        late.connect(path)
        w = welcome_of(late, 2)
        assert w.status == RESOURCE_EXHAUSTED
        assert "it holds 2 (rpc.max_connections_per_uid), none idle" in w.message
        assert closed_by_daemon(late)
        assert sessions(d) == {("j", 0), ("j", 1)}  # the sessions' channels stay
        d.assert_serving()
    finally:
        for s in bound:
            s.close()


_FOREIGN_CHANNEL = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(8)
s.connect(sys.argv[1])
print(s.recv(4096).hex())
"""


def test_a_uid_the_daemon_does_not_let_in_hears_why(fsdpd):
    """A process the memory channel does not let in gets a ChannelWelcome saying so, naming its
    uid and who may connect, as a refused caller of the gRPC socket hears in its calls, and
    the connection ends; the channel goes on serving."""
    if os.geteuid() != 0:
        pytest.skip("acting as another uid needs root")
    base = tempfile.mkdtemp(prefix="fsdpd-channel-")  # pytest's tmp_path is closed to others
    try:
        os.chmod(base, 0o755)
        d = fsdpd(run_dir=os.path.join(base, "run"))
        os.chmod(d.run_dir, 0o755)
        path = d.run_dir / "fsdpd.mem.sock"
        os.chmod(path, 0o666)  # only the daemon's own check stands in the way
        try:
            r = subprocess.run([getattr(sys, "_base_executable", sys.executable), "-c",
                                _FOREIGN_CHANNEL, str(path)], user=65534, group=65534,
                               extra_groups=[], capture_output=True, text=True, timeout=20,
                               cwd="/")
        except PermissionError as e:  # root in a user namespace that may not switch users
            pytest.skip(f"cannot run a process as uid 65534: {e}")
        assert r.returncode == 0, r.stderr
        msg = bytes.fromhex(r.stdout.strip())
        n = struct.unpack("<I", msg[:4])[0]
        w = channel_pb2.ChannelWelcome.FromString(msg[4:4 + n])
        assert w.status == PERMISSION_DENIED, w
        assert "uid 65534" in w.message and "may not use fsdpd" in w.message, w.message
        assert f"only root, uid {os.geteuid()}" in w.message, w.message
        assert "the memory channel" in w.message, w.message
        s, w, fds = hello(str(path), attach(d, 0).session_id)  # our own uid is served
        assert w.status == OK, w.message
        for fd in fds:
            os.close(fd)
        s.close()
        d.assert_serving()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_lease_end_closes_the_channel(fsdpd):
    d = fsdpd("--set", "session.lease=300ms", "--set", "daemon.housekeeping_interval=20ms")
    a = attach(d, 0)
    s, w, fds = hello(a.memory_socket, a.session_id)
    assert w.status == OK
    assert closed_by_daemon(s)
    assert not sessions(d)
    os.close(fds[0])


_HOG = r"""
import fcntl, json, mmap, os, socket, struct, sys
sys.path.append(sys.argv[2])
import grpc
from fsdp.v1 import trainer_pb2 as t, channel_pb2 as c
ch = grpc.insecure_channel("unix:" + sys.argv[1])
r = ch.unary_unary("/fsdp.v1.Trainer/Attach", request_serializer=t.AttachRequest.SerializeToString,
                   response_deserializer=t.AttachReply.FromString)(
    t.AttachRequest(protocol_version=PROTOCOL_VERSION, job="hog", local_rank=int(sys.argv[3]),
                    local_world_size=3, pid=os.getpid()), timeout=5)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(r.memory_socket)
h = c.ChannelHello(protocol_version=PROTOCOL_VERSION, session_id=r.session_id).SerializeToString()
s.send(struct.pack("<I", len(h)) + h + b"\0" * (4092 - len(h)))
msg, fds, _, _ = socket.recv_fds(s, 4096, 8)
rw, ro, fast = fds[:3]
w = c.ChannelWelcome.FromString(msg[4:4 + struct.unpack("<I", msg[:4])[0]])
size = w.memories[0].bytes
out = {"ro_mode": fcntl.fcntl(ro, fcntl.F_GETFL) & os.O_ACCMODE, "refused": []}
# Everything a trainer can try to make host memory out of its descriptors.
attempts = {
    "fallocate arena": lambda: os.posix_fallocate(rw, 0, size),
    "grow arena": lambda: os.ftruncate(rw, 64 * size),
    "fallocate arena past its end": lambda: os.posix_fallocate(rw, size, size),
    "write past the end": lambda: os.pwrite(rw, b"x", 16 * size),
    "fallocate unsharded": lambda: os.posix_fallocate(ro, 0, size),
    "grow unsharded": lambda: os.ftruncate(ro, 64 * size),
    "map unsharded writable": lambda: mmap.mmap(ro, size),
    "grow fast path": lambda: os.ftruncate(fast, 64 * size),
    "fallocate fast path past its end": lambda: os.posix_fallocate(fast, size, size),
}
for what, attempt in attempts.items():
    try:
        attempt()
    except OSError:
        out["refused"].append(what)
# Read faults allocate shmem pages too: touch every page of the read-only mapping.
m = mmap.mmap(ro, size, prot=mmap.PROT_READ)
sum(m[i] for i in range(0, size, 4096))
out["inodes"] = [os.fstat(fd).st_ino for fd in (rw, ro)]
out["bytes"] = [os.fstat(fd).st_blocks * 512 for fd in (rw, ro)]
print(json.dumps(out), flush=True)
sys.stdin.readline()
""".replace("PROTOCOL_VERSION", str(PROTOCOL_VERSION))


def test_memory_limit_bounds_what_trainers_can_make_resident(fsdpd):
    """Issue 10 finding 9: trainers hold descriptors to their job's arenas and fallocate,
    grow, write and touch them. The host memory they can make is each arena's sealed size,
    and those sizes are what memory.limit bounds: a second job that would pass it is refused
    naming the job, its arenas, what is reserved and the limit, and gets the room once the
    first job's trainers are gone. A holder that outlives the job keeps none of the
    read-write arena's pages."""
    limit = 128 << 20
    d = fsdpd("--set", "memory.job_limit=64MiB", "--set", f"memory.limit={limit}B")
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG, str(d.socket_path), str(PYTHON_GEN),
                              str(rank)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True) for rank in (0, 1)]
    try:
        seen = [json.loads(p.stdout.readline()) for p in hogs]
        for s in seen:
            assert s["ro_mode"] == os.O_RDONLY
            assert s["refused"] == ["grow arena", "fallocate arena past its end",
                                    "write past the end", "fallocate unsharded",
                                    "grow unsharded", "map unsharded writable",
                                    "grow fast path", "fallocate fast path past its end"]
        # Both trainers hold the same two memfds, filled whole, and no more than the limit.
        assert seen[0]["inodes"] == seen[1]["inodes"]
        assert seen[0]["bytes"] == seen[1]["bytes"] == [64 << 20, 64 << 20]
        assert sum(seen[0]["bytes"]) <= limit
        memory = d.status().memory
        assert (memory.reserved_bytes, memory.limit_bytes) == (limit, limit)

        # A third rank of the job (this process) holds the read-write arena past the end.
        keeper = attach(d, 2, world=3, job="hog")
        _, w, keeper_fds = hello(keeper.memory_socket, keeper.session_id)
        assert w.status == OK
        rw = keeper_fds[0]
        for fd in keeper_fds[1:]:
            os.close(fd)
        d.call("/fsdp.v1.Trainer/Detach", trainer_pb2.DetachRequest(session_id=keeper.session_id),
               trainer_pb2.DetachReply)

        other = attach(d, 0, world=1, job="second")
        _, w, fds = hello(other.memory_socket, other.session_id)
        assert (w.status, fds) == (RESOURCE_EXHAUSTED, [])
        assert w.message == ("job 'second': its two arenas of 64MiB (memory.job_limit) need "
                             "128MiB, but 128MiB of memory.limit = 128MiB is reserved by 1 job "
                             "in use")
        assert [j.job for j in d.status().jobs] == ["hog"]
    finally:
        for p in hogs:
            p.stdin.close()
            p.wait(10)
    poll(lambda: sessions(d) == {("second", 0)}, 5, what="the trainers' sessions to end")
    _, w, fds = hello(other.memory_socket, other.session_id)
    assert w.status == OK
    assert [j.job for j in d.status().jobs] == ["second"]
    assert "job 'hog': retained with no session, but job 'second' needs the room" in d.stderr()
    assert d.status().memory.reserved_bytes == limit
    assert os.fstat(rw).st_blocks == 0  # punched out when the job was freed
    for f in fds + [rw]:
        os.close(f)
