"""Callers' latency under the floods a local user can send at fsdpd, against the same calls
measured without a flood in the same run.

    .venv/bin/python bench/flood_bench.py [--build build] [--rounds 3] [--seconds 2]

For each flood the bench starts a fresh fsdpd (two, peering with a token, for the peer-port
flood) from the build dir, with two trainer ranks attached (a job of 2 local ranks, one unit
of 433 fp32 parameters), and runs --rounds rounds, each a phase without the flood then a
phase of --seconds under it (the flood runs in threads of the bench, started with the phase
and stopped at its end). In every phase the bench calls, one after the other, until the phase
ends (at most 500 times):

  Status   Operator.Status over the unix socket (a channel kept open)
  Check    grpc.health.v1.Health/Check over TCP on the health port (a channel kept open)
  Unshard  both ranks' Unshard of the next step at once (one thread each), timed until the
           slower one is answered; then each rank's Reshard (not timed)

each with a deadline of 5 s (a call past it counts as failed). A round's p50 and p99 are those
of its phase's calls; the table shows, per flood and call, the median over the rounds of p50
and p99 without and under the flood, and their ratio under/without, with the daemon's VmRSS
before the first round and its peak during the floods (read every call).

The floods (tests/integration/floods.py, shared with tests/integration/test_floods.py, which
checks that the daemon keeps serving through them; the latency figures are this bench's):
  reset-health  HTTP/2 rapid reset (HEADERS, DATA, RST_STREAM, 100 streams a burst) on the
                health port, a new connection whenever one is cut
  reset-peer    the same on host 0's peer port, without the token, both hosts JOINED
  idle-conns    1,100 connections on the unix socket and 200 on the health port (past
                rpc.max_connections_per_uid = 512 and health.max_connections = 128) that sent
                the preface and half a HEADERS frame, held
  fields        RegisterUnit requests of 16 MiB, 8.4 M empty parameter entries each, one after
                the other on a connection of their own (20 at most)
  watches       80 health Watch streams on one TCP connection and 80 on one unix-socket
                connection (past rpc.max_streams = 64), held
  mem-channel   200 connections to the memory channel's socket that never send their hello,
                held
  fast-counters a trainer of another job claiming 2^31 requests in its fast path's ring
                while consuming every reply, attaching again whenever its session ends
  fast-doorbell a trainer of another job ringing its fast path's doorbell in a loop, the same

Only loopback and the daemons' unix sockets; every daemon is killed at the end, whatever
happens. Absolute times differ between machines: compare the ratios.
"""

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[1]
MAX_CALLS = 500  # per phase
DEADLINE = 5.0   # seconds, every timed call


def percentile(times, q):
    s = sorted(times)
    return s[min(len(s) - 1, int(q * len(s)))]


class Daemons:
    """fsdpd(*args, env=None, run_dir=None, name=None): a started Daemon in a temporary dir,
    as the tests' fixture makes them (test_peers.Cluster takes it); kill_all() at the end."""

    def __init__(self, tmp):
        self.tmp = Path(tmp)
        self.daemons = []

    def __call__(self, *args, env=None, run_dir=None, name=None):
        from fsdpd_harness import Daemon
        d = Daemon(self.tmp, args=args, env=env, run_dir=run_dir,
                   name=name or f"fsdpd{len(self.daemons)}")
        self.daemons.append(d)
        d.start()
        return d

    def kill_all(self):
        for d in self.daemons:
            d.kill()


class Trainers:
    """Two local ranks of a job with one unit registered, each step's Unshard on both."""

    def __init__(self, d, strategy):
        from test_unshard import Rank
        self.ranks = [Rank(d, r, 2) for r in range(2)]
        for r in self.ranks:
            r.register(strategy=strategy)
        self.step = 0

    def unshard(self):
        self.step += 1
        errors = [None, None]

        def run(i):
            try:
                self.ranks[i].op("Unshard", step=self.step, timeout=DEADLINE)
            except Exception as e:  # noqa: BLE001 (grpc.RpcError; counted as a failure)
                errors[i] = e
        other = threading.Thread(target=run, args=(1,))
        other.start()
        run(0)
        other.join()
        if any(errors):
            raise errors[0] or errors[1]
        for r in self.ranks:
            r.op("Reshard", step=self.step, timeout=DEADLINE)


