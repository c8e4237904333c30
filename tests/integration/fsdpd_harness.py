"""Start a real fsdpd for a test and talk to it as a user would.

Each Daemon lives in its own run dir under the test's tmp_path and binds its health port
with port 0, so tests run in parallel with each other and with the rest of the suite. The
`fsdpd` fixture (import it into a test module) starts daemons and always kills what is
still running at teardown, whether the test passed or not, so nothing leaks.

Talking to it:
  d = fsdpd()                      # started and answering a health Check over the unix socket
  d.check("fsdp.v1.Trainer")       # -> HealthCheckResponse.SERVING, over unix (tcp=True: TCP)
  d.call("/fsdp.v1.Operator/Status", operator_pb2.StatusRequest(), operator_pb2.StatusReply)
  d.raw_call(path, b"...")         # raw bytes, no serializer: for malformed requests
  d.fsdpctl("status", "--json")    # CompletedProcess of the CLI against this daemon
  d.stop(signal.SIGTERM)           # -> exit code, bounded wait

Why the generated modules are imported the way they are: build/python-gen holds a
`grpc/health/v1` folder that would shadow the grpcio package if imported as `grpc.health`,
so health_pb2 is imported from its own folder as a top-level module.

Run with the project's .venv/bin/python (scripts/venv.sh: grpcio, protobuf, pytest, torch);
CTest sets FSDP_BUILD_DIR and FSDP_SOURCE_DIR.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

SOURCE_DIR = Path(os.environ.get("FSDP_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BUILD_DIR = Path(os.environ.get("FSDP_BUILD_DIR", SOURCE_DIR / "build"))
FSDPD = BUILD_DIR / "bin" / "fsdpd"
FSDPCTL = BUILD_DIR / "bin" / "fsdpctl"
PYTHON_GEN = BUILD_DIR / "python-gen"

# Appended, not prepended: the real grpcio package must win over python-gen/grpc.
for _p in (PYTHON_GEN, PYTHON_GEN / "grpc" / "health" / "v1"):
    if str(_p) not in sys.path:
        sys.path.append(str(_p))

import health_pb2  # noqa: E402
from fsdp.v1 import common_pb2, operator_pb2, peer_pb2, trainer_pb2  # noqa: E402,F401

# The wire protocol's version, as the daemon was built with it.
PROTOCOL_VERSION = int(re.search(
    r"#define FSDP_PROTOCOL_VERSION (\d+)u",
    (SOURCE_DIR / "include" / "fsdp" / "fsdp_version.h.in").read_text()).group(1))

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
HEALTH_SERVICES = ("", "fsdp.v1.Trainer", "fsdp.v1.Operator", "fsdp.v1.Peer")

START_TIMEOUT = 10.0  # seconds until a started daemon must answer a health Check
STOP_TIMEOUT = 10.0   # seconds stop() waits for the exit after the signal
CALL_TIMEOUT = 5.0    # deadline of each RPC the harness makes

# The daemon and fsdpctl must see neither the caller's fsdpd settings, nor a proxy (gRPC
# honours http_proxy even for 127.0.0.1 unless no_proxy says otherwise), nor the systemd
# notification variables of a test run that is itself a service. Tests pass them in `env`.
_SCRUBBED_ENV = re.compile(r"^(FSDPD_.*|(https?|all|grpc|no)_proxy|NOTIFY_SOCKET|WATCHDOG_.*"
                           r"|LISTEN_.*)$", re.IGNORECASE)
# Channel options: no proxy; a subchannel pool per channel, so a channel to a restarted
# daemon does not inherit the reconnect backoff of one to the daemon before it (the global
# pool shares subchannels by address); room for the oversized requests of the bad-input tests.
CHANNEL_OPTIONS = [
    ("grpc.enable_http_proxy", 0),
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]

def built_with(option):
    """Whether the build under test has the CMake option on (FSDP_SANITIZE, FSDP_FAILPOINTS)."""
    try:
        return f"{option}:BOOL=ON" in (BUILD_DIR / "CMakeCache.txt").read_text()
    except FileNotFoundError:
        return False


def clean_env(extra=None):
    """The environment for fsdpd and fsdpctl: ours without FSDPD_* and proxies, plus extra."""
    env = {k: v for k, v in os.environ.items() if not _SCRUBBED_ENV.match(k)}
    env.update(extra or {})
    return env


def poll(predicate, timeout, interval=0.01, what="condition"):
    """Calls predicate until it returns something true, or fails the test after timeout s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


