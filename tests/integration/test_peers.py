"""Daemons find each other: 2 and 3 fsdpd on this machine, each with its own run dir,
health port and peer port, join over the Peer service (plain, with a token, with mutual
TLS); settings that differ, a wrong token or a certificate from another CA keep them apart
with a clear reason; a peer SIGKILLed or SIGSTOPped is LOST within peer.timeout, one that
stops gracefully is LEFT at once, and a restarted one joins again with a new incarnation.

Short timings keep it quick: heartbeats every 100 ms, peer.timeout 1 s."""

import json
import signal
import socket
import struct
import subprocess
import time
from concurrent import futures

import grpc
import pytest

from fsdpd_harness import (CHANNEL_OPTIONS, PROTOCOL_VERSION, DaemonError, fsdpd,  # noqa: F401
                           peer_pb2, poll, run_fsdpd)

HEARTBEAT = "100ms"
TIMEOUT_S = 1.0
SLACK_S = 1.5  # scheduling on a loaded 2-core machine, the tick, the status poll
JOIN = "/fsdp.v1.Peer/Join"
INSECURE = ("--set", "peer.insecure=true")


def free_ports(n):
    """n TCP ports free on 127.0.0.1 right now (held together, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def insecure_unless_secured(args):
    """peer.insecure for daemons given neither a token nor TLS: these tests peer on
    loopback, and several hosts refuse to start without one of the three."""
    secured = any(str(a).startswith(("peer.token_file=", "peer.tls_cert=")) for a in args)
    return [] if secured else list(INSECURE)


class Cluster:
    count = 0

    def __init__(self, fsdpd, n, lws=2, timeout="1s", extra=None, per_rank=None, started=None,
                 env=None):
        self.fsdpd = fsdpd
        self.lws = lws
        self.timeout = timeout
        self.extra = list(extra or [])
        self.per_rank = per_rank or {}
        self.env = env
        # The ports were free when chosen; another process may bind one before a daemon
        # does (ctest runs tests side by side): then the cluster starts again on new ones.
        for attempt in range(3):
            Cluster.count += 1
            self.tag = f"c{Cluster.count}"  # run dirs and logs of its own in the test's tmp_path
            self.ports = free_ports(n)
            self.hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
            self.daemons = []
            try:
                for i in range(n if started is None else started):
                    self.daemons.append(self.start(i))
                return
            except DaemonError as e:
                if "Address already in use" not in str(e) or attempt == 2:
                    raise
                for d in self.daemons:
                    d.kill()

    def args(self, rank):
        lws = self.per_rank.get(rank, {}).get("lws", self.lws)
        own = [*self.extra, *self.per_rank.get(rank, {}).get("args", [])]
        return ["--hosts", self.hosts, "--host-rank", rank, "--local-world-size", lws,
                "--set", f"peer.heartbeat_interval={HEARTBEAT}",
                "--set", f"peer.timeout={self.timeout}", *insecure_unless_secured(own), *own]

    def start(self, rank, run_dir=None, name=None):
        return self.fsdpd(*self.args(rank), env=self.env, run_dir=run_dir,
                          name=name or f"{self.tag}-host{rank}")

    def restart(self, rank):
        old = self.daemons[rank]
        d = self.start(rank, run_dir=old.run_dir, name=f"{self.tag}-host{rank}-again")
        self.daemons[rank] = d
        return d


def peers(d):
    r = d.fsdpctl("peers", "--json")
    assert r.returncode in (0, 3), r.stderr
    return json.loads(r.stdout)


def states(d):
    return {p["host_rank"]: p["state"] for p in peers(d)["peers"]}


def wait_state(d, rank, state, timeout):
    """Waits until d shows host `rank` in `state`; returns that peer's row."""
    def row():
        for p in peers(d)["peers"]:
            if p["host_rank"] == rank and p["state"] == state:
                return p
        return None
    return poll(row, timeout, interval=0.05,
                what=f"host {rank} {state} on host {peers(d)['host_rank']}: {peers(d)}")


