"""fsdpd configuration as an operator meets it: bad files stop start-up with exit 78 and a
file:line message, the precedence default < file < environment < flags shows in
`fsdpctl config show`, and reloads (SIGHUP, `fsdpctl config reload`) apply or refuse."""

import json
import signal

import grpc
import pytest

from fsdpd_harness import (SOURCE_DIR, fsdpd, operator_pb2, poll, run_fsdpd)  # noqa: F401

EX_CONFIG = 78


def write(path, text):
    path.write_text(text)
    return path


def config_show(d):
    r = d.fsdpctl("--json", "config", "show")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)
    return shown, {e["key"]: e for e in shown["config"]}


# --- bad config stops start-up ------------------------------------------------------------

BAD_CONFIGS = {
    # name: (file text, line of the error, fragments the message must contain)
    "unknown-key": ("[daemon]\nlog_level = info\nnope = 1\n", 3, ["'daemon.nope'", "unknown key"]),
    "unknown-section": ("[daemon]\n[nosuch]\nx = 1\n", 3, ["'nosuch.x'", "[nosuch]"]),
    "bad-enum": ("[daemon]\nlog_level = loud\n", 2,
                 ["key 'daemon.log_level'", "'loud'", "error|warning|info|debug"]),
    "bad-size-unit": ("[memory]\nlimit = 10MB\n", 2, ["key 'memory.limit'", "'10MB'"]),
    "bad-duration": ("[daemon]\ndrain_timeout = 5\n", 2, ["key 'daemon.drain_timeout'", "'5'"]),
    "below-minimum": ("[rpc]\nmax_message_size = 1KiB\n", 2,
                      ["key 'rpc.max_message_size'", "'1KiB'", "minimum"]),
    "above-maximum": ("[rpc]\nmax_inflight_calls = 2000000\n", 2,
                      ["key 'rpc.max_inflight_calls'", "'2000000'"]),
    "bad-address": ("[health]\nlisten = localhost\n", 2, ["key 'health.listen'", "'localhost'"]),
    "duplicate-key": ("[daemon]\nlog_level = info\n\nlog_level = debug\n", 4,
                      ["key 'daemon.log_level'", "line 2"]),
    "syntax-section": ("# comment\n[daemon\nlog_level = info\n", 2, ["[daemon"]),
    "syntax-line": ("[daemon]\njust some words\n", 2, ["just some words"]),
    "key-outside-section": ("log_level = info\n", 1, ["'log_level'", "[daemon]"]),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_exits_78_with_file_and_line(fsdpd, tmp_path, name):
    text, line, fragments = BAD_CONFIGS[name]
    conf = write(tmp_path / "fsdpd.conf", text)
    for extra in ([], ["--check-config"]):
        d = fsdpd("--config", conf, *extra, wait=False, name=f"fsdpd{len(extra)}")
        rc = d.wait(10)
        err = d.stderr()
        assert rc == EX_CONFIG, err
        assert f"{conf}:{line}: " in err, err
        for f in fragments:
            assert f in err, f"{f!r} not in {err!r}"
        assert not d.socket_path.exists()


def test_missing_config_file_exits_78(tmp_path):
    missing = tmp_path / "nope.conf"
    r = run_fsdpd("--config", missing, "--run-dir", tmp_path / "run", "--health-listen",
                  "127.0.0.1:0")
    assert r.returncode == EX_CONFIG
    assert str(missing) in r.stderr and "No such file" in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("how,args,env,origin", [
    ("env", [], {"FSDPD_DAEMON_LOG_LEVEL": "loud"}, "FSDPD_DAEMON_LOG_LEVEL"),
    ("flag", ["--log-level", "loud"], {}, "--log-level"),
    ("set", ["--set", "daemon.log_level=loud"], {}, "--set daemon.log_level"),
])
def test_bad_value_from_env_or_flag_exits_78(tmp_path, how, args, env, origin):
    r = run_fsdpd("--run-dir", tmp_path / "run", "--health-listen", "127.0.0.1:0", *args,
                  env=env)
    assert r.returncode == EX_CONFIG, r.stderr
    assert origin in r.stderr and "key 'daemon.log_level'" in r.stderr and "'loud'" in r.stderr


def test_unknown_key_in_set_flag_is_refused(tmp_path):
    r = run_fsdpd("--set", "daemon.nope=1", "--check-config")
    assert r.returncode == EX_CONFIG, r.stderr
    assert "'daemon.nope'" in r.stderr


# --- --check-config and the example file --------------------------------------------------

def test_check_config_ok(tmp_path):
    conf = write(tmp_path / "ok.conf", "[daemon]\nlog_level = debug\n[memory]\nlimit = 1GiB\n")
    run = tmp_path / "run"
    r = run_fsdpd("--config", conf, "--run-dir", run, "--check-config")
    assert r.returncode == 0, r.stderr
    assert "config OK" in r.stdout and str(conf) in r.stdout
    assert not run.exists(), "--check-config must not create the run dir"
    r = run_fsdpd("--check-config")
    assert r.returncode == 0 and "config OK" in r.stdout


def test_shipped_config_checks_ok(tmp_path):
    r = run_fsdpd("--config", SOURCE_DIR / "config" / "fsdpd.conf", "--check-config")
    assert r.returncode == 0, r.stderr


def test_print_example_config_equals_shipped_file():
    r = run_fsdpd("--print-example-config")
    assert r.returncode == 0, r.stderr
    shipped = (SOURCE_DIR / "config" / "fsdpd.conf").read_text()
    assert r.stdout == shipped, "config/fsdpd.conf drifted from the option table; " \
                                "regenerate it with fsdpd --print-example-config"


# --- precedence ---------------------------------------------------------------------------

def test_precedence_default_file_env_flag(fsdpd, tmp_path):
    conf = write(tmp_path / "fsdpd.conf",
                 "[daemon]\n"
                 "log_level = warning\n"       # line 2: env and flag override it
                 "drain_timeout = 3s\n"        # line 3: env overrides it
                 "housekeeping_interval = 2s\n"  # line 4: file wins
                 "[memory]\n"
                 "limit = 1GiB\n"              # line 6: --set overrides it
                 "[rpc]\n"
                 "max_inflight_calls = 100\n")  # line 8: file wins
    d = fsdpd("--config", conf, "--log-level", "error", "--set", "memory.limit=2GiB",
              env={"FSDPD_DAEMON_LOG_LEVEL": "debug", "FSDPD_DAEMON_DRAIN_TIMEOUT": "4s",
                   "FSDPD_RPC_MAX_MESSAGE_SIZE": "1MiB"})
    shown, cfg = config_show(d)
    assert shown["config_file"] == str(conf)

    def check(key, value, source, origin):
        e = cfg[key]
        assert (e["value"], e["source"], e["origin"]) == (value, source, origin), e

    check("daemon.log_level", "error", "flag", "--log-level")
    check("daemon.drain_timeout", "4s", "env", "FSDPD_DAEMON_DRAIN_TIMEOUT")
    check("rpc.max_message_size", "1MiB", "env", "FSDPD_RPC_MAX_MESSAGE_SIZE")
    check("daemon.housekeeping_interval", "2s", "file", f"{conf}:4")
    check("rpc.max_inflight_calls", "100", "file", f"{conf}:8")
    check("memory.limit", "2GiB", "flag", "--set memory.limit")
    check("daemon.backend", "host", "default", "")
    check("daemon.run_dir", str(d.run_dir), "flag", "--run-dir")
    # Empty by default: optional addresses, lists and files.
    empty = {"cluster.hosts", "peer.listen", "peer.token_file", "peer.tls_cert",
             "peer.tls_key", "peer.tls_ca", "daemon.operator_group", "checkpoint.dir"}
    assert all(bool(e["default_value"]) == (e["key"] not in empty) for e in shown["config"])
    # Status agrees, and the values are in force, not only displayed.
    s = d.status()
    assert s.config_file == str(conf)
    assert s.memory.limit_bytes == 2 << 30
    # log_level error: the info line announcing the listeners is not written.
    assert "serving on" not in d.stderr()


def test_config_show_table_names_sources(fsdpd, tmp_path):
    conf = write(tmp_path / "fsdpd.conf", "[memory]\nlimit = 1GiB\n")
    d = fsdpd("--config", conf, env={"FSDPD_DAEMON_DRAIN_TIMEOUT": "4s"})
    r = d.fsdpctl("config", "show")
    assert r.returncode == 0, r.stderr
    lines = {l.split()[0]: l for l in r.stdout.splitlines() if l and not l.startswith("#")}
    assert f"{conf}:2" in lines["memory.limit"] and "1GiB" in lines["memory.limit"]
    assert "FSDPD_DAEMON_DRAIN_TIMEOUT" in lines["daemon.drain_timeout"]
    assert "--health-listen" in lines["health.listen"]
    assert "default" in lines["daemon.backend"]


# --- reload -------------------------------------------------------------------------------

def log_level(d):
    return d.config_entry("daemon.log_level")


def test_sighup_reload_applies_a_reloadable_change(fsdpd, tmp_path):
    conf = write(tmp_path / "fsdpd.conf", "[daemon]\nlog_level = info\n")
    d = fsdpd("--config", conf)
    assert log_level(d).value == "info"
    write(conf, "[daemon]\n# now louder\nlog_level = debug\n[memory]\nlimit = 1GiB\n")
    d.send_signal(signal.SIGHUP)
    poll(lambda: log_level(d).value == "debug", 5, what="log_level debug after SIGHUP")
    e = log_level(d)
    assert (e.source, e.origin) == (operator_pb2.CONFIG_SOURCE_FILE, f"{conf}:3")
    assert d.status().memory.limit_bytes == 1 << 30
    poll(lambda: "config reloaded: 2 values changed" in d.stderr(), 5, what="the reload log")
    assert "daemon.log_level" in d.stderr() and "memory.limit" in d.stderr()
    d.assert_serving()
    d.assert_serving(tcp=True)


@pytest.mark.parametrize("edit", ["bad-value", "unknown-key", "deleted"])
def test_sighup_with_a_bad_edit_keeps_the_old_config(fsdpd, tmp_path, edit):
    conf = write(tmp_path / "fsdpd.conf", "[daemon]\nlog_level = warning\n")
    d = fsdpd("--config", conf)
    before = d.status()
    if edit == "bad-value":
        write(conf, "[daemon]\nlog_level = loud\n")
        why = f"{conf}:2: key 'daemon.log_level'"
    elif edit == "unknown-key":
        write(conf, "[daemon]\nlog_level = debug\nnope = 1\n")
        why = f"{conf}:3: "
    else:
        conf.unlink()
        why = str(conf)
    d.send_signal(signal.SIGHUP)
    poll(lambda: "reload failed" in d.stderr(), 5, what="'reload failed' in the log")
    assert why in d.stderr(), d.stderr()
    after = d.status()
    assert [(e.key, e.value, e.source, e.origin) for e in after.config] == \
           [(e.key, e.value, e.source, e.origin) for e in before.config]
    assert log_level(d).value == "warning"
    d.assert_serving()
    d.assert_serving(tcp=True)


def test_fsdpctl_config_reload_lists_changed_keys(fsdpd, tmp_path):
    conf = write(tmp_path / "fsdpd.conf", "[daemon]\nlog_level = info\n")
    d = fsdpd("--config", conf)
    r = d.fsdpctl("config", "reload")
    assert r.returncode == 0, r.stderr
    assert "nothing changed" in r.stdout, r.stdout
    write(conf, "[daemon]\nlog_level = debug\ndrain_timeout = 2s\n")
    r = d.fsdpctl("--json", "config", "reload")
    assert r.returncode == 0, r.stderr
    assert sorted(json.loads(r.stdout)["changed"]) == ["daemon.drain_timeout",
                                                        "daemon.log_level"]
    assert log_level(d).value == "debug"


def test_reload_refuses_a_non_reloadable_key(fsdpd, tmp_path):
    # health.listen from the file (no --health-listen flag, which would mask the file).
    conf = write(tmp_path / "fsdpd.conf",
                 "[daemon]\nlog_level = info\n[health]\nlisten = 127.0.0.1:0\n")
    d = fsdpd("--config", conf, health_listen=None)
    port = d.health_port
    write(conf, "[daemon]\nlog_level = debug\n[health]\nlisten = 127.0.0.1:1\n")
    r = d.fsdpctl("config", "reload")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "'health.listen'" in r.stderr and "restart" in r.stderr, r.stderr
    assert "127.0.0.1:1" in r.stderr
    # Nothing changed, not even the reloadable key in the same edit.
    assert log_level(d).value == "info"
    listen = d.config_entry("health.listen")
    assert (listen.value, listen.origin) == ("127.0.0.1:0", f"{conf}:4")
    assert d.check(tcp=True) == 1
    assert d.health_port == port
    # The same edit through SIGHUP is refused the same way.
    d.send_signal(signal.SIGHUP)
    poll(lambda: d.stderr().count("'health.listen' cannot change") >= 2, 5,
         what="the SIGHUP refusal in the log")
    assert log_level(d).value == "info"
    d.assert_serving()


def test_reload_over_grpc_returns_the_error(fsdpd, tmp_path):
    conf = write(tmp_path / "fsdpd.conf", "[daemon]\nlog_level = info\n")
    d = fsdpd("--config", conf)
    write(conf, "[daemon]\nlog_level = loud\n")
    with pytest.raises(grpc.RpcError) as e:
        d.call("/fsdp.v1.Operator/ReloadConfig", operator_pb2.ReloadConfigRequest(),
               operator_pb2.ReloadConfigReply)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{conf}:2: key 'daemon.log_level'" in e.value.details()
    assert "unchanged" in e.value.details()
    d.assert_serving()
