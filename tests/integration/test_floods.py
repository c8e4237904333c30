"""Floods a local user can send, through real sockets against a real fsdpd: HTTP/2 rapid
reset on the health port and on a token-protected peer port, idle connections, oversized
requests. Each checks that probes and the unix socket's callers keep being answered within
their deadlines while it runs, that the daemon's memory (VmRSS) stays bounded, that it serves
after, and what it logs. How long those calls take under each flood, against the same calls
without it, is measured by bench/flood_bench.py (results in docs/PERFORMANCE.md), not here:
the floods themselves are in floods.py, shared with that bench."""

import os
import resource
import socket
import threading
import time

import grpc
import pytest

import h2raw
from floods import (fast_path_abuse_flood, half_headers, open_connections, rapid_reset_flood,
                    repeated_call_flood)
from fsdpd_harness import SERVING, fsdpd, health_pb2, poll, trainer_pb2  # noqa: F401
from test_peers import Cluster, peers, token_args, wait_all_joined

RSS_GROWTH_MAX_MB = 200
# Under AddressSanitizer freed memory waits in a quarantine (256 MB by default) before it is
# reused: a small one keeps VmRSS a measure of what the daemon holds.
DAEMON_ENV = {"ASAN_OPTIONS": ":".join(
    o for o in (os.environ.get("ASAN_OPTIONS", ""), "quarantine_size_mb=16") if o)}


def under_flood(d, flood, seconds, tcp_probes=True):
    """Runs flood(stop_time) (one of floods.py's) in a thread while calling Status on the unix
    socket and Check on the health port, one after the other (2 s deadline each); returns
    (probe failures, peak VmRSS in MB)."""
    stop = time.monotonic() + seconds
    t = threading.Thread(target=flood, args=(stop,), daemon=True)
    t.start()
    failures, peak = [], d.rss_mb()
    while time.monotonic() < stop:
        try:
            d.status(timeout=2)
            if tcp_probes:
                assert d.check("", tcp=True, timeout=2) == SERVING
        except grpc.RpcError as e:
            failures.append((e.code(), e.details()))
        peak = max(peak, d.rss_mb())
        time.sleep(0.02)
    t.join(10)
    return failures, peak


def assert_kept_serving(d, failures, peak, rss_before):
    assert not failures, f"probes failed during the flood: {failures}"
    assert peak - rss_before < RSS_GROWTH_MAX_MB, \
        f"VmRSS grew from {rss_before:.0f} MB to {peak:.0f} MB"
    d.assert_serving()
    d.assert_serving(tcp=True)


def test_rapid_reset_on_the_health_port(fsdpd):
    """HEADERS then RST_STREAM, over and over on one connection (and again on a new one when
    it is cut), no credentials needed: the daemon cuts each such connection, its memory stays
    bounded and callers are answered within their deadlines."""
    d = fsdpd(env=DAEMON_ENV)
    rss_before = d.rss_mb()
    sent = [0, 0]
    flood = rapid_reset_flood((d.health_host, d.health_port), "/grpc.health.v1.Health/Check", sent)
    failures, peak = under_flood(d, flood, 4)
    print(f"{sent[0]} reset streams on {sent[1]} connections; VmRSS {rss_before:.0f} -> "
          f"{peak:.0f} MB")
    assert_kept_serving(d, failures, peak, rss_before)
    assert "more streams reset within 10 s than the port allows (HTTP/2 rapid reset)" \
        in d.stderr()


def test_rapid_reset_on_a_token_protected_peer_port(fsdpd, tmp_path):
    """The same flood on the peer port of two hosts that peer with a token, from a client
    that has none: gRPC makes a call of every stream before the token is checked. The daemon
    cuts each such connection, naming where it came from; both hosts stay JOINED at their
    incarnations (neither is ever LOST), heartbeats go on, and memory stays bounded."""
    c = Cluster(fsdpd, 2, extra=token_args(tmp_path), env=DAEMON_ENV)
    wait_all_joined(c)
    d0, d1 = c.daemons
    inc = [peers(d)["incarnation"] for d in c.daemons]
    rss_before = d0.rss_mb()
    sent = [0, 0]
    flood = rapid_reset_flood(("127.0.0.1", c.ports[0]), "/fsdp.v1.Peer/Heartbeat", sent)
    failures, peak = under_flood(d0, flood, 10)
    print(f"{sent[0]} reset streams on {sent[1]} connections; VmRSS {rss_before:.0f} -> "
          f"{peak:.0f} MB")
    assert_kept_serving(d0, failures, peak, rss_before)
    assert "peer port: closed the connection from ipv4:127.0.0.1:" in d0.stderr()
    # A connection whose calls never carried the token is cut at its ninth reset, not at the
    # 402nd that a peer's own channel may reach.
    assert "more streams reset within 10 s than the port allows (HTTP/2 rapid reset) " \
        "(9, at most 8)" in d0.stderr()
    # Heartbeats (every 100 ms) were answered throughout and still are.
    for d, other in ((d0, 1), (d1, 0)):
        row = poll(lambda: next((p for p in peers(d)["peers"] if p["host_rank"] == other and
                                 p["state"] == "JOINED" and p["last_heard_ms"] < 500), None),
                   5.0, what=f"host {other} JOINED and heard from: {peers(d)}")
        assert row["incarnation"] == inc[other]
    for d, other in ((d0, 1), (d1, 0)):
        log = d.stderr()
        assert f"host {other} (127.0.0.1:{c.ports[other]}) is " not in log, log[-4000:]
        assert log.count(f"host {other} (127.0.0.1:{c.ports[other]}) joined") == 1, log[-4000:]