def wait_all_joined(cluster, timeout=10.0):
    for i, d in enumerate(cluster.daemons):
        poll(lambda: peers(d)["ready"], timeout, interval=0.05,
             what=f"host {i} ready; it shows {peers(d)}\n{d.stderr()}")


def test_two_daemons_join_both_ways(fsdpd):
    c = Cluster(fsdpd, 2)
    wait_all_joined(c)
    d0, d1 = c.daemons
    inc = [peers(d)["incarnation"] for d in c.daemons]
    assert inc[0] != inc[1] and all(len(i) == 16 for i in inc)
    # A few heartbeats later the round trip is measured.
    row = poll(lambda: next((p for p in peers(d0)["peers"] if p["host_rank"] == 1 and
                             p["rtt_us"] > 0), None), 5.0, what="an RTT for host 1")
    assert row["address"] == f"127.0.0.1:{c.ports[1]}"
    assert row["incarnation"] == inc[1]
    assert 0 <= row["last_heard_ms"] < 1000
    assert row["last_error"] == ""
    me = [p for p in peers(d0)["peers"] if p["host_rank"] == 0][0]
    assert me["state"] == "SELF" and me["incarnation"] == inc[0]

    # The text table and the status summary say the same.
    r = d1.fsdpctl("peers")
    assert r.returncode == 0, r.stderr
    assert "host 1 of 2" in r.stdout and "cluster ready" in r.stdout
    line = [l for l in r.stdout.splitlines() if l.startswith("0 ")][0]
    assert f"127.0.0.1:{c.ports[0]}" in line and "JOINED" in line and inc[0] in line
    r = d0.fsdpctl("status")
    assert "host 0 of 2" in r.stdout and "1 of 1 joined, ready" in r.stdout

    s = d0.status()
    assert (s.topology.host_rank, s.topology.hosts, s.topology.local_world_size) == (0, 2, 2)
    assert s.topology.peers_ready
    listeners = {l.address: list(l.services) for l in s.listeners}
    assert listeners[f"127.0.0.1:{c.ports[0]}"] == ["fsdp.v1.Peer", "grpc.health.v1.Health"]
    assert "fsdp.v1.Peer" not in listeners[d0.unix_target]
    assert "host 1 (127.0.0.1:" in d0.stderr() and "joined" in d0.stderr()


def test_three_daemons_sigkill_then_restart(fsdpd):
    c = Cluster(fsdpd, 3)
    wait_all_joined(c)
    old_inc = peers(c.daemons[2])["incarnation"]
    c.daemons[2].proc.kill()
    c.daemons[2].proc.wait(5)
    t0 = time.monotonic()
    for d in c.daemons[:2]:
        row = wait_state(d, 2, "LOST", TIMEOUT_S + SLACK_S)
        assert "no answer for" in row["last_error"] and "peer.timeout" in row["last_error"]
    elapsed = time.monotonic() - t0
    assert elapsed < TIMEOUT_S + SLACK_S
    assert states(c.daemons[0])[1] == "JOINED"  # the others still have each other
    assert peers(c.daemons[0])["ready"] is False
    assert c.daemons[0].fsdpctl("peers").returncode == 3
    log = c.daemons[0].stderr()
    assert f"host 2 (127.0.0.1:{c.ports[2]}) is LOST: no answer for" in log

    d2 = c.restart(2)
    wait_all_joined(c)
    new_inc = peers(d2)["incarnation"]
    assert new_inc != old_inc
    for d in c.daemons[:2]:
        row = [p for p in peers(d)["peers"] if p["host_rank"] == 2][0]
        assert row["state"] == "JOINED" and row["incarnation"] == new_inc


