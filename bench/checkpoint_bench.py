"""Checkpoint save and load through fsdpd against a sequential write and read of the same
bytes on the same filesystem, in one run (docs/PERFORMANCE.md).

    .venv/bin/python bench/checkpoint_bench.py [--dir DIR] [--mib 256] [--runs 3]

Starts fsdpd (FSDP_BUILD_DIR's) and attaches one trainer with one unit of --mib MiB of fp32
masters and the daemon's AdamW (two state arrays: 3x the masters on disk), trained one step
from random values with a random gradient, so that no byte written is a zero a virtual disk
could skip. Then, --runs times each, medians: SaveCheckpoint of a new step each time (the
call's time: the snapshot taken, the files written, fsynced and renamed; and the host's busy
CPU time meanwhile, every core, from /proc/stat),
`dd if=DIR/random.bin of=DIR/dd.bin bs=4M conv=fdatasync` of as many random bytes (read
from the page cache),
LoadCheckpoint (every block read and checked twice: checked, then read into the job's
memory) and `dd if=DIR/dd.bin of=/dev/null bs=4M` (the page cache dropped before each read
when allowed: root). Prints GB/s and each ratio to dd's.

Then, --runs times, a stop with a save (checkpoint.on_stop): a fresh fsdpd with
checkpoint.dir, the same job trained one step (so there is something to save), and the time
from SIGTERM to the daemon's exit, its save of the job included, against that of the same
daemon and job without checkpoint.dir, and against a save's time from above.
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SOURCE_DIR = Path(os.environ.get("FSDP_SOURCE_DIR", Path(__file__).resolve().parents[1]))
BUILD_DIR = Path(os.environ.get("FSDP_BUILD_DIR", SOURCE_DIR / "build"))
sys.path.insert(0, str(SOURCE_DIR / "python"))
os.environ.setdefault("FSDPD_LIB", str(BUILD_DIR / "lib" / "libfsdp.so"))

import fsdpd  # noqa: E402
import torch  # noqa: E402
from page_cache import drop_caches  # noqa: E402 (bench/, this script's own folder)


def busy_cpu_s():
    """The CPU time every core of the host has spent busy so far (/proc/stat: user, nice,
    system, irq, softirq, steal), the kernel's writeback threads included."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")


def timed(fn, runs, before=None):
    """Medians of runs: the wall time of fn and the host's busy CPU time meanwhile."""
    times, cpus = [], []
    for _ in range(runs):
        if before:
            before()
        t, c = time.perf_counter(), busy_cpu_s()
        fn()
        times.append(time.perf_counter() - t)
        cpus.append(busy_cpu_s() - c)
    return statistics.median(times), statistics.median(cpus)


def start_daemon(run, job_bytes, *options):
    """A fresh fsdpd in the directory run; returns it and its socket."""
    log = Path(run) / "fsdpd.log"
    sets = [a for o in options for a in ("--set", o)]
    d = subprocess.Popen([str(BUILD_DIR / "bin" / "fsdpd"), "--run-dir", f"{run}/run",
                          "--set", f"memory.job_limit={job_bytes}",
                          "--set", f"memory.limit={2 * job_bytes + (1 << 30)}", *sets],
                         stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while b"serving on" not in log.read_bytes():
        if d.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"fsdpd did not serve:\n{log.read_text()}")
        time.sleep(0.05)
    return d, f"{run}/run/fsdpd.sock"


def trained_unit(client, numel):
    """A unit of random masters, stepped once by the daemon's AdamW on a random gradient."""
    unit = client.register_unit("w", [("w", (numel,), True)])
    client.set_optimizer("AdamW", [{"lr": 1e-3}])
    unit.master_shard.copy_(torch.rand(numel))
    unit.unshard(step=1, backward=True)
    unit.full_grad.copy_(torch.randn(numel))
    unit.reduce_scatter(step=1, step_optimizer=True)
    return unit


