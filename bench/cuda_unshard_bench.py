"""Unshard and ReduceScatter of one bf16 unit through fsdpd on a GPU, against copies of the
same bytes on the same GPU, measured in one run (docs/PERFORMANCE.md).

    bench/cuda_unshard_bench.py [--mib 64 1024] [--runs 20]

Starts fsdpd (FSDP_BUILD_DIR's, backend cuda, memory sized for the largest unit) and attaches
one trainer (fsdpd.Client, the fast path) to a FULL_SHARD unit whose bf16 copy is --mib MiB.
Each step the trainer calls Unshard of a new step, which the daemon answers after its cast
of the fp32 masters into the copy (reads 2 B, writes 1 B per byte of the copy), and Reshard;
then the backward's Unshard, which lends the bf16 gradient buffer, and ReduceScatter, the
reduce kernel into the fp32 gradient shards. Each call is timed in the trainer, from the
call to its return (the GPU idle before), median of --runs. Beside them, timed with CUDA
events on the same GPU: a device-to-device copy of the copy's bytes ("copy"), one moving as
many bytes as the Unshard reads and writes ("copy same traffic"), and torch's own casts of
the same tensors. Also the fast path's round trip: an Unshard answered at once (the copy of
that step is already there). Exits 77 without a GPU.
"""

import argparse
import json
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

import torch  # noqa: E402


def start_daemon(run_dir, job_bytes):
    log = open(run_dir / "fsdpd.log", "wb")
    gib = 1 << 30
    job_limit = (job_bytes + gib - 1) // gib * gib
    proc = subprocess.Popen(
        [str(BUILD_DIR / "bin" / "fsdpd"), "--run-dir", str(run_dir / "run"), "--backend",
         "cuda", "--set", f"memory.job_limit={job_limit}",
         "--set", f"memory.limit={2 * job_limit + gib}", "--health-listen", "",
         "--metrics-listen", ""],
        stdout=log, stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")})
    deadline = time.monotonic() + 60
    while b"serving on" not in (run_dir / "fsdpd.log").read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"fsdpd did not serve:\n{(run_dir / 'fsdpd.log').read_text()}")
        time.sleep(0.05)
    return proc


