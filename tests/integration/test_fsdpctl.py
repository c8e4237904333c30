"""fsdpctl against a real fsdpd: every command in table and JSON form, the TCP health port,
and the documented exit codes (0 ok, 1 error, 2 usage, 3 not serving)."""

import json
import os
import signal
import socket
import time

import pytest

import grpc

from fsdpd_harness import (NOT_SERVING, PROTOCOL_VERSION, SERVING, fsdpd,  # noqa: F401
                           run_fsdpctl, status_code_and_details, trainer_pb2)

OK, ERROR, USAGE, NOT_SERVING_EXIT = 0, 1, 2, 3


def ok(r):
    assert r.returncode == OK, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


def as_json(r):
    return json.loads(ok(r))


# --- commands -----------------------------------------------------------------------------

def test_status_table(fsdpd):
    d = fsdpd()
    out = ok(d.fsdpctl("status"))
    assert "SERVING" in out
    assert str(d.pid) in out
    assert d.unix_target in out
    assert f"127.0.0.1:{d.health_port}" in out
    assert "fsdp.v1.Operator" in out and "grpc.health.v1.Health" in out


def test_status_json(fsdpd):
    d = fsdpd()
    s = as_json(d.fsdpctl("--json", "status"))
    assert s["state"] == "SERVING"
    assert s["pid"] == d.pid
    assert s["protocol_version"] == PROTOCOL_VERSION
    assert s["version"] == d.status().version
    assert isinstance(s["uptime_ms"], int) and s["uptime_ms"] >= 0
    assert s["backend"] == "host"
    inc = s["topology"].pop("incarnation")
    assert len(inc) == 16 and int(inc, 16) != 0
    assert s["topology"] == {"host_rank": 0, "hosts": 1, "local_world_size": 0,
                             "shard_group_hosts": 1, "peers_ready": True}
    assert s["peers"] == []
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert s["memory"]["limit_bytes"] == max(host // 2 // (2 << 20) * (2 << 20), 64 << 20)
    assert s["sessions"] == []
    assert s["rpc_calls_total"] >= 1
    listeners = {l["address"]: l["services"] for l in s["listeners"]}
    assert listeners[d.unix_target][-1] == "grpc.health.v1.Health"
    assert listeners[f"127.0.0.1:{d.health_port}"] == ["grpc.health.v1.Health"]
    assert {e["key"] for e in s["config"]} >= {"daemon.run_dir", "health.listen", "memory.limit"}


def test_options_after_the_command(fsdpd):
    d = fsdpd()
    assert as_json(d.fsdpctl("status", "--json"))["pid"] == d.pid


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_health(fsdpd, tcp):
    d = fsdpd()
    assert ok(d.fsdpctl("health", tcp=tcp)).strip() == "SERVING"
    assert ok(d.fsdpctl("health", "fsdp.v1.Trainer", tcp=tcp)).strip() == \
        "fsdp.v1.Trainer: SERVING"
    for service in ("", "fsdp.v1.Operator", "fsdp.v1.Peer"):
        h = as_json(d.fsdpctl("--json", "health", *([service] if service else []), tcp=tcp))
        assert h == {"target": d.target(tcp), "service": service, "status": "SERVING"}


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_health_unknown_service_exits_1(fsdpd, tcp):
    d = fsdpd()
    r = d.fsdpctl("health", "nope", tcp=tcp)
    assert r.returncode == ERROR, r.stdout + r.stderr
    assert "NOT_FOUND" in r.stderr and "'nope'" in r.stderr
    assert r.stdout == ""
    r = d.fsdpctl("--json", "health", "nope", tcp=tcp)
    assert r.returncode == ERROR and r.stdout == ""


def test_config_show(fsdpd, tmp_path):
    conf = tmp_path / "fsdpd.conf"
    conf.write_text("[memory]\nlimit = 1GiB\n")
    d = fsdpd("--config", conf)
    out = ok(d.fsdpctl("config", "show"))
    assert f"# config file: {conf}" in out
    assert "KEY" in out and "SOURCE" in out
    row = next(l for l in out.splitlines() if l.startswith("memory.limit"))
    assert "1GiB" in row and f"file {conf}:2" in row and "yes" in row
    verbose = ok(d.fsdpctl("config", "show", "--verbose"))
    assert "memory.limit = 1GiB" in verbose and "help" in verbose
    shown = as_json(d.fsdpctl("--json", "config", "show"))
    assert shown["config_file"] == str(conf)
    entries = {e["key"]: e for e in shown["config"]}
    assert entries["memory.limit"]["source"] == "file"
    assert entries["memory.limit"]["default_value"] == "0B"
    # Issue 29 item 3: memory.job_limit follows memory.limit (here the file's 1GiB), not a
    # fixed 1GiB, and says so.
    job_limit = entries["memory.job_limit"]
    assert (job_limit["value"], job_limit["source"], job_limit["origin"]) == \
        ("256MiB", "default", "a quarter of memory.limit")
    assert entries["memory.limit"]["reloadable"] is True
    assert entries["health.listen"]["reloadable"] is False
    assert set(entries["daemon.log_level"]) >= {"key", "value", "default_value", "source",
                                                 "origin", "reloadable", "unit", "help"}


def test_version(fsdpd):
    d = fsdpd()
    out = ok(d.fsdpctl("version"))
    lines = out.splitlines()
    assert lines[0].startswith("fsdpctl") and f"(protocol {PROTOCOL_VERSION})" in lines[0]
    assert lines[1].startswith("fsdpd") and d.unix_target in lines[1]
    v = as_json(d.fsdpctl("--json", "version"))
    assert v["fsdpctl"]["protocol_version"] == v["fsdpd"]["protocol_version"] == PROTOCOL_VERSION
    assert v["fsdpd"]["version"] == d.status().version
    assert v["fsdpd"]["target"] == d.unix_target


def test_help_exits_0():
    for args in (["help"], ["--help"], ["-h"]):
        r = run_fsdpctl(*args)
        assert r.returncode == OK, r.stderr
        assert "usage: fsdpctl" in r.stdout and "exit status" in r.stdout


# --- targets ------------------------------------------------------------------------------

def test_socket_from_environment_and_default(fsdpd, tmp_path):
    d = fsdpd(run_dir=tmp_path / "run")
    r = run_fsdpctl("health", env={"FSDPD_SOCKET": str(d.socket_path)})
    assert ok(r).strip() == "SERVING"
    # Without --socket or FSDPD_SOCKET: ./run/fsdpd.sock, the daemon's default run dir.
    r = run_fsdpctl("--json", "health", cwd=tmp_path)
    assert as_json(r)["target"] == "unix:./run/fsdpd.sock"
    # A full gRPC target is accepted as --socket too.
    assert ok(d.fsdpctl("--socket", d.unix_target, "health")).strip() == "SERVING"


@pytest.mark.parametrize("args", [["status"], ["config", "show"], ["config", "reload"]])
def test_operator_commands_over_tcp_fail_with_a_hint(fsdpd, args):
    d = fsdpd()
    r = d.fsdpctl(*args, tcp=True)
    assert r.returncode == ERROR
    assert "UNIMPLEMENTED" in r.stderr
    assert "use --socket" in r.stderr


def test_unreachable_socket_exits_1(tmp_path):
    missing = tmp_path / "nope.sock"
    t0 = time.monotonic()
    r = run_fsdpctl("--socket", missing, "status")
    assert r.returncode == ERROR
    assert f"cannot reach fsdpd at unix:{missing}" in r.stderr
    assert "No such file or directory" in r.stderr
    assert r.stdout == ""
    assert time.monotonic() - t0 < 5


def test_socket_of_a_killed_daemon_exits_1(fsdpd):
    d = fsdpd()
    d.stop(signal.SIGKILL)
    for args in (["health"], ["status"], ["--json", "version"]):
        r = d.fsdpctl(*args)
        assert r.returncode == ERROR, args
        assert "cannot reach fsdpd" in r.stderr and "refused" in r.stderr.lower(), r.stderr


def test_unreachable_tcp_address_exits_1():
    # A port that was free a moment ago; nothing listens there now.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_fsdpctl("--address", f"127.0.0.1:{port}", "--timeout", "2s", "health")
    assert r.returncode == ERROR
    assert f"cannot reach fsdpd at 127.0.0.1:{port}" in r.stderr


def test_timeout_when_nobody_answers(tmp_path):
    # A unix socket that accepts connections into its backlog but never speaks.
    path = tmp_path / "mute.sock"
    with socket.socket(socket.AF_UNIX) as mute:
        mute.bind(str(path))
        mute.listen(16)
        t0 = time.monotonic()
        r = run_fsdpctl("--socket", path, "--timeout", "300ms", "health")
        elapsed = time.monotonic() - t0
    assert r.returncode == ERROR
    assert "DEADLINE_EXCEEDED" in r.stderr and "300 ms" in r.stderr, r.stderr
    assert elapsed < 3, f"--timeout 300ms took {elapsed:.1f}s"


# --- usage --------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    ([], "no command given"),
    (["bogus"], "unknown command 'bogus'"),
    (["--bogus", "health"], "unknown option '--bogus'"),
    (["-x", "health"], "unknown option '-x'"),
    (["config"], "needs a subcommand"),
    (["config", "nope"], "needs a subcommand"),
    (["health", "a", "b"], "unexpected argument 'b'"),
    (["status", "extra"], "unexpected argument 'extra'"),
    (["--timeout", "soon", "health"], "--timeout 'soon'"),
    (["health", "--socket"], "--socket needs a value"),
    (["--socket", "/x", "--address", "127.0.0.1:1", "health"], "exclude each other"),
    (["--socket", "", "health"], "non-empty"),
])
def test_bad_usage_exits_2(args, message):
    r = run_fsdpctl(*args)
    assert r.returncode == USAGE, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert "usage: fsdpctl" in r.stderr
    assert r.stdout == ""