PROBES = ("Status", "Check", "Unshard")
FLOODS = ("reset-health", "reset-peer", "idle-conns", "fields", "watches", "mem-channel",
          "fast-counters", "fast-doorbell")


def phase(d, trainers, floods, seconds):
    """Times the probes for `seconds` while floods (each a flood(stop)) run in threads:
    ({probe: [seconds]}, {probe: [failures' messages]}, peak VmRSS in MB)."""
    calls = {
        "Status": lambda: d.status(timeout=DEADLINE),
        "Check": lambda: d.check("", tcp=True, timeout=DEADLINE),
        "Unshard": trainers.unshard,
    }
    stop = time.monotonic() + seconds
    threads = [threading.Thread(target=f, args=(stop,), daemon=True) for f in floods]
    for t in threads:
        t.start()
    times = {p: [] for p in PROBES}
    failures = {p: [] for p in PROBES}
    peak = d.rss_mb()
    n = 0
    while time.monotonic() < stop and n < MAX_CALLS:
        n += 1
        for p in PROBES:
            start = time.monotonic()
            try:
                calls[p]()
                times[p].append(time.monotonic() - start)
            except Exception as e:  # noqa: BLE001 (grpc.RpcError: a failed call)
                failures[p].append(f"{e.code().name}: {e.details()}" if hasattr(e, "code")
                                   else repr(e))
        peak = max(peak, d.rss_mb())
    for t in threads:
        t.join(30)
        if t.is_alive():
            raise RuntimeError("a flood did not stop within 30 s of its end")
    return times, failures, peak


def run_flood(name, make, d, trainers, args):
    """Alternating rounds without and under the flood made by make() (a list of flood(stop));
    returns the row for the table."""
    rss_before = d.rss_mb()
    peak = rss_before
    rounds = {"without": [], "under": []}
    failures = {"without": {p: [] for p in PROBES}, "under": {p: [] for p in PROBES}}
    for _ in range(args.rounds):
        for label in ("without", "under"):
            times, failed, p = phase(d, trainers, make() if label == "under" else [],
                                     args.seconds)
            rounds[label].append(times)
            for k, v in failed.items():
                failures[label][k] += v
            if label == "under":
                peak = max(peak, p)
                time.sleep(0.3)  # the daemon closes what the flood left
    d.assert_serving()
    d.assert_serving(tcp=True)
    row = {"flood": name, "rss_before": rss_before, "rss_peak": peak, "probes": {},
           "failures": []}
    for p in PROBES:
        fig = {}
        for label in ("without", "under"):
            per_round = [r[p] for r in rounds[label] if r[p]]
            fig[label] = (statistics.median(percentile(t, 0.5) for t in per_round)
                          if per_round else float("inf"),
                          statistics.median(percentile(t, 0.99) for t in per_round)
                          if per_round else float("inf"),
                          sum(len(r[p]) for r in rounds[label]), len(failures[label][p]))
            row["failures"].extend(f"{p} {label} the flood: {m}" for m in failures[label][p])
        row["probes"][p] = fig
    return row