def test_sigstop_is_lost_then_recovers(fsdpd):
    c = Cluster(fsdpd, 2)
    wait_all_joined(c)
    d0, d1 = c.daemons
    inc1 = peers(d1)["incarnation"]
    d1.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        row = wait_state(d0, 1, "LOST", TIMEOUT_S + SLACK_S)
        assert time.monotonic() - t0 < TIMEOUT_S + SLACK_S
        assert "no answer for" in row["last_error"]
    finally:
        d1.send_signal(signal.SIGCONT)
    wait_all_joined(c)
    # The same process: the same incarnation, joined again.
    assert [p for p in peers(d0)["peers"] if p["host_rank"] == 1][0]["incarnation"] == inc1


def test_sigterm_leaves_at_once(fsdpd):
    # A long timeout, so that only the Leave can make it LEFT this soon.
    c = Cluster(fsdpd, 2, timeout="30s")
    wait_all_joined(c)
    d0, d1 = c.daemons
    t0 = time.monotonic()
    assert d1.stop(signal.SIGTERM) == 0
    row = wait_state(d0, 1, "LEFT", 3.0)
    assert time.monotonic() - t0 < 3.0
    assert "left: SIGTERM" in row["last_error"]
    assert "peers: leaving (SIGTERM), told 1 peer" in d1.stderr()


def test_settings_mismatch_is_refused_naming_the_key(fsdpd):
    c = Cluster(fsdpd, 2, lws=2, per_rank={1: {"lws": 4}})
    d0, d1 = c.daemons
    for d, mine, theirs in ((d0, 0, 1), (d1, 1, 0)):
        row = wait_state(d, theirs, "REFUSED", 10.0)
        err = row["last_error"]
        assert "setting 'cluster.local_world_size' differs" in err, err
        assert "host 1 has '4'" in err and "host 0 has '2'" in err, err
    # Each logs the refusals it made and the ones it got back as a FAILED_PRECONDITION.
    for d in (d0, d1):
        poll(lambda: "peers: refused the Join of host" in d.stderr() and
             f"refused: Join: FAILED_PRECONDITION: {JOIN}: setting 'cluster.local_world_size' "
             "differs" in d.stderr(), 5.0, what=f"both refusals in the log:\n{d.stderr()}")
    time.sleep(0.5)
    assert states(d0)[1] == "REFUSED" and states(d1)[0] == "REFUSED"
    assert peers(d0)["ready"] is False

    # The same refusal as a client sees it, with both values.
    req = peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION, host_rank=1, incarnation=7,
                               settings=[
                                   peer_pb2.Setting(key="cluster.hosts", value=c.hosts),
                                   peer_pb2.Setting(key="cluster.local_world_size", value="8"),
                                   peer_pb2.Setting(key="cluster.shard_group_hosts", value="1"),
                                   peer_pb2.Setting(key="daemon.backend", value="host")])
    with grpc.insecure_channel(f"127.0.0.1:{c.ports[0]}", options=CHANNEL_OPTIONS) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary(JOIN, request_serializer=req.SerializeToString,
                           response_deserializer=peer_pb2.JoinReply.FromString)(req, timeout=5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "setting 'cluster.local_world_size' differs: host 1 has '8', host 0 has '2'" in \
        e.value.details()


def join_call(port, request, creds=None, metadata=None):
    target = f"127.0.0.1:{port}"
    ch = (grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS) if creds
          else grpc.insecure_channel(target, options=CHANNEL_OPTIONS))
    with ch:
        fn = ch.unary_unary(JOIN, request_serializer=request.SerializeToString,
                            response_deserializer=peer_pb2.JoinReply.FromString)
        return fn(request, timeout=5, metadata=metadata)