def run_fsdpd(*args, env=None, cwd=None, timeout=10):
    """Runs fsdpd to completion (for --check-config, bad configs, --print-example-config)."""
    return subprocess.run([str(FSDPD), *map(str, args)], env=clean_env(env), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def run_fsdpctl(*args, env=None, cwd=None, timeout=15):
    """Runs fsdpctl with exactly these arguments (no --socket added)."""
    return subprocess.run([str(FSDPCTL), *map(str, args)], env=clean_env(env), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


class DaemonError(Exception):
    """fsdpd did not come up; the message carries its exit code and stderr."""


class Daemon:
    """One fsdpd process in run dir `run_dir`, its stderr captured in `log_path`."""

    def __init__(self, tmp_path, args=(), env=None, run_dir=None, health_listen="127.0.0.1:0",
                 name="fsdpd", prefix=(), metrics_listen="127.0.0.1:0"):
        self.tmp_path = Path(tmp_path)
        self.run_dir = Path(run_dir) if run_dir else self.tmp_path / f"{name}-run"
        self.socket_path = self.run_dir / "fsdpd.sock"
        self.unix_target = f"unix:{self.socket_path}"
        self.log_path = self.tmp_path / f"{name}.stderr"
        self.args = [str(a) for a in args]
        self.prefix = [str(a) for a in prefix]  # e.g. ip netns exec NS: execs fsdpd in place
        self.env = env or {}
        self.health_listen = health_listen
        self.metrics_listen = metrics_listen
        self.proc = None
        self.health_host = None
        self.health_port = None
        self._channels = {}
        self._parked = []

    # --- lifecycle -------------------------------------------------------------------------

    def start(self, wait=True, timeout=START_TIMEOUT):
        """Starts fsdpd; with wait, returns once it answers a health Check SERVING over the
        unix socket and has logged its health address, or raises DaemonError."""
        argv = [*self.prefix, str(FSDPD), "--run-dir", str(self.run_dir)]
        if self.health_listen is not None:
            argv += ["--health-listen", self.health_listen]
        if self.metrics_listen is not None:
            argv += ["--metrics-listen", self.metrics_listen]
        argv += self.args
        self._log = open(self.log_path, "w+b")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=clean_env(self.env),
                                     cwd=self.tmp_path)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout=START_TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise DaemonError(f"fsdpd exited with {self.proc.returncode} before serving:\n"
                                  f"{self.stderr()}")
            if self._answers() and self._learn_health_port():
                return
            if time.monotonic() >= deadline:
                raise DaemonError(f"fsdpd did not answer a health Check on {self.unix_target} "
                                  f"within {timeout:.0f}s; its stderr:\n{self.stderr()}")
            time.sleep(0.01)

    def _answers(self):
        if not self.socket_path.exists():
            return False
        try:
            return self.check("", timeout=1.0) == SERVING
        except grpc.RpcError:
            # A channel that failed to connect (e.g. to a stale socket) waits out a reconnect
            # backoff of a second and more; a fresh one tries at once.
            self.close_channels()
            return False

    def _learn_health_port(self):
        """Reads the bound health address from Operator.Status (the log line saying it is
        not written when daemon.log_level is above info)."""
        for listener in self.status().listeners:
            if "grpc.health.v1.Health" in listener.services and \
                    not listener.address.startswith("unix:"):
                host, _, port = listener.address.rpartition(":")
                self.health_host, self.health_port = host.strip("[]"), int(port)
                return True
        if self.health_listen not in (None, ""):
            raise DaemonError(f"fsdpd was given --health-listen {self.health_listen} but "
                              f"Operator.Status lists no TCP listener; stderr:\n{self.stderr()}")
        return True

    @property
    def metrics_url(self):
        """http://HOST:PORT/metrics of the daemon's metrics endpoint, from Operator.Status;
        None without one."""
        for listener in self.status().listeners:
            if "metrics" in listener.services:
                return f"http://{listener.address}/metrics"
        return None

    @property
    def pid(self):
        return self.proc.pid

    @property
    def health_address(self):
        return f"{self.health_host}:{self.health_port}"

    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def send_signal(self, sig):
        self.proc.send_signal(sig)

    def wait(self, timeout=STOP_TIMEOUT):
        """Exit code, or a test failure naming the daemon's stderr if it is still running."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"fsdpd (pid {self.pid}) still running {timeout:.1f}s later; "
                        f"stderr:\n{self.stderr()}")

    def stop(self, sig=signal.SIGTERM, timeout=STOP_TIMEOUT):
        """Sends sig and returns the exit code (negative: killed by that signal)."""
        self.close_channels()
        if self.running():
            self.send_signal(sig)
        return self.wait(timeout)

    def kill(self):
        """SIGKILL and reap; safe to call at any time, more than once."""
        self.close_channels()
        for parked in self._parked:
            parked.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if getattr(self, "_log", None) and not self._log.closed:
            self._log.close()

    def stderr(self):
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # --- gRPC ------------------------------------------------------------------------------

    def target(self, tcp=False):
        return self.health_address if tcp else self.unix_target

    def channel(self, tcp=False):
        """A cached channel to the unix socket or the TCP health port; closed at teardown."""
        key = self.target(tcp)
        if key not in self._channels:
            self._channels[key] = grpc.insecure_channel(key, options=CHANNEL_OPTIONS)
        return self._channels[key]

    def new_channel(self, tcp=False):
        """A channel of its own (its own connection); the caller closes it."""
        return grpc.insecure_channel(self.target(tcp), options=CHANNEL_OPTIONS)

    def close_channels(self):
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()

    def call(self, path, request, reply_type, tcp=False, timeout=CALL_TIMEOUT, channel=None):
        ch = channel or self.channel(tcp)
        fn = ch.unary_unary(path, request_serializer=request.__class__.SerializeToString,
                            response_deserializer=reply_type.FromString)
        return fn(request, timeout=timeout)

    def raw_call(self, path, payload, tcp=False, timeout=CALL_TIMEOUT, channel=None):
        """Sends payload bytes as they are; returns the reply bytes."""
        ch = channel or self.channel(tcp)
        return ch.unary_unary(path)(payload, timeout=timeout)

    def check(self, service="", tcp=False, timeout=CALL_TIMEOUT, channel=None):
        reply = self.call("/grpc.health.v1.Health/Check",
                          health_pb2.HealthCheckRequest(service=service),
                          health_pb2.HealthCheckResponse, tcp=tcp, timeout=timeout,
                          channel=channel)
        return reply.status

    def check_on_new_connection(self, tcp=False, timeout=3):
        """A Check as a newcomer makes it: on a connection of its own, closed after."""
        ch = self.new_channel(tcp)
        try:
            return self.check(timeout=timeout, channel=ch)
        finally:
            ch.close()

    def rss_mb(self):
        """The daemon's resident memory (VmRSS), in MB."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def watch(self, service="", tcp=False, timeout=30, channel=None):
        """A Watch stream: an iterator of HealthCheckResponse (cancel() it when done)."""
        ch = channel or self.channel(tcp)
        fn = ch.unary_stream("/grpc.health.v1.Health/Watch",
                             request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                             response_deserializer=health_pb2.HealthCheckResponse.FromString)
        return fn(health_pb2.HealthCheckRequest(service=service), timeout=timeout)

    def park_call(self, tcp=False):
        """A call whose request message never comes, to keep a draining daemon busy until
        daemon.drain_timeout cancels it. Returns once the daemon has the call's headers."""
        parked = ParkedCall(self, tcp)
        self._parked.append(parked)
        return parked

    def status(self, timeout=CALL_TIMEOUT):
        return self.call("/fsdp.v1.Operator/Status", operator_pb2.StatusRequest(),
                         operator_pb2.StatusReply, timeout=timeout)

    def config_entry(self, key):
        for e in self.status().config:
            if e.key == key:
                return e
        raise KeyError(key)

    def assert_serving(self, tcp=False):
        """The daemon is alive and answers a health Check SERVING."""
        assert self.running(), f"fsdpd exited with {self.proc.returncode}:\n{self.stderr()}"
        assert self.check("", tcp=tcp) == SERVING

    # --- fsdpctl ---------------------------------------------------------------------------

    def fsdpctl(self, *args, env=None, cwd=None, timeout=15, tcp=False):
        """Runs fsdpctl against this daemon: --socket (tcp: --address) is added unless args
        name a target themselves."""
        args = [str(a) for a in args]
        if not any(a.split("=")[0] in ("-s", "--socket", "-a", "--address") for a in args):
            args = (["--address", self.health_address] if tcp
                    else ["--socket", str(self.socket_path)]) + args
        return run_fsdpctl(*args, env=env, cwd=cwd, timeout=timeout)


class ParkedCall:
    """A client-streaming call on its own connection that sends headers and then waits."""

    def __init__(self, daemon, tcp=False):
        self._release = threading.Event()
        self.channel = daemon.new_channel(tcp)
        path = "/grpc.health.v1.Health/Check" if tcp else "/fsdp.v1.Operator/Status"
        fn = self.channel.stream_unary(path)
        self.future = fn.future(self._requests(), timeout=60)
        # HTTP/2 streams on one connection reach the server in order: once a later call on
        # the same channel is answered, the daemon has seen this one's headers.
        daemon.call("/grpc.health.v1.Health/Check", health_pb2.HealthCheckRequest(),
                    health_pb2.HealthCheckResponse, channel=self.channel)

    def _requests(self):
        self._release.wait()
        return
        yield  # a generator that ends without a message once released

    def outcome(self, timeout=STOP_TIMEOUT):
        """The grpc.StatusCode the call ended with (OK if it got a reply)."""
        try:
            self.future.result(timeout=timeout)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    def close(self):
        self._release.set()
        self.future.cancel()
        self.channel.close()


@pytest.fixture
def fsdpd(tmp_path):
    """Factory: fsdpd(*args, env=None, run_dir=None, wait=True, prefix=(), ...) -> started
    Daemon (prefix: a command that execs fsdpd, like `ip netns exec NS`).

    Every daemon it made is killed (SIGKILL) and reaped at teardown if it still runs."""
    daemons = []

    def start(*args, env=None, run_dir=None, wait=True, health_listen="127.0.0.1:0", name=None,
              prefix=()):
        d = Daemon(tmp_path, args=args, env=env, run_dir=run_dir, health_listen=health_listen,
                   name=name or f"fsdpd{len(daemons)}", prefix=prefix)
        daemons.append(d)
        d.start(wait=wait)
        return d

    yield start
    for d in daemons:
        d.kill()


def status_code_and_details(excinfo):
    """(grpc.StatusCode, details) of an RpcError caught by pytest.raises."""
    err = excinfo.value
    return err.code(), err.details()
