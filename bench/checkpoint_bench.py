"""Checkpoint save and load through fsdpd against a sequential write and read of the same
bytes on the same filesystem, in one run (docs/PERFORMANCE.md).

    /usr/bin/python3 bench/checkpoint_bench.py [--dir DIR] [--mib 256] [--runs 3]

Starts fsdpd (FSDP_BUILD_DIR's) and attaches one trainer with one unit of --mib MiB of fp32
masters and the daemon's AdamW (two state arrays: 3x the masters on disk). Then, --runs
times each, medians: SaveCheckpoint of a new step each time (the call's time: the files
written, fsynced and renamed), `dd if=/dev/zero of=DIR/dd.bin bs=4M count=N conv=fdatasync` of as many bytes,
LoadCheckpoint (every block read and checked twice: checked, then read into the job's
memory) and `dd if=DIR/dd.bin of=/dev/null bs=4M` (the page cache dropped before each read
when allowed: root). Prints GB/s and each ratio to dd's.
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


def drop_caches():
    """Whether the page cache could be dropped (root only)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn, runs, before=None):
    times = []
    for _ in range(runs):
        if before:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="where the checkpoints go (default: a temporary directory "
                                 "under /var/tmp, on disk)")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="fsdp-ckpt-", dir="/var/tmp"))
    numel = args.mib << 18  # fp32 elements
    with tempfile.TemporaryDirectory() as run:
        log = Path(run) / "fsdpd.log"
        job_bytes = 5 * (args.mib << 20) + (64 << 20)
        d = subprocess.Popen([str(BUILD_DIR / "bin" / "fsdpd"), "--run-dir", f"{run}/run",
                              "--set", f"memory.job_limit={job_bytes}",
                              "--set", f"memory.limit={2 * job_bytes + (1 << 30)}"],
                             stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while b"serving on" not in log.read_bytes():
                if d.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"fsdpd did not serve:\n{log.read_text()}")
                time.sleep(0.05)
            client = fsdpd.Client(socket=f"{run}/run/fsdpd.sock", job="bench", timeout=600)
            unit = client.register_unit("w", [("w", (numel,), True)])
            client.set_optimizer("AdamW", [{"lr": 1e-3}])
            ckpt = base / "ckpt"
            steps = iter(range(1, args.runs + 1))  # a new step each time, as in training
            save = timed(lambda: client.save_checkpoint(ckpt, step=next(steps)), args.runs)
            size = (ckpt / "step-1" / "host-0.bin").stat().st_size
            count = size // (4 << 20)
            dd_file = base / "dd.bin"
            dd_write = timed(lambda: subprocess.run(
                ["dd", "if=/dev/zero", f"of={dd_file}", "bs=4M", f"count={count}",
                 "conv=fdatasync"], check=True, capture_output=True), args.runs)
            dropped = drop_caches()
            load = timed(lambda: client.load_checkpoint(ckpt), args.runs,
                         before=drop_caches if dropped else None)
            dd_read = timed(lambda: subprocess.run(
                ["dd", f"if={dd_file}", "of=/dev/null", "bs=4M"], check=True,
                capture_output=True), args.runs, before=drop_caches if dropped else None)
            unit.master_shard[0] = 1.0  # the job's memory is mapped and alive to the end
            client.close()
        finally:
            d.send_signal(signal.SIGTERM)
            d.wait(timeout=60)
    gb = size / 1e9
    print(f"{size / 2**20:.0f} MiB per checkpoint (masters and AdamW state of {args.mib} MiB "
          f"of parameters) in {base}; medians of {args.runs}; page cache dropped before "
          f"reads: {'yes' if dropped else 'no (not root)'}")
    print(f"save  {save:7.3f} s  {gb / save:6.2f} GB/s   dd write+fdatasync {dd_write:7.3f} s  "
          f"{gb / dd_write:6.2f} GB/s   save / dd: {(gb / save) / (gb / dd_write):.2f}x")
    print(f"load  {load:7.3f} s  {gb / load:6.2f} GB/s   dd read            {dd_read:7.3f} s  "
          f"{gb / dd_read:6.2f} GB/s   load / dd: {(gb / load) / (gb / dd_read):.2f}x "
          "(a load reads every block twice: checked first, then into the job)")
    if not args.dir:
        for f in sorted(base.rglob("*"), reverse=True):
            f.rmdir() if f.is_dir() else f.unlink()
        base.rmdir()


if __name__ == "__main__":
    main()
