"""fsdpd as a process: start, serve health on both listeners, Status, drain on SIGTERM, and
the run-dir rules (modes, lock, stale socket, symlinks, foreign files)."""

import ctypes
import ctypes.util
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import pytest

from fsdpd_harness import (BUILD_DIR, FSDPD, HEALTH_SERVICES, NOT_SERVING,  # noqa: F401
                           PROTOCOL_VERSION, SERVICE_UNKNOWN, SERVING, clean_env, fsdpd,
                           operator_pb2, run_fsdpd, trainer_pb2)


def daemon_version():
    out = subprocess.run([str(FSDPD), "--version"], capture_output=True, text=True,
                         env=clean_env(), check=True).stdout
    # "fsdpd 0.1.0 (protocol 1)"
    return out.split()[1]


def test_start_serve_sigterm_exits_0_within_5s(fsdpd):
    d = fsdpd()
    d.assert_serving()
    d.assert_serving(tcp=True)
    t0 = time.monotonic()
    rc = d.stop(signal.SIGTERM)
    elapsed = time.monotonic() - t0
    assert rc == 0, d.stderr()
    assert elapsed < 5.0, f"SIGTERM took {elapsed:.2f}s"
    print(f"SIGTERM to exit: {elapsed * 1000:.0f} ms")
    # It cleans up after itself: the next start finds no socket to judge.
    assert not d.socket_path.exists()
    assert "draining" in d.stderr()


def test_sigint_drains_too(fsdpd):
    d = fsdpd()
    assert d.stop(signal.SIGINT) == 0, d.stderr()


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_health_check_serving_for_every_service(fsdpd, tcp):
    d = fsdpd()
    for service in HEALTH_SERVICES:
        assert d.check(service, tcp=tcp) == SERVING, f"service {service!r}"


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_health_check_unknown_service_is_not_found(fsdpd, tcp):
    d = fsdpd()
    with pytest.raises(grpc.RpcError) as e:
        d.check("fsdp.v1.Nope", tcp=tcp)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert "fsdp.v1.Nope" in e.value.details()
    d.assert_serving(tcp=tcp)


def test_watch_unknown_service_stays_open(fsdpd):
    d = fsdpd()
    stream = d.watch("fsdp.v1.Nope")
    assert next(stream).status == SERVICE_UNKNOWN
    # Still open: nothing more arrives, and the stream ends only because we cancel it.
    with pytest.raises(grpc.RpcError) as e:
        _next_within(stream, 0.3)
    assert e.value.code() == grpc.StatusCode.CANCELLED
    d.assert_serving()


def _next_within(stream, seconds):
    """next(stream), but cancel the stream if nothing arrived within seconds."""
    timer = threading.Timer(seconds, stream.cancel)
    timer.start()
    try:
        return next(stream)
    finally:
        timer.cancel()


def test_watch_sees_not_serving_on_sigterm_then_ends(fsdpd):
    d = fsdpd()
    streams = {"unix": d.watch(""), "tcp": d.watch("", tcp=True),
               "trainer": d.watch("fsdp.v1.Trainer")}
    for name, s in streams.items():
        assert next(s).status == SERVING, name
    t0 = time.monotonic()
    d.send_signal(signal.SIGTERM)
    for name, s in streams.items():
        assert next(s).status == NOT_SERVING, name
        with pytest.raises(grpc.RpcError) as e:
            next(s)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, name
        assert "shutting down" in e.value.details()
    rc = d.wait(5.0)
    elapsed = time.monotonic() - t0
    assert rc == 0, d.stderr()
    assert elapsed < 5.0
    print(f"SIGTERM with 3 watches to exit: {elapsed * 1000:.0f} ms")