def test_peer_port_refuses_bad_joins(fsdpd):
    c = Cluster(fsdpd, 2)
    port = c.ports[0]
    cases = [
        (peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION + 1, host_rank=1),
         grpc.StatusCode.FAILED_PRECONDITION,
         f"protocol_version {PROTOCOL_VERSION + 1} from the peer daemon"),
        (peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION, host_rank=5, incarnation=1),
         grpc.StatusCode.INVALID_ARGUMENT, "field 'host_rank' = 5 is not a peer"),
        (peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION, host_rank=0, incarnation=1),
         grpc.StatusCode.INVALID_ARGUMENT, "field 'host_rank' = 0 is not a peer"),
        (peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION, host_rank=1),
         grpc.StatusCode.INVALID_ARGUMENT, "field 'incarnation' = 0"),
        (peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION, host_rank=1, incarnation=3),
         grpc.StatusCode.FAILED_PRECONDITION, "field 'settings' lacks 'cluster.hosts'"),
    ]
    for req, code, text in cases:
        with pytest.raises(grpc.RpcError) as e:
            join_call(port, req)
        assert e.value.code() == code, e.value.details()
        assert text in e.value.details() and JOIN in e.value.details()
    # A Heartbeat from a host that never joined is told to join first.
    hb = peer_pb2.HeartbeatRequest(host_rank=1, incarnation=99, sent_ns=1)
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/fsdp.v1.Peer/Heartbeat", request_serializer=hb.SerializeToString,
                           response_deserializer=peer_pb2.HeartbeatReply.FromString)(hb, timeout=5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "has not joined host 0; Join first" in e.value.details()
    wait_all_joined(c)  # none of that disturbed the real peers


def test_token(fsdpd, tmp_path):
    good = tmp_path / "token"
    good.write_text("s3cret-peer-token\n")
    bad = tmp_path / "token.bad"
    bad.write_text("not-the-token\n")
    c = Cluster(fsdpd, 2, extra=["--set", f"peer.token_file={good}"])
    wait_all_joined(c)
    port = c.ports[0]
    req = peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION, host_rank=1, incarnation=5)
    for metadata, text in ((None, "the call carried none"),
                           ((("authorization", "Bearer wrong"),), "does not carry the token")):
        with pytest.raises(grpc.RpcError) as e:
            join_call(port, req, metadata=metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert text in e.value.details() and "peer.token_file" in e.value.details()
        assert "s3cret" not in e.value.details()
    # The right token gets past the check (to the settings check).
    with pytest.raises(grpc.RpcError) as e:
        join_call(port, req, metadata=(("authorization", "Bearer s3cret-peer-token"),))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The token is a secret: only its file's path is shown.
    assert "s3cret" not in c.daemons[0].fsdpctl("config", "show").stdout

    # A third daemon with the wrong token never joins.
    c2 = Cluster(fsdpd, 2, per_rank={1: {"args": ["--set", f"peer.token_file={bad}"]}},
                 extra=["--set", f"peer.token_file={good}"])
    row = wait_state(c2.daemons[1], 0, "REFUSED", 10.0)
    assert "UNAUTHENTICATED" in row["last_error"]
    time.sleep(0.5)
    assert states(c2.daemons[0])[1] != "JOINED" and states(c2.daemons[1])[0] == "REFUSED"
    assert "refused: no 'authorization' metadata" not in c2.daemons[0].stderr()
    assert "wrong token" in c2.daemons[0].stderr()


TOKEN = "s3cret-peer-token"
BEARER = (("authorization", f"Bearer {TOKEN}"),)


def token_args(tmp_path):
    path = tmp_path / "peer.token"
    path.write_text(TOKEN + "\n")
    return ["--set", f"peer.token_file={path}"]


def settings(cluster, lws=None):
    return [peer_pb2.Setting(key="cluster.hosts", value=cluster.hosts),
            peer_pb2.Setting(key="cluster.local_world_size", value=str(lws or cluster.lws)),
            peer_pb2.Setting(key="cluster.shard_group_hosts", value="1"),
            peer_pb2.Setting(key="daemon.backend", value="host")]


def ucx_address(body):
    """Bytes in fsdpd's transport address format around a UCX worker address `body`."""
    return b"FSDPUCX\x01" + struct.pack(">I", len(body)) + body


# A packed UCX worker address of version 7: UCX 1.13 asserts on it inside ucp_ep_create
# ("addr version 7") and aborts the process that unpacks it.
UCX_ABORTS = ucx_address(b"\x07" + bytes(40))


def row(d, rank):
    return next(p for p in peers(d)["peers"] if p["host_rank"] == rank)


class FakePeer:
    """Something answering at a host's cluster.hosts entry as that host would, with a UCX
    address of its choice: anyone who can answer there (or who holds the token)."""

    def __init__(self, port, rank, incarnation, ucx):
        self.joins = 0

        def join(request, context):
            self.joins += 1
            return peer_pb2.JoinReply(protocol_version=PROTOCOL_VERSION, host_rank=rank,
                                      incarnation=incarnation, ucx_worker_address=ucx)

        def heartbeat(request, context):
            return peer_pb2.HeartbeatReply(sent_ns=request.sent_ns, incarnation=incarnation)

        handlers = {
            "Join": grpc.unary_unary_rpc_method_handler(
                join, request_deserializer=peer_pb2.JoinRequest.FromString,
                response_serializer=peer_pb2.JoinReply.SerializeToString),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                heartbeat, request_deserializer=peer_pb2.HeartbeatRequest.FromString,
                response_serializer=peer_pb2.HeartbeatReply.SerializeToString),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("fsdp.v1.Peer", handlers),))
        assert self.server.add_insecure_port(f"127.0.0.1:{port}") == port
        self.server.start()

    def stop(self):
        self.server.stop(0)


