"""A lost host back from its replica's memory (store.recover_from_replicas) against the same
job back from its last checkpoint on disk (checkpoint.resume = latest), in one run
(docs/PERFORMANCE.md).

    .venv/bin/python bench/recovery_bench.py [--mib 256] [--runs 3] [--dir DIR]

Two daemons on this machine, host 0 and host 1, with cluster.shard_group_hosts 1: each host
holds every shard of a HYBRID_SHARD unit and the other replicates it. One trainer per host
trains one unit of --mib MiB of fp32 masters with the daemons' AdamW (its state twice the
masters) for 2 steps; then host 1's daemon and trainer are SIGKILLed, a new daemon takes
host 1's rank, both trainers start again (generation 1, as a launcher restarts them) and
train step 3. Measured, medians of --runs: the time from the kill to the end of step 3 on
host 1 (the new daemon's start, the trainers' attach, the state's way back, the step), and
the bytes of host 1's state. The same job two ways: recovered from host 0's memory with no
checkpoint directory, and with checkpoint.dir and checkpoint.resume = latest (recovery from
replicas off), the trainers having saved step 2 there, from which host 1's new daemon loads
it (host 0 keeps it in memory: the checkpoint is the newest state, the case most favourable
to the disk).
"""

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from page_cache import drop_caches  # bench/, this script's own folder

SOURCE_DIR = Path(os.environ.get("FSDP_SOURCE_DIR", Path(__file__).resolve().parents[1]))
BUILD_DIR = Path(os.environ.get("FSDP_BUILD_DIR", SOURCE_DIR / "build"))

