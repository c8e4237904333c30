"""The README's "Several hosts" commands, run as written.

The block after `<!-- test_readme_hosts: one machine -->` in README.md is read from the
README itself, so that the text and this test cannot drift: its commands run in order in
a directory of the test's own, where `build` is the build under test, each `fsdpd` in the
background (a terminal of its own, the README says), and `fsdpctl` once the daemons are up.
Both daemons must serve over their unix socket and their health port, join each other and
move a unit's data over UCX; both stop with exit 0 on SIGTERM. A second daemon on one
machine used to fail at start on the default health port 7071 ("Address already in use").

The README's ports are fixed (Peer 7100 and 7101, health 7072 and 7073), so the commands
run in a network namespace of their own where the machine allows one (a user namespace,
no root needed): a `make run` on 7071 or another run of this test cannot take them. Where
it does not, they run on the machine's loopback if those ports are free, and the test skips
naming the taken ones otherwise.

The block for hosts of their own (`<!-- test_readme_hosts: several hosts -->`) cannot run
on one machine; its `fsdpd` commands must pass `--check-config` and differ from the one
machine's only in the host list, the run directory and the health port."""

import re
import shlex
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest

from fsdpd_harness import BUILD_DIR, SERVING, SOURCE_DIR, Daemon, clean_env, run_fsdpd
from test_cluster import check_collectives
from test_peers import peers
from test_unshard import FP32

README = SOURCE_DIR / "README.md"
DAEMON = "build/bin/fsdpd "
JOIN_TIMEOUT = 30.0  # seconds until both show the cluster ready: a busy 2-core machine


def readme_block(marker):
    """The commands of the sh block after the marker, continuation lines joined."""
    text = README.read_text()
    tag = f"<!-- test_readme_hosts: {marker} -->"
    assert text.count(tag) == 1, f"README.md must hold '{tag}' once, before its sh block"
    m = re.match(r"\s*```sh\n(.*?)\n```", text.split(tag, 1)[1], re.S)
    assert m, f"README.md: no ```sh block right after '{tag}'"
    return [line.strip() for line in re.sub(r"\\\n\s*", " ", m.group(1)).splitlines()
            if line.strip() and not line.strip().startswith("#")]


# What fsdpd takes when a command leaves these out: the defaults of `make run`.
DEFAULTS = {"--run-dir": "./run", "--health-listen": "127.0.0.1:7071",
            "--metrics-listen": "127.0.0.1:9464"}


def option(argv, name):
    if name not in argv and name in DEFAULTS:
        return DEFAULTS[name]
    return argv[argv.index(name) + 1]


def loopback_ports(commands):
    """Every 127.0.0.1 port the commands name."""
    return sorted({int(p) for c in commands for p in re.findall(r"127\.0\.0\.1:(\d+)", c)})


def taken(ports):
    busy = []
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                busy.append(port)
    return busy


