"""Floods a local user can send at fsdpd, shared by tests/integration/test_floods.py (which
checks that the daemon keeps serving through them) and bench/flood_bench.py (which measures
its callers' latency under them). Each flood is a function flood(stop) that runs in a thread
of its own until time.monotonic() reaches stop, bounded in count too, over loopback or the
daemon's unix sockets only."""

import socket
import time

import grpc

import h2raw


def rapid_reset_flood(address, method, sent):
    """HEADERS, an empty message and RST_STREAM, 100 streams a burst on one connection, and
    again on a new one when it is cut; sent[0] counts streams, sent[1] connections."""
    headers = h2raw.grpc_headers(method)

    def flood(stop):
        while time.monotonic() < stop and sent[0] < 2_000_000:
            s = None
            try:
                s = h2raw.connect(address, timeout=1)
                sent[1] += 1
                sid = 1
                while time.monotonic() < stop:
                    burst = b"".join(
                        h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, i, headers) +
                        h2raw.frame(h2raw.DATA, h2raw.END_STREAM, i, h2raw.grpc_message(b"")) +
                        h2raw.frame(h2raw.RST_STREAM, 0, i, h2raw.CANCEL.to_bytes(4, "big"))
                        for i in range(sid, sid + 200, 2))
                    s.sendall(burst)
                    sid += 200
                    sent[0] += 100
            except OSError:
                pass
            finally:
                if s:
                    s.close()
    return flood


def repeated_call_flood(d, path, payload, codes, count, timeout, tcp=False):
    """The same raw request, count times at most, one after the other on a channel of its
    own; codes collects each call's grpc.StatusCode."""
    def flood(stop):
        ch = d.new_channel(tcp=tcp)
        try:
            for _ in range(count):
                if time.monotonic() >= stop:
                    break
                try:
                    d.raw_call(path, payload, channel=ch, timeout=timeout)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())
        finally:
            ch.close()
    return flood


def half_headers(method="/grpc.health.v1.Health/Check"):
    """The first 20 bytes of a HEADERS frame: a request that never gets its end."""
    return h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, 1, h2raw.grpc_headers(method))[:20]


def open_connections(address, n, send=b"", into=None):
    """n connections that sent the HTTP/2 preface and SETTINGS, then `send`, appended to into
    (a list; the caller closes them); a connection the daemon cut is not waited for."""
    into = [] if into is None else into
    for _ in range(n):
        s = h2raw.connect(address)
        into.append(s)
        if send:
            try:
                s.sendall(send)
            except OSError:
                pass
    return into


def held_connections_flood(targets, send):
    """Opens, for each (address, n) of targets, n connections that sent `send` and nothing
    more, and holds them until stop."""
    def flood(stop):
        held = []
        try:
            for address, n in targets:
                open_connections(address, n, send, held)
            time.sleep(max(0.0, stop - time.monotonic()))
        finally:
            for s in held:
                s.close()
    return flood


def watch_flood(d, n, tcp=True, refused=None):
    """n health Watch streams held open on one channel (past rpc.max_streams the daemon
    refuses them: refused counts those)."""
    def flood(stop):
        ch = d.new_channel(tcp=tcp)
        watches = []
        try:
            for _ in range(n):
                w = d.watch("", channel=ch, timeout=max(1.0, stop - time.monotonic() + 5))
                watches.append(w)
                try:
                    next(w)
                except grpc.RpcError:
                    if refused is not None:
                        refused[0] += 1
            time.sleep(max(0.0, stop - time.monotonic()))
        finally:
            for w in watches:
                w.cancel()
            ch.close()
    return flood


def silent_memory_connections_flood(path, n):
    """n connections to the memory channel's socket that never send their hello, held until
    stop (the daemon closes the oldest for newcomers)."""
    def flood(stop):
        held = []
        try:
            for _ in range(n):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                held.append(s)
                try:
                    s.connect(path)
                except OSError:
                    pass
            time.sleep(max(0.0, stop - time.monotonic()))
        finally:
            for s in held:
                s.close()
    return flood


# A trainer misusing its fast path (proto/fastpath.h), as a process of its own (a Python loop
# in a thread would hold the GIL the probes need): it attaches to a job of its own, opens its
# memory channel and then, for `seconds`, either claims 2^31 requests in its ring while it
# consumes every reply ("counters"), or rings the daemon's doorbell in a loop ("doorbell"),
# attaching again whenever the daemon closes the channel. It prints its sessions and rings at
# the end.
_FAST_PATH_ABUSER = r"""
import mmap, os, select, socket, struct, sys, time
sys.path.append(sys.argv[2])
import grpc
from fsdp.v1 import trainer_pb2 as t, channel_pb2 as c
sock_path, mode, seconds, version = sys.argv[1], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
stop = time.monotonic() + seconds
ch = grpc.insecure_channel("unix:" + sock_path)
attach = ch.unary_unary("/fsdp.v1.Trainer/Attach",
                        request_serializer=t.AttachRequest.SerializeToString,
                        response_deserializer=t.AttachReply.FromString)
sessions = rings = 0
while time.monotonic() < stop:
    try:
        r = attach(t.AttachRequest(protocol_version=version, job="abuser", local_rank=0,
                                   local_world_size=1, pid=os.getpid()), timeout=5)
    except grpc.RpcError:
        time.sleep(0.01)
        continue
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(r.memory_socket)
    h = c.ChannelHello(protocol_version=version, session_id=r.session_id).SerializeToString()
    s.send(struct.pack("<I", len(h)) + h + b"\0" * (4092 - len(h)))
    msg, fds, _, _ = socket.recv_fds(s, 4096, 8)
    w = c.ChannelWelcome.FromString(msg[4:4 + struct.unpack("<I", msg[:4])[0]])
    region = mmap.mmap(fds[w.fast_path.memory], w.memories[w.fast_path.memory].bytes)
    bell = fds[3]
    sessions += 1
    one = struct.pack("<Q", 1)
    n = 0
    while time.monotonic() < stop:
        if mode == "counters":
            tail = struct.unpack_from("<I", region, 128)[0]
            struct.pack_into("<I", region, 64, (tail + (1 << 31)) & 0xffffffff)
            struct.pack_into("<I", region, 256, struct.unpack_from("<I", region, 192)[0])
            if not struct.unpack_from("<I", region, 320)[0]:
                os.write(bell, one)
                rings += 1
        else:
            os.write(bell, one)
            rings += 1
        n += 1
        if n % 256 == 0 and select.select([s], [], [], 0)[0]:
            break  # the daemon ended the session
    region.close()
    for fd in fds:
        os.close(fd)
    s.close()
print(sessions, rings, flush=True)
"""


def fast_path_abuse_flood(d, mode, result=None):
    """A flood(stop) running _FAST_PATH_ABUSER against daemon d in `mode` ("counters" or
    "doorbell"); result, a list, receives (sessions, rings)."""
    import subprocess
    import sys

    from fsdpd_harness import PROTOCOL_VERSION, PYTHON_GEN

    def flood(stop):
        seconds = max(0.0, stop - time.monotonic())
        p = subprocess.run([sys.executable, "-c", _FAST_PATH_ABUSER, str(d.socket_path),
                            str(PYTHON_GEN), mode, str(seconds), str(PROTOCOL_VERSION)],
                           capture_output=True, text=True, timeout=seconds + 30)
        if result is not None and p.stdout.split():
            result.append(tuple(int(x) for x in p.stdout.split()))
    return flood