def test_status_over_unix(fsdpd):
    d = fsdpd()
    s = d.status()
    assert s.version == daemon_version()
    assert s.protocol_version == PROTOCOL_VERSION
    assert s.pid == d.pid
    assert s.state == operator_pb2.SERVING_STATE_SERVING
    assert s.config_file == ""
    assert s.backend == "host"
    assert (s.topology.host_rank, s.topology.hosts) == (0, 1)
    # memory.limit by default: half of the host's memory, in whole 2 MiB pages.
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert s.memory.limit_bytes == max(host // 2 // (2 << 20) * (2 << 20), 64 << 20)
    listeners = {l.address: list(l.services) for l in s.listeners}
    assert listeners == {
        # Peer is served on its own TCP port, and only with several hosts (test_peers).
        d.unix_target: ["fsdp.v1.Trainer", "fsdp.v1.Operator", "grpc.health.v1.Health"],
        f"127.0.0.1:{d.health_port}": ["grpc.health.v1.Health"],
        # HTTP, not gRPC: Prometheus's (test_metrics).
        d.metrics_url.split("//")[1].rsplit("/", 1)[0]: ["metrics"],
    }
    assert d.health_port > 0
    assert f"health on 127.0.0.1:{d.health_port}," in d.stderr()
    assert f"metrics on {d.metrics_url.rsplit('/', 1)[0]} " in d.stderr()
    config = {e.key: e for e in s.config}
    assert config["daemon.run_dir"].source == operator_pb2.CONFIG_SOURCE_FLAG
    assert config["daemon.run_dir"].origin == "--run-dir"
    assert config["daemon.run_dir"].value == str(d.run_dir)
    assert config["health.listen"].source == operator_pb2.CONFIG_SOURCE_FLAG
    assert config["health.listen"].value == "127.0.0.1:0"
    assert config["daemon.log_level"].source == operator_pb2.CONFIG_SOURCE_DEFAULT
    assert config["daemon.log_level"].origin == ""
    assert all(e.source != operator_pb2.CONFIG_SOURCE_UNSPECIFIED for e in s.config)
    # Uptime moves forward.
    later = d.status()
    assert later.uptime_ms >= s.uptime_ms
    assert later.rpc_calls_total > s.rpc_calls_total


@pytest.mark.parametrize("path,request_", [
    ("/fsdp.v1.Operator/Status", operator_pb2.StatusRequest()),
    ("/fsdp.v1.Operator/ReloadConfig", operator_pb2.ReloadConfigRequest()),
    ("/fsdp.v1.Trainer/Attach", trainer_pb2.AttachRequest(protocol_version=PROTOCOL_VERSION)),
], ids=["Status", "ReloadConfig", "Attach"])
def test_operator_and_trainer_not_reachable_over_tcp(fsdpd, path, request_):
    d = fsdpd()
    with pytest.raises(grpc.RpcError) as e:
        d.call(path, request_, operator_pb2.StatusReply, tcp=True)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert path in e.value.details()
    d.assert_serving(tcp=True)


def test_run_dir_and_socket_modes(fsdpd, tmp_path):
    old = os.umask(0)  # the daemon must not depend on a friendly umask
    try:
        d = fsdpd(run_dir=tmp_path / "run")
    finally:
        os.umask(old)
    st_dir = os.lstat(d.run_dir)
    assert stat.S_ISDIR(st_dir.st_mode)
    assert stat.S_IMODE(st_dir.st_mode) == 0o750
    st_sock = os.lstat(d.socket_path)
    assert stat.S_ISSOCK(st_sock.st_mode)
    assert stat.S_IMODE(st_sock.st_mode) == 0o660
    assert (d.run_dir / "fsdpd.lock").read_text().strip() == str(d.pid)


def test_existing_run_dir_mode_is_tightened(fsdpd, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)
    d = fsdpd(run_dir=run)
    assert stat.S_IMODE(os.lstat(run).st_mode) == 0o750
    d.assert_serving()


def test_second_daemon_on_same_run_dir_is_refused(fsdpd):
    first = fsdpd()
    second = fsdpd(run_dir=first.run_dir, wait=False)
    rc = second.wait(10)
    assert rc != 0
    assert f"in use by another fsdpd (pid {first.pid})" in second.stderr()
    assert str(first.run_dir) in second.stderr()
    # The first one is untouched: its socket still answers, its lock still names it.
    first.assert_serving()
    assert (first.run_dir / "fsdpd.lock").read_text().strip() == str(first.pid)


def test_stale_socket_of_killed_daemon_is_removed(fsdpd):
    first = fsdpd()
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    assert stat.S_ISSOCK(os.lstat(first.socket_path).st_mode), "SIGKILL left no socket?"
    second = fsdpd(run_dir=first.run_dir)
    second.assert_serving()
    assert second.status().pid == second.pid
    assert (second.run_dir / "fsdpd.lock").read_text().strip() == str(second.pid)


def test_symlinked_run_dir_is_refused(fsdpd, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o750)
    link = tmp_path / "link"
    link.symlink_to(real)
    d = fsdpd(run_dir=link, wait=False)
    assert d.wait(10) != 0
    assert f"run dir '{link}' is a symlink" in d.stderr()
    assert list(real.iterdir()) == []


def test_file_at_socket_path_is_refused_and_kept(fsdpd, tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    sock = run / "fsdpd.sock"
    sock.write_text("not yours\n")
    d = fsdpd(run_dir=run, wait=False)
    assert d.wait(10) != 0
    assert f"'{sock}' exists and is not a socket" in d.stderr()
    assert sock.read_text() == "not yours\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")
def test_run_dir_owned_by_another_user_is_refused(fsdpd, tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    try:
        os.chown(run, 65534, 65534)
    except PermissionError as e:  # root in a user namespace without that uid mapped
        pytest.skip(f"cannot chown to uid 65534: {e}")
    d = fsdpd(run_dir=run, wait=False)
    assert d.wait(10) != 0
    assert f"run dir '{run}' is owned by uid 65534" in d.stderr()


# A gRPC client, as a trainer would be: it prints the status of a health Check.
_FOREIGN_CLIENT = r"""
import sys
import grpc
ch = grpc.insecure_channel("unix:" + sys.argv[1], options=[("grpc.enable_http_proxy", 0)])
try:
    ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=5)
    print("OK")
except grpc.RpcError as e:
    print(e.code().name, e.details())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_connection_from_foreign_user_is_refused_with_its_reason(fsdpd):
    """A uid the socket does not let in is served nothing, and hears why (it used to see only
    "broken pipe"): PERMISSION_DENIED naming its uid and who may connect."""
    # pytest's tmp_path sits in a 0700 folder; uid 65534 needs a path it may traverse.
    base = tempfile.mkdtemp(prefix="fsdpd-peer-")
    try:
        os.chmod(base, 0o755)
        d = fsdpd(run_dir=os.path.join(base, "run"))
        # Let uid 65534 reach the socket at all; only the daemon's peer check is in the way.
        os.chmod(d.run_dir, 0o755)
        os.chmod(d.socket_path, 0o666)
        try:
            r = subprocess.run([sys.executable, "-c", _FOREIGN_CLIENT, str(d.socket_path)],
                               user=65534, group=65534, extra_groups=[], capture_output=True,
                               text=True, timeout=20, cwd="/")
        except PermissionError as e:  # root in a user namespace that may not switch users
            pytest.skip(f"cannot run a process as uid 65534: {e}")
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("PERMISSION_DENIED "), r.stdout
        assert "uid 65534" in r.stdout and "may not use fsdpd" in r.stdout, r.stdout
        assert f"uid {os.geteuid()}" in r.stdout, r.stdout
        assert "refused a connection" in d.stderr() and "uid 65534" in d.stderr()
        # The same call from our own uid is answered.
        r = subprocess.run([sys.executable, "-c", _FOREIGN_CLIENT, str(d.socket_path)],
                           capture_output=True, text=True, timeout=20)
        assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr
        d.assert_serving()
        assert d.stop() == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("drain", ["0s", "1s", "5s"])
def test_drain_ends_within_drain_timeout(fsdpd, drain):
    """A request whose message never comes is no work the daemon holds: the stop does not
    wait for it, and gRPC cancels it within the drain time."""
    d = fsdpd("--set", f"daemon.drain_timeout={drain}")
    watch = d.watch("")
    assert next(watch).status == SERVING
    parked = d.park_call()
    t0 = time.monotonic()
    d.send_signal(signal.SIGTERM)
    assert next(watch).status == NOT_SERVING
    assert d.wait(10.0) == 0, d.stderr()
    elapsed = time.monotonic() - t0
    assert parked.outcome() != grpc.StatusCode.OK
    limit = min(int(drain[:-1]), 1) + 0.5
    assert elapsed < limit, f"drain_timeout {drain}, exit after {elapsed:.2f}s"
    print(f"SIGTERM with an unanswered request, drain_timeout {drain}, to exit: {elapsed * 1000:.0f} ms")


def test_more_sigterms_while_stopping_still_exit_cleanly(fsdpd):
    """An impatient operator (or a supervisor) repeats SIGTERM until the daemon is gone: every
    one after the first finds it already stopping, and it still exits 0."""
    d = fsdpd()
    d.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while d.proc.poll() is None and time.monotonic() < deadline:
        try:
            d.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.0002)
    assert d.wait() == 0


def test_backend_cuda_serves_a_gpu_or_exits_78_saying_why(tmp_path):
    """backend = cuda loads the CUDA module beside fsdpd and asks the runtime for the GPUs:
    here (no GPU, no driver) the exit names the CUDA call and its error, as this test hears
    it from the runtime itself; a build without the toolkit says so; on a host with GPUs a
    daemon.cuda_device that is none of them is named. A host of several asks the same (its
    rings among hosts stage through host memory). fsdpd itself links no CUDA library."""
    run = ("--run-dir", tmp_path / "run", "--health-listen", "127.0.0.1:0", "--backend", "cuda")
    said = "key 'daemon.backend': value 'cuda': "
    r = run_fsdpd(*run, env={"FSDPD_CLUSTER_HOSTS": "127.0.0.1:7101,127.0.0.1:7102",
                             "FSDPD_CLUSTER_LOCAL_WORLD_SIZE": "1", "FSDPD_PEER_INSECURE": "true"})
    assert r.returncode == 78 and said in r.stderr, r.stderr
    modules = list(BUILD_DIR.rglob("fsdp-cuda.so"))
    if not modules:
        r = run_fsdpd(*run)
        assert r.returncode == 78, r.stderr
        assert said + "this fsdpd was built without the CUDA backend" in r.stderr, r.stderr
        return
    linked = subprocess.run(["ldd", str(FSDPD)], capture_output=True, text=True).stdout
    assert "libcudart" not in linked and "libnccl" not in linked, linked
    cudart = ctypes.CDLL(ctypes.util.find_library("cudart"))
    cudart.cudaGetErrorString.restype = ctypes.c_char_p
    count = ctypes.c_int(0)
    err = cudart.cudaGetDeviceCount(ctypes.byref(count))
    if err:
        r = run_fsdpd(*run)
        assert r.returncode == 78, r.stderr
        why = cudart.cudaGetErrorString(err).decode()
        assert said + "no usable GPU: cudaGetDeviceCount: " + why in r.stderr, r.stderr
    else:
        r = run_fsdpd(*run, env={"FSDPD_DAEMON_CUDA_DEVICE": "15"})
        assert r.returncode == 78, r.stderr
        assert "key 'daemon.cuda_device': value 15 is not a usable GPU: " in r.stderr, r.stderr