def test_a_ucx_address_ucx_aborts_on_never_reaches_the_daemons_worker(fsdpd, tmp_path):
    """Host 1's entry is answered by a fake that joins host 0 both ways with a UCX address
    UCX asserts on, as a token holder or anyone answering there could. The address is
    unpacked in a process of its own and refused; host 0 lives and says why."""
    c = Cluster(fsdpd, 2, extra=token_args(tmp_path), started=0)  # host 1 is the fake
    fake = FakePeer(c.ports[1], 1, 0x77, UCX_ABORTS)
    try:
        d0 = c.start(0)
        req = peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION, host_rank=1,
                                   incarnation=0x77, settings=settings(c),
                                   ucx_worker_address=UCX_ABORTS)
        with pytest.raises(grpc.RpcError) as e:
            join_call(c.ports[0], req, metadata=BEARER)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        details = e.value.details()
        assert "field 'ucx_worker_address' (53 bytes) of host 1: UCX aborted unpacking it" in \
            details and "addr version 7" in details, details
        # Our own Join's reply carried it too: refused the same way, and shown.
        poll(lambda: fake.joins > 0 and "is refused" in row(d0, 1)["last_error"], 10.0,
             what=f"host 1's address refused: {peers(d0)}")
        r = row(d0, 1)
        assert r["state"] == "REFUSED", r
        assert "Join: its data-plane address (53 bytes) is refused: UCX aborted" in \
            r["last_error"], r
        time.sleep(1.0)  # retries meet the same refusal; nothing reaches the worker
        assert d0.running()
        d0.assert_serving()
        assert peers(d0)["ready"] is False
        log = d0.stderr()
        assert "the data-plane address of host 1" in log and "addr version 7" in log
        assert "data plane: connected to host 1" not in log
    finally:
        fake.stop()