def connections_to(pid, port):
    """The inodes of process pid's TCP sockets connected to 127.0.0.1:port."""
    mine = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(int(target[8:-1]))
    found = set()
    for table in ("tcp", "tcp6"):  # gRPC's client sockets are dual-stack
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                remote, inode = cols[2], int(cols[9])
                if int(remote.split(":")[1], 16) == port and inode in mine:
                    found.add(inode)
    return found


def test_newcomers_never_displace_the_peers_own_connections(fsdpd, tmp_path):
    """Connections that prove nothing (the preface only), from anyone who reaches a
    token-protected peer port, fill its connection limit over and over: each displaces the
    oldest idle one, but never a peer's own channel, idle between heartbeats as it is."""
    c = Cluster(fsdpd, 2, extra=token_args(tmp_path), env=DAEMON_ENV)
    wait_all_joined(c)
    d0, d1 = c.daemons
    # Host 1's channel to host 0's peer port has carried its Joins and heartbeats.
    channel = poll(lambda: connections_to(d1.pid, c.ports[0]), 5.0,
                   what="host 1's connection to host 0's peer port")
    newcomers = []
    try:
        for _ in range(100):  # the port holds 2 x 2 hosts + 16
            newcomers.append(h2raw.connect(("127.0.0.1", c.ports[0])))
        poll(lambda: d0.stderr().count(f"{c.ports[0]}: closed an idle connection") >= 50, 5.0,
             what="newcomers displacing idle newcomers")
        assert channel <= connections_to(d1.pid, c.ports[0]), d0.stderr()[-4000:]
        log = d1.stderr()
        assert log.count(f"host 0 (127.0.0.1:{c.ports[0]}) joined") == 1, log[-4000:]
    finally:
        for s in newcomers:
            s.close()


def raise_own_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def test_a_probers_open_connection_is_displaced_last(fsdpd):
    """A prober keeps its connection to the health port open between Checks; 200 newcomers
    that send only the preface pass the port's 128 connections: they displace each other,
    not the prober's connection, which has carried a call."""
    d = fsdpd(env=DAEMON_ENV)
    address = (d.health_host, d.health_port)
    prober = h2raw.connect(address)
    check = h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, 1,
                        h2raw.grpc_headers("/grpc.health.v1.Health/Check")) + \
        h2raw.frame(h2raw.DATA, h2raw.END_STREAM, 1, h2raw.grpc_message(b""))
    newcomers = []
    try:
        prober.sendall(check)
        frames, closed = h2raw.read_frames(prober, timeout=0.5)
        assert not closed and any(f[0] == h2raw.HEADERS and f[2] == 1 for f in frames), frames
        newcomers = open_connections(address, 200)
        poll(lambda: d.stderr().count("closed an idle connection") >= 60, 5.0,
             what="newcomers displacing each other")
        frames, closed = h2raw.read_frames(prober, timeout=0.5)
        assert not closed, d.stderr()[-3000:]
    finally:
        prober.close()
        for s in newcomers:
            s.close()