TRAINER = r'''
import json, os, sys, time
import torch
import fsdpd

numel, steps, save_to = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
client = fsdpd.Client(timeout=600)
unit = client.register_unit("w", [("w", (numel,), True)], strategy="HYBRID_SHARD")
client.set_optimizer("AdamW", [{"lr": 1e-3}])
if unit.reduced_step == 0:
    unit.master_shard.copy_(torch.rand(numel, generator=torch.Generator().manual_seed(1)))
for step in range(unit.reduced_step + 1, steps + 1):
    unit.unshard(step=step, backward=True)
    unit.full_grad.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(step)))
    unit.reduce_scatter(step=step, step_optimizer=True)
    print(json.dumps({"step": step, "done": time.time()}), flush=True)
if save_to:  # the last step's checkpoint, each host its part
    client.save_checkpoint(save_to, step=steps)
client.close()
'''


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Host:
    """One daemon of the two, in a directory of its own."""

    def __init__(self, base, rank, hosts, job_bytes, options):
        self.dir = Path(base) / f"host{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.hosts, self.job_bytes, self.options = rank, hosts, job_bytes, options
        self.start()

    def start(self):
        self.log = self.dir / f"fsdpd.{time.monotonic_ns()}.log"
        sets = [a for o in self.options for a in ("--set", o)]
        self.proc = subprocess.Popen(
            [str(BUILD_DIR / "bin" / "fsdpd"), "--run-dir", str(self.dir / "run"),
             "--hosts", self.hosts, "--host-rank", str(self.rank), "--local-world-size", "1",
             "--set", "peer.insecure=true", "--set", "peer.timeout=1s",
             "--set", "peer.heartbeat_interval=200ms", "--set", "health.listen=",
             "--set", "metrics.listen=", "--set", f"memory.job_limit={self.job_bytes}",
             "--set", f"memory.limit={2 * self.job_bytes + (1 << 30)}", *sets],
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while b"serving on" not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"fsdpd did not serve:\n{self.log.read_text()}")
            time.sleep(0.02)

    def trainer(self, numel, steps, generation, save_to=""):
        env = {"FSDPD_LIB": str(BUILD_DIR / "lib" / "libfsdp.so"), **os.environ,
               "PYTHONPATH": str(SOURCE_DIR / "python"), "OMP_NUM_THREADS": "1",
               "FSDPD_SOCKET": str(self.dir / "run" / "fsdpd.sock"), "FSDPD_JOB": "bench",
               "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "RANK": str(self.rank),
               "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": str(generation)}
        return subprocess.Popen([sys.executable, "-c", TRAINER, str(numel), str(steps),
                                 str(save_to)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def finish(procs, ok=True):
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if ok and p.returncode != 0:
            sys.exit(f"a trainer exited {p.returncode}:\n{err}")
        outs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    return outs


def one_run(base, numel, job_bytes, options, save_to):
    """Seconds from the kill of host 1 to its step 3, the milliseconds its daemon took to
    load the state (from the replica: asked, sent, checked and copied in; from the disk: read,
    checked and copied in), and the bytes of the state."""
    ports = free_ports(2)
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    h = [Host(base, r, hosts, job_bytes, options) for r in range(2)]
    try:
        finish([x.trainer(numel, 2, 0, save_to) for x in h])
        h[1].kill()
        if save_to:
            drop_caches()
        killed = time.time()
        h[1].start()
        (_, again) = finish([x.trainer(numel, 3, 1) for x in h])
        (step3,) = [r for r in again if r["step"] == 3]
        log = h[1].log.read_text()
        loaded = re.search(r"loaded from .* in ([0-9.]+) ms", log)
        if not loaded:
            sys.exit(f"host 1 neither recovered nor resumed:\n{log}")
        size = re.search(r"\((\d+) bytes", h[0].log.read_text()) if not save_to else None
        return step3["done"] - killed, float(loaded.group(1)), int(size.group(1)) if size else 0
    finally:
        for x in h:
            if x.proc.poll() is None:
                x.proc.send_signal(signal.SIGTERM)
                x.proc.wait(timeout=60)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", help="where the checkpoints go (default: a temporary directory "
                                 "under /var/tmp, on disk)")
    args = p.parse_args()
    numel = args.mib << 18
    job_bytes = 8 * (args.mib << 20) + (64 << 20)  # masters, gradients, AdamW, the buffers lent
    ckpt = Path(args.dir or tempfile.mkdtemp(prefix="fsdp-recovery-", dir="/var/tmp"))
    # From the disk: step 2 is saved as the trainers end it (a schedule's save would wait
    # for step 3's first gather), into the directory checkpoint.resume reads.
    ways = {
        "replica": (["checkpoint.dir="], ""),
        "disk": ([f"checkpoint.dir={ckpt}", "checkpoint.resume=latest",
                  "store.recover_from_replicas=false"], ckpt / "bench"),
    }
    results = {}
    for name, (options, save_to) in ways.items():
        runs = []
        for run in range(args.runs):
            with tempfile.TemporaryDirectory() as base:
                runs.append(one_run(base, numel, job_bytes, options, save_to))
            if name == "disk":
                for f in sorted(ckpt.rglob("*"), reverse=True):
                    f.rmdir() if f.is_dir() else f.unlink()
        results[name] = [statistics.median(r[i] for r in runs) for i in range(2)] + [
            [r[0] for r in runs], runs[0][2]]
    rep, disk = results["replica"], results["disk"]
    print(f"{args.mib} MiB of fp32 masters with AdamW's state, 2 hosts x 1 trainer, "
          f"HYBRID_SHARD; medians of {args.runs}; the disk's page cache dropped before its "
          f"load: {'yes' if drop_caches() else 'no (not root)'}")
    for name, r in (("from a replica's memory", rep), ("from the disk (checkpoint.resume)", disk)):
        print(f"{name:34s} kill to host 1's next step {r[0]:6.2f} s "
              f"({', '.join(f'{t:.2f}' for t in r[2])}); the state loaded in {r[1]:7.1f} ms")
    print(f"state: {rep[3]} bytes copied over UCX; replica / disk: kill to step "
          f"{rep[0] / disk[0]:.2f}x, load {rep[1] / disk[1]:.2f}x")
    if not args.dir:
        ckpt.rmdir()


if __name__ == "__main__":
    main()