def stop_time(numel, job_bytes, *options):
    """Seconds from SIGTERM to the exit of a fresh daemon whose job trained one step with
    the daemon's AdamW."""
    with tempfile.TemporaryDirectory() as run:
        d, socket = start_daemon(run, job_bytes, *options)
        try:
            client = fsdpd.Client(socket=socket, job="bench", timeout=600)
            trained_unit(client, numel)
            t = time.perf_counter()
            d.send_signal(signal.SIGTERM)
            code = d.wait(timeout=600)
            took = time.perf_counter() - t
            if code != 0:
                sys.exit(f"fsdpd exited with {code}:\n{(Path(run) / 'fsdpd.log').read_text()}")
            client.close()
            return took
        finally:
            if d.poll() is None:
                d.kill()
                d.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="where the checkpoints go (default: a temporary directory "
                                 "under /var/tmp, on disk)")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="fsdp-ckpt-", dir="/var/tmp"))
    numel = args.mib << 18  # fp32 elements
    job_bytes = 5 * (args.mib << 20) + (64 << 20)
    with tempfile.TemporaryDirectory() as run:
        d, socket = start_daemon(run, job_bytes)
        try:
            client = fsdpd.Client(socket=socket, job="bench", timeout=600)
            unit = trained_unit(client, numel)
            ckpt = base / "ckpt"
            steps = iter(range(1, args.runs + 1))  # a new step each time, as in training
            save, save_cpu = timed(lambda: client.save_checkpoint(ckpt, step=next(steps)), args.runs)
            size = (ckpt / "step-1" / "host-0.bin").stat().st_size
            random_file, dd_file = base / "random.bin", base / "dd.bin"
            with open(random_file, "wb") as f:
                for _ in range(0, size, 4 << 20):
                    f.write(os.urandom(4 << 20))
            dd_write, dd_write_cpu = timed(lambda: subprocess.run(
                ["dd", f"if={random_file}", f"of={dd_file}", "bs=4M",
                 f"count={size // (4 << 20)}", "conv=fdatasync"], check=True,
                capture_output=True), args.runs)
            dropped = drop_caches()
            load, _ = timed(lambda: client.load_checkpoint(ckpt), args.runs,
                         before=drop_caches if dropped else None)
            dd_read, _ = timed(lambda: subprocess.run(
                ["dd", f"if={dd_file}", "of=/dev/null", "bs=4M"], check=True,
                capture_output=True), args.runs, before=drop_caches if dropped else None)
            unit.master_shard[0] = 1.0  # the job's memory is mapped and alive to the end
            client.close()
        finally:
            d.send_signal(signal.SIGTERM)
            d.wait(timeout=60)
    stops = [stop_time(numel, job_bytes, f"checkpoint.dir={base / 'stop'}")
             for _ in range(args.runs)]
    bare = [stop_time(numel, job_bytes) for _ in range(args.runs)]
    stop, plain = statistics.median(stops), statistics.median(bare)
    gb = size / 1e9
    print(f"{size / 2**20:.0f} MiB per checkpoint (masters and AdamW state of {args.mib} MiB "
          f"of parameters) in {base}; medians of {args.runs}; page cache dropped before "
          f"reads: {'yes' if dropped else 'no (not root)'}")
    print(f"save  {save:7.3f} s  {gb / save:6.2f} GB/s   dd write+fdatasync {dd_write:7.3f} s  "
          f"{gb / dd_write:6.2f} GB/s   save / dd: {(gb / save) / (gb / dd_write):.2f}x")
    print(f"CPU   save {save_cpu:6.3f} s ({save_cpu / gb:5.3f} s/GB)   dd write+fdatasync "
          f"{dd_write_cpu:6.3f} s ({dd_write_cpu / gb:5.3f} s/GB): the host's busy time, every "
          f"core, during each")
    print(f"load  {load:7.3f} s  {gb / load:6.2f} GB/s   dd read            {dd_read:7.3f} s  "
          f"{gb / dd_read:6.2f} GB/s   load / dd: {(gb / load) / (gb / dd_read):.2f}x "
          "(a load reads every block twice: checked first, then into the job)")
    print(f"SIGTERM to exit with a save {stop:7.3f} s, without {plain:7.3f} s: the save "
          f"adds {stop - plain:.3f} s = {(stop - plain) / save:.2f}x a save above")
    if not args.dir:
        for f in sorted(base.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        base.rmdir()


if __name__ == "__main__":
    main()