def test_idle_connections_do_not_lock_out_trainers_or_probes(fsdpd):
    """1,100 connections from one user that sent the HTTP/2 preface and half a HEADERS frame
    (1,024 descriptors blocked every new caller): the daemon raised its descriptor limit, and
    at its per-uid limit closes that user's oldest idle connection for a new one."""
    if raise_own_fd_limit() < 2400:
        pytest.skip("this test needs 2,400 descriptors of its own")
    d = fsdpd(env=DAEMON_ENV)  # rpc.max_connections_per_uid = 512, health.max_connections = 128
    rss_before = d.rss_mb()
    idle = []
    try:
        open_connections(str(d.socket_path), 1100, half_headers(), idle)
        open_connections((d.health_host, d.health_port), 200, into=idle)
        # Every new caller gets in, on a connection of its own, within its deadline.
        for _ in range(5):
            for tcp in (False, True):
                assert d.check_on_new_connection(tcp=tcp) == SERVING
        assert d.rss_mb() - rss_before < RSS_GROWTH_MAX_MB
        assert "closed an idle connection" in d.stderr()
    finally:
        for s in idle:
            s.close()


def test_requests_that_never_finish_do_not_lock_out_probes_or_trainers(fsdpd):
    """Connections whose only stream sent its HEADERS and never its message (a call gRPC
    holds open for ever, unless its deadline ends it) fill one uid's and the health port's
    connection limits (600 > 512, 200 > 128): new probes and callers still get in, within their deadlines."""
    if raise_own_fd_limit() < 1400:
        pytest.skip("this test needs 1,400 descriptors of its own")
    d = fsdpd(env=DAEMON_ENV)  # rpc.max_connections_per_uid = 512, health.max_connections = 128
    headers = h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, 1,
                          h2raw.grpc_headers("/grpc.health.v1.Health/Check"))
    held = []
    try:
        for address, n in ((str(d.socket_path), 600), ((d.health_host, d.health_port), 200)):
            open_connections(address, n, headers, held)
        for _ in range(5):
            for tcp in (False, True):
                assert d.check_on_new_connection(tcp=tcp) == SERVING
    finally:
        for s in held:
            s.close()


