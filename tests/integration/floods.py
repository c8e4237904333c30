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
