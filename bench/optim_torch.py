"""The daemon's AdamW step against torch.optim.AdamW on shards of the same sizes, in one run.

    .venv/bin/python bench/optim_torch.py [--build build] [--sizes 1,16,256] [--runs 7]

Runs build/bin/fsdp-optim-bench (the kernel of kernels/optim.h with 1 thread and with every
CPU, and a pass of AdamW's memory traffic: 16 bytes read and 12 written per element), then
times torch.optim.AdamW.step() with foreach=False and foreach=True on one fp32 parameter of
each size, its gradient set, with as many torch threads as CPUs; each figure is the median
of --runs steps after one untimed. Prints every time in ms and, per size, torch's time over
the daemon's kernel (all CPUs) and the kernel's over the traffic bound.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def torch_adamw_ms(n, foreach, runs):
    p = torch.nn.Parameter(torch.full((n,), 0.01))
    p.grad = torch.full((n,), 0.001)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=1e-2, foreach=foreach)
    opt.step()  # makes the state: not timed
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.environ.get("BUILD", "build"))
    ap.add_argument("--sizes", default="1,16,256", help="MiB of fp32 parameters")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    bench = Path(args.build) / "bin" / "fsdp-optim-bench"
    out = subprocess.run([str(bench), "--sizes", args.sizes, "--runs", str(args.runs), "--json"],
                         capture_output=True, text=True, check=True).stdout
    kernel = json.loads(out)["results"]
    cpus = os.cpu_count() or 1
    torch.set_num_threads(cpus)
    print(f"AdamW step, median of {args.runs}; {cpus} CPUs")
    print(f"{'MiB':>5} {'bound ms':>9} {'fsdpd 1T':>9} {'fsdpd':>9} {'torch':>9} "
          f"{'torch fe':>9} {'fsdpd/bound':>12} {'torch/fsdpd':>12} {'torch fe/fsdpd':>15}")
    for mib in (int(s) for s in args.sizes.split(",")):
        rows = [r for r in kernel if r["mib"] == mib]
        one = next(r for r in rows if r["threads"] == 1)
        every = max(rows, key=lambda r: r["threads"])
        n = mib << 18
        plain = torch_adamw_ms(n, False, args.runs)
        fused = torch_adamw_ms(n, True, args.runs)
        ours = every["adamw_ms"]
        print(f"{mib:>5} {every['bound_ms']:>9.3f} {one['adamw_ms']:>9.3f} {ours:>9.3f} "
              f"{plain:>9.3f} {fused:>9.3f} {ours / every['bound_ms']:>11.2f}x "
              f"{plain / ours:>11.1f}x {fused / ours:>14.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