class Netns:
    """A network namespace with loopback up, in a user namespace of its own: `prefix` runs
    a command in it. None of it where the machine does not allow one (no user namespaces,
    no unshare, nsenter or ip)."""

    def __init__(self):
        self.holder = None
        try:
            self.holder = subprocess.Popen(
                ["unshare", "--user", "--map-root-user", "--net", "sh", "-c",
                 "ip link set lo up && echo up && exec sleep 3600"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True)
        except OSError as e:
            self.why = str(e)
            return
        if self.holder.stdout.readline().strip() != "up":
            self.holder.wait(10)
            self.why = self.holder.stderr.read().strip()
            self.holder = None
            return
        self.prefix = ["nsenter", f"--target={self.holder.pid}", "--user", "--net",
                       "--preserve-credentials"]
        r = subprocess.run([*self.prefix, "true"], capture_output=True, text=True, timeout=10)
        if r.returncode != 0:
            self.why = r.stderr.strip()
            self.close()

    def close(self):
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait(10)
            self.holder = None


@pytest.fixture
def place(tmp_path):
    """Where the commands run: (cwd, prefix). The cwd holds `build`, the build under test,
    as a clone does."""
    (tmp_path / "build").symlink_to(BUILD_DIR.resolve(), target_is_directory=True)
    ns = Netns()
    if ns.holder is None:
        busy = taken(loopback_ports(readme_block("one machine")))
        if busy:
            pytest.skip(f"no network namespace ({ns.why}) and the README's ports {busy} "
                        "are taken on this machine")
        yield tmp_path, []
    else:
        yield tmp_path, ns.prefix
    ns.close()


def test_the_one_machine_commands_run_as_written(place):
    cwd, prefix = place
    commands = readme_block("one machine")
    assert sum(c.startswith(DAEMON) for c in commands) == 2, commands
    daemons, logs = [], []

    def sh(command, timeout=15):
        return subprocess.run([*prefix, "bash", "-c", command], cwd=cwd, env=clean_env(),
                              capture_output=True, text=True, timeout=timeout)

    try:
        peers_out = None
        for command in commands:
            if command.startswith(DAEMON):
                # exec: the process is fsdpd itself, as in a terminal, and gets our signals.
                argv = shlex.split(command, comments=True)
                d = Daemon(cwd, run_dir=cwd / option(argv, "--run-dir"),
                           health_listen=option(argv, "--health-listen"),
                           name=f"readme-host{option(argv, '--host-rank')}")
                logs.append(open(d.log_path, "wb"))
                d.proc = subprocess.Popen([*prefix, "bash", "-c", "exec " + command],
                                          cwd=cwd, env=clean_env(), stdin=subprocess.DEVNULL,
                                          stdout=logs[-1], stderr=subprocess.STDOUT)
                daemons.append(d)
                d.wait_ready()
            elif command.startswith("build/bin/fsdpctl ") and " peers" in command:
                # The daemons serve before they have joined: ask until the cluster is ready.
                deadline = time.monotonic() + JOIN_TIMEOUT
                while True:
                    for d in daemons:
                        assert d.running(), (f"{d.log_path.name[:-7]} exited with "
                                             f"{d.proc.returncode}:\n{d.stderr()}")
                    peers_out = sh(command)
                    if peers_out.returncode == 0 and "cluster ready" in peers_out.stdout:
                        break
                    assert time.monotonic() < deadline, (
                        f"'{command}' did not say the cluster is ready within {JOIN_TIMEOUT}s; "
                        f"it says:\n{peers_out.stdout}{peers_out.stderr}")
                    time.sleep(0.2)
            else:
                r = sh(command)
                assert r.returncode == 0, f"'{command}': {r.stderr}"
        assert peers_out is not None, f"the README's block has no fsdpctl peers: {commands}"

        first = next(c for c in commands if c.startswith(DAEMON))
        hosts = option(shlex.split(first, comments=True), "--hosts").split(",")
        assert re.match(r"host \d of 2,", peers_out.stdout), peers_out.stdout
        for rank, (address, state) in enumerate(zip(hosts, ("SELF", "JOINED"))):
            assert re.search(rf"^{rank}\s+{re.escape(address)}\s+{state}\b", peers_out.stdout,
                             re.M), peers_out.stdout

        for rank, d in enumerate(daemons):
            # Both serve, on their unix sockets and on their own health ports.
            d.assert_serving()
            assert d.health_address == d.health_listen
            r = sh(f"build/bin/fsdpctl --address {d.health_listen} health")
            assert (r.returncode, r.stdout.strip()) == (0, "SERVING"), r.stderr
            # Each sees the other joined.
            p = peers(d)
            assert p["ready"] and p["host_rank"] == rank, p
            assert {(x["host_rank"], x["address"], x["state"]) for x in p["peers"]} == {
                (h, a, "SELF" if h == rank else "JOINED") for h, a in enumerate(hosts)}, p

        # The data plane: a unit sharded over both hosts, gathered and reduced over UCX.
        check_collectives(SimpleNamespace(daemons=daemons), "FULL_SHARD", FP32)
        assert all(d.check("fsdp.v1.Trainer") == SERVING for d in daemons)

        for d in daemons:
            assert d.stop() == 0, d.stderr()
    finally:
        for d in daemons:
            d.kill()
        for log in logs:
            log.close()


def test_the_several_hosts_commands_say_the_same():
    """Hosts of their own run what one machine runs, less its own ports and run dirs."""
    def daemon_args(marker):
        out = {}
        for command in readme_block(marker):
            if command.startswith(DAEMON):
                argv = shlex.split(command, comments=True)[1:]
                for name in ("--run-dir", "--health-listen", "--metrics-listen"):
                    if name in argv:
                        del argv[argv.index(name):argv.index(name) + 2]
                out[option(argv, "--host-rank")] = argv
        return out

    hosts = daemon_args("several hosts")
    one = daemon_args("one machine")
    assert sorted(hosts) == sorted(one) == ["0", "1"]
    for rank, argv in hosts.items():
        listed = option(argv, "--hosts").split(",")
        assert len(set(listed)) == 2 and len({a.rsplit(":", 1)[0] for a in listed}) == 2
        same = [a if a != option(argv, "--hosts") else "HOSTS" for a in argv]
        assert same == [a if a != option(one[rank], "--hosts") else "HOSTS"
                        for a in one[rank]], (argv, one[rank])
        r = run_fsdpd(*argv, "--check-config")
        assert r.returncode == 0, f"host {rank}: {argv}: {r.stderr}"