def report(rows, args):
    print(f"median over {args.rounds} rounds of {args.seconds:g} s each, without and under the "
          "flood; ratio = under / without")
    print(f"{'flood':<13} {'call':<8} {'p50 without':>11} {'p50 under':>10} {'ratio':>6} "
          f"{'p99 without':>11} {'p99 under':>10} {'ratio':>6} {'calls':>11} {'failed':>6}")
    for row in rows:
        for p in PROBES:
            (w50, w99, wn, wf), (u50, u99, un, uf) = (row["probes"][p]["without"],
                                                      row["probes"][p]["under"])
            print(f"{row['flood']:<13} {p:<8} {w50 * 1000:9.2f}ms {u50 * 1000:8.2f}ms "
                  f"{u50 / w50:6.1f} {w99 * 1000:9.2f}ms {u99 * 1000:8.2f}ms {u99 / w99:6.1f} "
                  f"{wn:>5}/{un:<5} {wf + uf:>6}")
    print()
    print(f"{'flood':<13} {'VmRSS before':>12} {'peak':>8}")
    for row in rows:
        print(f"{row['flood']:<13} {row['rss_before']:10.0f}MB {row['rss_peak']:6.0f}MB")
    failed = [(row["flood"], m) for row in rows for m in row["failures"]]
    if failed:
        print("\nfailed calls (deadline %g s):" % DEADLINE)
        for flood, m in failed:
            print(f"  {flood}: {m}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default=os.environ.get("BUILD", "build"))
    p.add_argument("--rounds", type=int, default=3, help="rounds per flood (default 3)")
    p.add_argument("--seconds", type=float, default=2.0,
                   help="seconds of each phase, without or under the flood (default 2)")
    p.add_argument("--only", nargs="+", choices=FLOODS, help="floods to run (default: all)")
    args = p.parse_args(argv)
    if args.rounds < 1 or not 0.2 <= args.seconds <= 20:
        p.error("--rounds must be at least 1 and --seconds within 0.2 to 20")
    build = Path(args.build).resolve()
    if not (build / "bin" / "fsdpd").exists():
        print(f"flood_bench: {build / 'bin' / 'fsdpd'} is missing: build first", file=sys.stderr)
        return 1
    os.environ["FSDP_BUILD_DIR"] = str(build)
    os.environ["FSDP_SOURCE_DIR"] = str(SOURCE_DIR)
    sys.path.insert(0, str(SOURCE_DIR / "tests" / "integration"))
    import floods
    from fsdpd_harness import common_pb2
    from test_peers import TOKEN, Cluster, wait_all_joined

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2400:
        print(f"flood_bench: the idle-conns flood needs 2,400 descriptors (hard limit {hard})",
              file=sys.stderr)
        return 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    job = ("--set", "memory.job_limit=64MiB", "--log-level", "error")
    rows = []
    with tempfile.TemporaryDirectory(prefix="flood-bench-") as tmp:
        daemons = Daemons(tmp)

        def single(name):
            d = daemons(*job, name=name)
            return d, Trainers(d, common_pb2.FULL_SHARD)

        def reset_health():
            d, t = single("reset-health")
            sent = [0, 0]
            return d, t, lambda: [floods.rapid_reset_flood(
                (d.health_host, d.health_port), "/grpc.health.v1.Health/Check", sent)]

        def reset_peer():
            token = Path(tmp) / "peer.token"
            token.write_text(TOKEN + "\n")
            c = Cluster(daemons, 2, extra=[*job, "--set", f"peer.token_file={token}"])
            wait_all_joined(c)
            d = c.daemons[0]
            # One host per shard group: the unit is sharded over this host's two ranks.
            sent = [0, 0]
            return d, Trainers(d, common_pb2.HYBRID_SHARD), lambda: [floods.rapid_reset_flood(
                ("127.0.0.1", c.ports[0]), "/fsdp.v1.Peer/Heartbeat", sent)]

        def idle_conns():
            d, t = single("idle-conns")
            return d, t, lambda: [floods.held_connections_flood(
                [(str(d.socket_path), 1100), ((d.health_host, d.health_port), 200)],
                floods.half_headers())]

        def fields():
            d, t = single("fields")
            payload = b"\x1a\x00" * ((16 << 20) // 2 - 64)  # params[], empty entries
            return d, t, lambda: [floods.repeated_call_flood(
                d, "/fsdp.v1.Trainer/RegisterUnit", payload, [], 20, 30)]

        def watches():
            d, t = single("watches")
            return d, t, lambda: [floods.watch_flood(d, 80, tcp=True),
                                  floods.watch_flood(d, 80, tcp=False)]

        def mem_channel():
            d, t = single("mem-channel")
            return d, t, lambda: [floods.silent_memory_connections_flood(
                str(d.run_dir / "fsdpd.mem.sock"), 200)]

        def fast_path(mode):
            def setup():
                d, t = single(f"fast-{mode}")
                return d, t, lambda: [floods.fast_path_abuse_flood(d, mode)]
            return setup

        cases = dict(zip(FLOODS, (reset_health, reset_peer, idle_conns, fields, watches,
                                  mem_channel, fast_path("counters"), fast_path("doorbell"))))
        try:
            for name, setup in cases.items():
                if args.only and name not in args.only:
                    continue
                print(f"{name} ...", file=sys.stderr, flush=True)
                d, trainers, make = setup()
                rows.append(run_flood(name, make, d, trainers, args))
                daemons.kill_all()
        except KeyboardInterrupt:
            print("flood_bench: interrupted", file=sys.stderr)
            return 1
        finally:
            daemons.kill_all()
    report(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