def test_an_invalid_join_changes_nothing_of_a_live_relationship(fsdpd, tmp_path):
    """A token holder sends Joins as host 1 while host 1 is JOINED: other settings, another
    incarnation, an address that is not one. Each is refused naming why (the other
    incarnation: ALREADY_EXISTS naming the live one, confirmed by host 1's own address, and
    where the Join came from); host 1 stays JOINED at its incarnation throughout."""
    c = Cluster(fsdpd, 2, extra=token_args(tmp_path))
    wait_all_joined(c)
    d0, d1 = c.daemons
    inc1 = peers(d1)["incarnation"]
    assert row(d0, 1)["incarnation"] == inc1
    cases = [
        (peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION, host_rank=1,
                              incarnation=int(inc1, 16), settings=settings(c, lws=8)),
         grpc.StatusCode.FAILED_PRECONDITION, "setting 'cluster.local_world_size' differs"),
        (peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION, host_rank=1,
                              incarnation=int(inc1, 16), settings=settings(c),
                              ucx_worker_address=b"not an address"),
         grpc.StatusCode.INVALID_ARGUMENT, "field 'ucx_worker_address': UCX address of host 1: "
         "14 bytes that are not an fsdpd transport address"),
        (peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION, host_rank=1, incarnation=0x1234,
                              settings=settings(c)),
         grpc.StatusCode.ALREADY_EXISTS,
         f"host 1 is JOINED at incarnation {inc1}, as its own address 127.0.0.1:{c.ports[1]} "
         "confirmed; this Join as host 1, incarnation 0000000000001234, came from ipv4:127.0.0.1:"),
    ]
    for req, code, text in cases:
        with pytest.raises(grpc.RpcError) as e:
            join_call(c.ports[0], req, metadata=BEARER)
        assert e.value.code() == code, e.value.details()
        assert text in e.value.details(), e.value.details()
        r = row(d0, 1)
        assert r["state"] == "JOINED" and r["incarnation"] == inc1, r
    assert "refused a Join as this host" in row(d0, 1)["last_error"]
    time.sleep(1.0)
    assert row(d0, 1)["state"] == "JOINED" and row(d1, 0)["state"] == "JOINED"
    log = d0.stderr()
    assert f"host 1 (127.0.0.1:{c.ports[1]}) is " not in log, log  # never dropped
    assert log.count(f"host 1 (127.0.0.1:{c.ports[1]}) joined") == 1, log
    assert "another daemon claims the host's rank" in log


def openssl(*args, cwd):
    subprocess.run(["openssl", *map(str, args)], cwd=cwd, check=True, capture_output=True,
                   timeout=60)


def make_ca(dirpath, name):
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
            "-subj", f"/CN={name}", cwd=dirpath)


def make_cert(dirpath, ca, name):
    ext = dirpath / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                   "extendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=dirpath)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", ext.name,
            cwd=dirpath)


def tls_args(dirpath, name, ca):
    return ["--set", f"peer.tls_cert={dirpath / (name + '.pem')}",
            "--set", f"peer.tls_key={dirpath / (name + '.key')}",
            "--set", f"peer.tls_ca={dirpath / (ca + '.pem')}"]


def test_mutual_tls(fsdpd, tmp_path):
    make_ca(tmp_path, "ca")
    make_ca(tmp_path, "other-ca")
    for name in ("d0", "d1", "d2"):
        make_cert(tmp_path, "ca", name)
    make_cert(tmp_path, "other-ca", "stranger")

    c = Cluster(fsdpd, 2, per_rank={0: {"args": tls_args(tmp_path, "d0", "ca")},
                                    1: {"args": tls_args(tmp_path, "d1", "ca")}})
    wait_all_joined(c)
    port = c.ports[0]
    read = lambda n: (tmp_path / n).read_bytes()  # noqa: E731
    req = peer_pb2.JoinRequest(protocol_version=PROTOCOL_VERSION, host_rank=1, incarnation=5)

    # A client certificate from our CA gets through TLS (to the settings check) ...
    ours = grpc.ssl_channel_credentials(read("ca.pem"), read("d2.key"), read("d2.pem"))
    with pytest.raises(grpc.RpcError) as e:
        join_call(port, req, creds=ours)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # ... one from another CA, or none at all, does not get a connection.
    strange = grpc.ssl_channel_credentials(read("ca.pem"), read("stranger.key"),
                                           read("stranger.pem"))
    for creds in (strange, grpc.ssl_channel_credentials(read("ca.pem"))):
        with pytest.raises(grpc.RpcError) as e:
            join_call(port, req, creds=creds)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # Plaintext does not either.
    with pytest.raises(grpc.RpcError) as e:
        join_call(port, req)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    # A daemon whose certificate comes from another CA never joins.
    c2 = Cluster(fsdpd, 2, per_rank={0: {"args": tls_args(tmp_path, "d0", "ca")},
                                     1: {"args": tls_args(tmp_path, "stranger", "ca")}})
    time.sleep(2.0)
    assert states(c2.daemons[0])[1] != "JOINED"
    assert states(c2.daemons[1])[0] != "JOINED"
    assert peers(c2.daemons[1])["peers"][0]["last_error"].startswith("Join: UNAVAILABLE")