def event_ms(fn, runs, idle_s=0.0):
    """Median milliseconds of fn on the GPU, by CUDA events, after a warm-up; idle_s: the GPU
    idles that long before each (as it does between a trainer's calls)."""
    fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        time.sleep(idle_s)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def wall_ms(fn, runs):
    fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def daemon_unit(socket, name):
    """What fsdpctl says of the unit (its last gather's and reduce's own work)."""
    out = subprocess.run([str(BUILD_DIR / "bin" / "fsdpctl"), "--socket", socket, "--json",
                          "unit", name], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def bench_unit(client, socket, mib, runs):
    numel = mib * (1 << 20) // 2
    u = client.register_unit(f"w{mib}", [("w", (numel,), True)], strategy="FULL_SHARD",
                             param_dtype="bfloat16")
    u.master_shard.copy_(torch.randn(u.shard_numel, device=u.master_shard.device))
    step = [0]

    def unshard():
        step[0] += 1
        u.unshard(step[0])

    times = []
    for _ in range(runs + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        unshard()
        times.append((time.perf_counter() - t) * 1e3)
        u.reshard(step[0])
    unshard_ms = statistics.median(times[1:])
    gather_work_ms = daemon_unit(socket, u.name)["last_gather_us"] / 1e3
    # The fast path's round trip: the copy of this step is there, answered at once.
    unshard()
    again = wall_ms(lambda: u.unshard(step[0]), runs)
    u.reshard(step[0])

    times = []
    for _ in range(runs + 1):
        unshard()
        u.reshard(step[0])
        u.unshard(step[0], backward=True)
        u.full_grad.normal_()
        u.reshard(step[0])
        torch.cuda.synchronize()
        t = time.perf_counter()
        u.reduce_scatter(step[0])
        times.append((time.perf_counter() - t) * 1e3)
    reduce_ms = statistics.median(times[1:])
    reduce_work_ms = daemon_unit(socket, u.name)["last_reduce_us"] / 1e3

    dev = u.master_shard.device
    src32 = torch.randn(numel, device=dev)
    bf = torch.empty(numel, dtype=torch.bfloat16, device=dev)
    bf2 = torch.empty_like(bf)
    big = torch.empty(numel * 3 // 2, dtype=torch.bfloat16, device=dev)  # 1.5x the copy
    big2 = torch.empty_like(big)
    copy = event_ms(lambda: bf2.copy_(bf), runs)
    copy_traffic = event_ms(lambda: big2.copy_(big), runs)
    torch_cast = event_ms(lambda: bf.copy_(src32), runs)
    torch_cast_after_idle = event_ms(lambda: bf.copy_(src32), runs, idle_s=0.002)
    torch_widen = event_ms(lambda: src32.copy_(bf), runs)
    del src32, bf, bf2, big, big2
    return {
        "unit_mib": mib, "unshard_ms": unshard_ms, "reduce_scatter_ms": reduce_ms,
        "daemon_gather_ms": gather_work_ms, "daemon_reduce_ms": reduce_work_ms,
        "torch_cast_after_idle_ms": torch_cast_after_idle,
        "copy_ms": copy, "copy_same_traffic_ms": copy_traffic,
        "torch_cast_ms": torch_cast, "torch_widen_ms": torch_widen,
        "unshard_per_copy": unshard_ms / copy,
        "unshard_per_copy_same_traffic": unshard_ms / copy_traffic,
        "unshard_per_torch_cast": unshard_ms / torch_cast,
        "reduce_scatter_per_torch_widen": reduce_ms / torch_widen,
        "answered_unshard_us": again * 1e3,
        "copy_gb_s": 2 * numel * 2 / copy / 1e6,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("skipped: torch sees no GPU")
        sys.exit(77)
    import fsdpd
    largest = max(args.mib) << 20
    # The arena: fp32 masters and gradients (4x the bf16 copy) and the gradient buffer.
    with tempfile.TemporaryDirectory() as tmp:
        d = start_daemon(Path(tmp), 6 * largest)
        try:
            socket = str(Path(tmp) / "run" / "fsdpd.sock")
            client = fsdpd.Client(socket=socket, job="bench", timeout=60)
            print(f"GPU: {torch.cuda.get_device_name()}; one trainer, FULL_SHARD, bf16 copy; "
                  f"medians of {args.runs}")
            columns = [("unit_mib", "MiB", "{:>4}"), ("unshard_ms", "Unshard", "{:>8.3f}"),
                       ("daemon_gather_ms", "its cast", "{:>8.3f}"),
                       ("copy_ms", "copy", "{:>7.3f}"),
                       ("copy_same_traffic_ms", "copy 1.5x", "{:>9.3f}"),
                       ("torch_cast_ms", "torch cast", "{:>10.3f}"),
                       ("torch_cast_after_idle_ms", "after idle", "{:>10.3f}"),
                       ("unshard_per_copy", "/copy", "{:>6.2f}"),
                       ("unshard_per_copy_same_traffic", "/copy 1.5x", "{:>10.2f}"),
                       ("reduce_scatter_ms", "ReduceScatter", "{:>13.3f}"),
                       ("daemon_reduce_ms", "its reduce", "{:>10.3f}"),
                       ("torch_widen_ms", "torch widen", "{:>11.3f}"),
                       ("answered_unshard_us", "answered us", "{:>11.1f}")]
            widths = [max(len(title), len(fmt.format(0))) for _, title, fmt in columns]
            print("  ".join(f"{title:>{w}}" for (_, title, _), w in zip(columns, widths)),
                  " (ms but where said)")
            for mib in args.mib:
                r = bench_unit(client, socket, mib, args.runs)
                print("  ".join(f"{fmt.format(r[key]):>{w}}"
                                for (key, _, fmt), w in zip(columns, widths)))
                print("RESULT " + json.dumps(r))
            client.close()
        finally:
            d.send_signal(signal.SIGTERM)
            d.wait(timeout=60)


if __name__ == "__main__":
    main()