# --- draining -----------------------------------------------------------------------------

def test_drain_and_resume(fsdpd):
    """fsdpctl drain: health NOT_SERVING (exit 3) on both listeners, status DRAINING (exit 3),
    new trainer work refused with UNAVAILABLE, status and health still answered; resume
    undoes all of it."""
    d = fsdpd()
    watch = d.watch("fsdp.v1.Trainer")
    assert next(watch).status == SERVING

    r = d.fsdpctl("drain")
    assert r.returncode == OK, r.stdout + r.stderr
    assert "new work is refused" in r.stdout
    assert next(watch).status == NOT_SERVING
    for tcp in (False, True):
        r = d.fsdpctl("health", tcp=tcp)
        assert r.returncode == NOT_SERVING_EXIT, r.stdout + r.stderr
        assert r.stdout.strip() == "NOT_SERVING"
    r = d.fsdpctl("--json", "status")
    assert r.returncode == NOT_SERVING_EXIT, r.stdout + r.stderr
    assert json.loads(r.stdout)["state"] == "DRAINING"
    with pytest.raises(grpc.RpcError) as excinfo:
        d.call("/fsdp.v1.Trainer/Attach",
               trainer_pb2.AttachRequest(protocol_version=PROTOCOL_VERSION),
               trainer_pb2.AttachReply)
    code, details = status_code_and_details(excinfo)
    assert code == grpc.StatusCode.UNAVAILABLE
    assert details == "/fsdp.v1.Trainer/Attach: fsdpd is draining and takes no new work"
    assert d.fsdpctl("drain").returncode == OK  # idempotent

    r = d.fsdpctl("resume")
    assert r.returncode == OK, r.stdout + r.stderr
    assert next(watch).status == SERVING
    assert d.fsdpctl("health").returncode == OK
    r = d.fsdpctl("--json", "status")
    assert r.returncode == OK and json.loads(r.stdout)["state"] == "SERVING"
    assert d.stop() == 0


def test_sigterm_while_drained_stops(fsdpd):
    d = fsdpd()
    assert d.fsdpctl("drain").returncode == OK
    assert d.stop(signal.SIGTERM) == 0


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_health_during_stop_is_not_ok_and_does_not_hang(fsdpd, tcp):
    """A probe racing a SIGTERM either sees NOT_SERVING (3) or finds the daemon gone (1),
    never SERVING, and never waits past its --timeout."""
    d = fsdpd()
    d.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    r = d.fsdpctl("--timeout", "500ms", "health", tcp=tcp)
    elapsed = time.monotonic() - t0
    assert r.returncode in (ERROR, NOT_SERVING_EXIT), r.stdout + r.stderr
    assert "SERVING" not in r.stdout.replace("NOT_SERVING", "")
    assert elapsed < 3, f"fsdpctl health during the stop took {elapsed:.1f}s"
    assert d.wait() == 0