@pytest.mark.parametrize("args,text", [
    (["--hosts", "127.0.0.1:1,127.0.0.1:2", "--host-rank", "2", "--local-world-size", "1"],
     "key 'cluster.host_rank': value 2 (from --host-rank) is not below the number of hosts, 2"),
    (["--hosts", "127.0.0.1:1,127.0.0.1:1", "--local-world-size", "1"],
     "--hosts: key 'cluster.hosts': address 1 '127.0.0.1:1' repeats address 0"),
    (["--hosts", "127.0.0.1:1,nope", "--local-world-size", "1"],
     "--hosts: key 'cluster.hosts': address 1: value 'nope' is not HOST:PORT"),
    (["--hosts", "127.0.0.1:1,127.0.0.1:2"],
     "key 'cluster.local_world_size' is required with 2 hosts"),
    (["--hosts", "a:1,b:1,c:1", "--local-world-size", "2", "--set", "cluster.shard_group_hosts=2"],
     "S divides N"),
    (["--hosts", "a:7100,b:7100", "--local-world-size", "2", "--peer-listen", "0.0.0.0:7200"],
     "key 'peer.listen': value '0.0.0.0:7200' (from --peer-listen) has another port than this "
     "host's entry cluster.hosts[0] = 'a:7100'"),
    (["--set", "peer.tls_key=k.pem"], "peer TLS is all or none: peer.tls_key is set"),
    (["--hosts", "127.0.0.1:1,127.0.0.1:2", "--local-world-size", "1"],
     "peering 2 hosts needs a token (key 'peer.token_file') or mutual TLS (keys "
     "'peer.tls_cert', 'peer.tls_key', 'peer.tls_ca'); set key 'peer.insecure' = true"),
], ids=["rank", "duplicate", "syntax", "lws", "divides", "listen-port", "tls", "insecure"])
def test_config_errors_exit_78(args, text):
    r = run_fsdpd("--check-config", *args)
    assert r.returncode == 78, r.stdout + r.stderr
    assert text in r.stderr, r.stderr


def test_a_peer_port_in_use_stops_start_up_with_its_reason(tmp_path):
    """Another process holds this host's peer port: start-up stops, naming the address,
    with exit 1 (gRPC asserted when its half-set-up servers were destroyed: SIGABRT)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        r = run_fsdpd("--run-dir", tmp_path / "run", "--health-listen", "127.0.0.1:0",
                      "--hosts", f"127.0.0.1:{port},127.0.0.1:{free_ports(1)[0]}",
                      "--local-world-size", "1", *INSECURE)
    finally:
        holder.close()
    assert r.returncode == 1, r.stderr
    assert f"cannot listen on 127.0.0.1:{port} for the peer endpoint" in r.stderr, r.stderr


def test_missing_token_file_exits_78(fsdpd, tmp_path):
    ports = free_ports(2)
    r = run_fsdpd("--run-dir", tmp_path / "run", "--health-listen", "",
                  "--hosts", f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}",
                  "--local-world-size", "1", "--set", f"peer.token_file={tmp_path}/none")
    assert r.returncode == 78, r.stderr
    assert f"key 'peer.token_file': cannot read '{tmp_path}/none'" in r.stderr