def test_descriptor_limit_is_raised_at_start(fsdpd):
    """The soft limit (1,024 by default) let only 251 of 256 trainers start: the daemon raises
    it to the hard limit."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip("the hard descriptor limit is too low to lower the soft one below it")
    d = fsdpd(prefix=("prlimit", "--nofile=256:", "--"))
    with open(f"/proc/{d.pid}/limits") as f:
        line = next(l for l in f if l.startswith("Max open files"))
    soft, hard_seen = line.split()[3:5]
    assert soft == hard_seen, line
    # A hard limit below what the configured limits need is named, with what they need.
    if hard == resource.RLIM_INFINITY or hard > 512:
        low = fsdpd(prefix=("prlimit", "--nofile=256:512", "--"), name="low")
        assert "the descriptor limit is 512 (hard limit 512) but the configured limits need " \
            "about" in low.stderr()
        assert "raise LimitNOFILE or lower them" in low.stderr()


def test_large_health_checks_do_not_slow_trainers(fsdpd):
    """16 MiB health Checks from anyone on the host: refused before gRPC buffers them on the
    health port, and before they are decoded on the unix socket, naming size and limit."""
    d = fsdpd(env=DAEMON_ENV)
    big = health_pb2.HealthCheckRequest(service="x" * ((16 << 20) - 64))
    with pytest.raises(grpc.RpcError) as e:
        d.call("/grpc.health.v1.Health/Check", big, health_pb2.HealthCheckResponse)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than the 1024 bytes this method takes" in e.value.details()
    rss_before = d.rss_mb()
    codes = []
    flood = repeated_call_flood(d, "/grpc.health.v1.Health/Check", big.SerializeToString(),
                                codes, 1000, 2, tcp=True)
    failures, peak = under_flood(d, flood, 4)
    assert codes and set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert_kept_serving(d, failures, peak, rss_before)


@pytest.mark.parametrize("field,path", [(b"\x1a\x00", "params[393216]"), (b"\x78\x00", "#15")],
                         ids=["empty-params", "unknown-field"])
def test_request_of_millions_of_fields_is_refused_before_unpacking(fsdpd, field, path):
    """A RegisterUnit of 8.4 M empty parameter entries, or of 8.4 M copies of a field the
    message does not know (protobuf-c keeps each), no session needed (7 s of loop time and
    0.9 GB; 1 s and 0.5 GB): refused by the count of fields before anything is unpacked."""
    d = fsdpd(env=DAEMON_ENV)
    rss_before = d.rss_mb()
    payload = field * ((16 << 20) // 2 - 64)  # a 2-byte field, over and over
    with pytest.raises(grpc.RpcError) as e:
        d.raw_call("/fsdp.v1.Trainer/RegisterUnit", payload, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"field '{path}'" in e.value.details()
    # RegisterUnit's budget: 65,536 fields and five for each of 65,536 parameters.
    assert "more than 393216 fields" in e.value.details()
    assert "/fsdp.v1.Trainer/RegisterUnit" in e.value.details()

    codes = []
    flood = repeated_call_flood(d, "/fsdp.v1.Trainer/RegisterUnit", payload, codes, 20, 10)
    failures, peak = under_flood(d, flood, 4)
    assert codes and set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert_kept_serving(d, failures, peak, rss_before)


def test_silent_and_half_sent_connections_are_closed_when_idle(fsdpd):
    """Connections that sent nothing, only the HTTP/2 preface, or half a HEADERS frame were
    never closed: rpc.idle_timeout closes them, on the unix socket and the health port."""
    d = fsdpd("--set", "rpc.idle_timeout=1s", env=DAEMON_ENV)
    half = half_headers()
    socks = []
    for address in (str(d.socket_path), (d.health_host, d.health_port)):
        bare = socket.socket(socket.AF_UNIX if isinstance(address, str) else socket.AF_INET)
        bare.connect(address)
        socks.append(bare)
        socks.append(h2raw.connect(address, settings=False))
        socks.append(h2raw.connect(address))
        socks.append(h2raw.connect(address))
        socks[-1].sendall(half)
    try:
        deadline = time.monotonic() + 10
        for s in socks:
            closed = False
            while not closed and time.monotonic() < deadline:
                closed = h2raw.read_frames(s, timeout=0.5)[1]
            assert closed, "an idle connection was still open 10 s after connecting"
        # The harness's own channels sat idle as long: closed too, maybe just as a call would
        # go out on one (a broken pipe), so the checks that the daemon serves take new ones.
        d.close_channels()
        d.assert_serving()
        d.assert_serving(tcp=True)
    finally:
        for s in socks:
            s.close()


def test_join_of_millions_of_entries_is_refused_before_decoding(fsdpd, tmp_path):
    """A Join of the same shape as the RegisterUnit above (5.6 s of loop time on a peer port
    without a token), from a token holder: refused by its size (64 KiB, which bounds its
    fields to 32,768) before gRPC buffers it, while the daemon keeps answering."""
    token = tmp_path / "token"
    token.write_text("s3cret-peer-token\n")
    ports = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ports.append(s)
    hosts = ",".join(f"127.0.0.1:{s.getsockname()[1]}" for s in ports)
    for s in ports:
        s.close()
    d = fsdpd("--hosts", hosts, "--host-rank", "0", "--local-world-size", "1",
              "--set", f"peer.token_file={token}", env=DAEMON_ENV)
    rss_before = d.rss_mb()
    metadata = (("authorization", "Bearer s3cret-peer-token"),)
    field_settings = b"\x1a\x00"  # field 3 (settings), an empty entry
    with grpc.insecure_channel(hosts.split(",")[0],
                               options=[("grpc.enable_http_proxy", 0),
                                        ("grpc.max_send_message_length", -1)]) as ch:
        join = ch.unary_unary("/fsdp.v1.Peer/Join")
        with pytest.raises(grpc.RpcError) as e:
            join(field_settings * ((16 << 20) // 2 - 64), timeout=30, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "65536" in e.value.details(), e.value.details()
    assert d.rss_mb() - rss_before < RSS_GROWTH_MAX_MB
    d.assert_serving()


@pytest.mark.parametrize("mode,why", [
    ("counters", "its fast path's request ring claims 2147483648 unread entries, more than its "
                 "64: the trainer forged its counters"),
    ("doorbell", "its fast path's doorbell rang 64 times in a row with no request: the "
                 "trainer rings in a loop")])
def test_a_trainer_misusing_its_fast_path_loses_its_fast_path(fsdpd, mode, why):
    """Issue 29 item 3: a trainer claiming 2^31 requests in its fast path's ring (while it
    consumed every reply), or ringing its doorbell in a loop, kept the loop polling or waking
    (up to 90 % of a core) for as long as it went on, and other trainers' p99 went from 0.3 to
    4.1 ms. Now its fast path stops, with one warning saying why, at once for counters no
    trainer can make and after 64 turns in a row that served nothing: the daemon no longer
    looks at its doorbell or ring, the session goes on through gRPC (nothing to attach again
    for), and the daemon keeps serving."""
    d = fsdpd(env=DAEMON_ENV)
    rss_before = d.rss_mb()
    result = []
    failures, peak = under_flood(d, fast_path_abuse_flood(d, mode, result), 3)
    assert_kept_serving(d, failures, peak, rss_before)
    assert result and result[0][0] == 1, f"the abuser's (sessions, rings): {result}"
    log = d.stderr()
    assert f"(job 'abuser' local rank 0): {why}; its fast path stops" in log
    assert log.count("its fast path stops") == 1, log[-2000:]