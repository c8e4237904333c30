"""Training on one GPU: fsdpd with one and two trainers sharing the GPU, against PyTorch's
FSDP2 (fully_shard, world size 1, NCCL) and against plain single-process training, on the
same model and batch, measured in one run (docs/PERFORMANCE.md).

    bench/gpu_train_bench.py [--models blocks24 1b] [--systems ...] [--steps 10]
                             [--warmup 3] [--global-batch 8] [--json-out FILE]

The models (examples/transformer.py's TinyGPT, bf16 compute, fp32 masters, AdamW):
  blocks24  d_model 1024, 24 blocks, seq 512: about 320 M parameters in 25 units
  1b        d_model 2048, 20 blocks, seq 512: about 1.04 B parameters in 21 units

The systems, each in processes of its own, one after the other:
  plain     one process, the model on the GPU in fp32 under torch.autocast(bfloat16),
            torch.optim.AdamW(fused): the compute with no sharding at all
  FSDP2     fully_shard on each block and the root, world size 1 over NCCL,
            MixedPrecisionPolicy(bfloat16, reduce float32), blocks resharded after the
            forward and prefetching the next, torch.optim.AdamW(fused) on the DTensors
  fsdpd     fsdpd.torch.shard_model(wrap={Block}, param_dtype bfloat16, reduce float32) on a
            daemon whose backend is this GPU, one trainer on the whole batch, its
            torch.optim.AdamW(fused) on the master shards
  fsdpd sync  the same with FSDP_CUDA_EVENTS=off: the trainer synchronizes its device
            before each call instead of handing the daemon an event to wait on
  fsdpd x2  the same as fsdpd with two trainers sharing the GPU, each on half the batch
  fsdpd+opt the daemon's AdamW (fsdpd.optim.AdamW) stepping each unit on the GPU as its
            gradients are reduced, one trainer

Measured, per system: the step (forward, backward, optimizer step, then
torch.cuda.synchronize: the slowest trainer's, median of --steps after --warmup), peak
device memory (the trainers' torch.cuda.max_memory_allocated summed, plus the daemon's: its
arenas' bytes, which a GPU's job makes whole at its start and which memory.job_limit sizes to
the job here, and apart the bytes its buffers use at the end: its pools keep the buffers they
made, so that is their peak),
exposed communication: the step minus plain's (the same compute, nothing else), and for
fsdpd the time a trainer spends inside fsdpd.Unit's calls per step (the slowest's), with each
kind's mean per call in the RESULT lines. The
ratios against FSDP2 are printed with the issue's targets (step at most 1.05x, memory at
most 1.0x). --device cpu runs the same on the host (gloo, the host backend) with a tiny
model: a check of the bench itself. Exits 77 without a GPU.
"""

import argparse
import gc
import json
import math
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

MODELS = {  # Config's sizes
    "blocks24": dict(vocab=8192, d_model=1024, n_heads=16, n_layers=24, seq_len=512),
    "1b": dict(vocab=8192, d_model=2048, n_heads=16, n_layers=20, seq_len=512),
    "tiny": dict(vocab=256, d_model=64, n_heads=4, n_layers=4, seq_len=32),  # --device cpu
}
SYSTEMS = ("plain", "FSDP2", "fsdpd", "fsdpd sync", "fsdpd x2", "fsdpd+opt")
LR = 1e-4
TIMEOUT = 600


# --- one trainer -----------------------------------------------------------------------------

def _fully_shard(net, block_class, device):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from train_bench import fully_shard_blocks  # bench/ is the script's directory

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return fully_shard_blocks(net, block_class, mesh, mp)


def worker(args):
    import torch
    sys.path.insert(0, str(SOURCE_DIR / "examples"))
    sys.path.insert(0, str(SOURCE_DIR / "python"))
    from transformer import Block, Config, TinyGPT, batch, loss_fn, rank_slice

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = Config(**MODELS[args.model])
    rank, world = args.rank, args.world

    class OnDevice(TinyGPT):
        """TinyGPT's initialization from a generator on the model's device: a billion
        normal draws take seconds on a CPU per process, milliseconds on a GPU."""

        @torch.no_grad()
        def _init_weights(self, seed):
            g = torch.Generator(device=device).manual_seed(seed)
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln" in name or name.startswith("ln_"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=g)

    with device:
        net = OnDevice(cfg, seed=0)
    fused = {"fused": True} if cuda else {}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.worker == "plain")
    client = None
    in_calls = {}  # fsdpd.Unit's calls by kind: [count, seconds]
    if args.worker.startswith("fsdpd"):
        import fsdpd
        import fsdpd.optim
        import fsdpd.torch
        client = fsdpd.Client(rank=rank, local_world_size=world, timeout=120)
        unit_call = fsdpd.Unit._call

        def timed_call(unit, what, *a):
            t = time.perf_counter()
            try:
                return unit_call(unit, what, *a)
            finally:
                c = in_calls.setdefault(what, [0, 0.0])
                c[0] += 1
                c[1] += time.perf_counter() - t

        fsdpd.Unit._call = timed_call
        model = fsdpd.torch.shard_model(net, client, wrap={Block}, param_dtype=torch.bfloat16,
                                        reduce_dtype=torch.float32)
        opt = fsdpd.optim.AdamW(model, lr=LR) if args.worker == "fsdpd+opt" else \
            torch.optim.AdamW(model.parameters(), lr=LR, **fused)
    elif args.worker == "FSDP2":
        model = _fully_shard(net, Block, device)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, **fused)
    else:
        model = net
        opt = torch.optim.AdamW(model.parameters(), lr=LR, **fused)
    if cuda:  # the peak from here: what training holds, not the model's first copy
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    setup_bytes = torch.cuda.memory_allocated(device) if cuda else 0
    times, losses, phases = [], [], {}

    def phase(name, last):
        """The peak of the last step's phase, from the phase's start (device bytes)."""
        if cuda and last:
            phases[name] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    for step in range(args.warmup + args.steps):
        last = step == args.warmup + args.steps - 1
        if step == args.warmup:
            in_calls.clear()
        tokens, targets = (t.to(device) for t in rank_slice(
            batch(step, args.global_batch, cfg.seq_len, cfg.vocab), rank, world))
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        peak = torch.cuda.max_memory_allocated(device) if cuda and last else 0
        phase("earlier_steps", last)
        with autocast:
            logits = model(tokens)
        loss = loss_fn(logits.float(), targets)
        phase("forward", last)
        loss.backward()
        phase("backward", last)
        opt.step()
        phase("optimizer", last)
        sync()
        t1 = time.perf_counter()
        losses.append(loss.item())
        if step >= args.warmup:
            times.append((t1 - t0) * 1e3)
    # The peak over the run: the last step's phases reset the counter, so theirs count too.
    peak = max([peak, *phases.values()]) if cuda else 0
    print(json.dumps({"rank": rank, "step_ms": times, "losses": losses, "peak_bytes": peak,
                      "setup_bytes": setup_bytes, "phase_peak_bytes": phases,
                      "in_calls": in_calls}), flush=True)
    if client is not None:
        client.close()
    elif args.worker == "FSDP2":
        torch.distributed.destroy_process_group()
    return 0


# --- the bench -------------------------------------------------------------------------------

def parameters(model):
    """TinyGPT's parameter count for a Config's sizes."""
    c = dict(mlp_ratio=4, **MODELS[model])
    d, v = c["d_model"], c["vocab"]
    block = (3 * d * d + 3 * d) + (d * d + d) + 2 * (c["mlp_ratio"] * d * d) + \
        c["mlp_ratio"] * d + d + 4 * d
    return c["n_layers"] * block + v * d + c["seq_len"] * d + 2 * d + v * d + v


def job_limit_gib(model, daemon_optimizer):
    """memory.job_limit for the job: a GPU's arenas are made whole, so sized to the job
    (fp32 masters and gradient shards, the daemon's AdamW state, 15 % and 1 GiB for the
    buffers lent in flight) rather than a round number that would count as its memory."""
    need = parameters(model) * (16 if daemon_optimizer else 8) * 1.15 + 2**30
    return math.ceil(need / 2**30)


class Daemon:
    """fsdpd on the GPU (or the host's memory with --device cpu) in a temporary run dir."""

    def __init__(self, tmp, device, job_gib):
        self.run_dir = tmp / "run"
        self.log_path = tmp / "fsdpd.log"
        backend = ["--backend", "cuda", "--set", f"memory.job_limit={job_gib}GiB",
                   "--set", f"memory.limit={2 * job_gib + 1}GiB"] if device == "cuda" else []
        self.proc = subprocess.Popen(
            [str(BUILD_DIR / "bin" / "fsdpd"), "--run-dir", str(self.run_dir),
             "--health-listen", "", "--metrics-listen", "", *backend],
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")})
        deadline = time.monotonic() + 60
        while b"serving on" not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"fsdpd did not serve:\n{self.log_path.read_text()}")
            time.sleep(0.05)

    def job_bytes(self):
        """What the job's buffers use of its arenas, and the arenas' bytes (on a GPU, made
        whole when the job starts: memory the GPU gives up)."""
        out = subprocess.run([str(BUILD_DIR / "bin" / "fsdpctl"), "--socket",
                              str(self.run_dir / "fsdpd.sock"), "--json", "status"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        memory = json.loads(out)["memory"]
        return sum(j["used_bytes"] for j in memory["jobs"]), memory["reserved_bytes"]

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_system(system, args, model):
    """One system's trainers to the end: the step (slowest trainer's, per step) and memory."""
    world = 2 if system == "fsdpd x2" else 1
    with tempfile.TemporaryDirectory(prefix="gpu-train-bench.") as tmp:
        daemon = Daemon(Path(tmp), args.device, job_limit_gib(model, system == "fsdpd+opt")) \
            if system.startswith("fsdpd") else None
        env = {k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")}
        env.update(FSDP_SOURCE_DIR=str(SOURCE_DIR), PYTHONUNBUFFERED="1")
        if system == "fsdpd sync":
            env["FSDP_CUDA_EVENTS"] = "off"
        if daemon:
            env.update(FSDPD_SOCKET=str(daemon.run_dir / "fsdpd.sock"), FSDPD_JOB="bench",
                       FSDPD_LIB=os.environ.get("FSDPD_LIB",
                                                str(BUILD_DIR / "lib" / "libfsdp.so")))
        try:
            procs = [subprocess.Popen(
                [sys.executable, __file__, "--worker", system, "--rank", str(r), "--world",
                 str(world), "--model", model, "--device", args.device, "--steps",
                 str(args.steps), "--warmup", str(args.warmup), "--global-batch",
                 str(args.global_batch)], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True) for r in range(world)]
            outs = []
            for p in procs:
                out, err = p.communicate(timeout=TIMEOUT)
                if p.returncode != 0:
                    sys.exit(f"{system} rank failed ({p.returncode}):\n{err[-4000:]}")
                outs.append(json.loads(out.strip().splitlines()[-1]))
            daemon_bytes, reserved = daemon.job_bytes() if daemon else (0, 0)
        finally:
            if daemon:
                daemon.stop()
    steps = [max(o["step_ms"][i] for o in outs) for i in range(args.steps)]
    calls = {kind: {"per_step": n / args.steps, "mean_us": seconds / n * 1e6}
             for kind, (n, seconds) in outs[0]["in_calls"].items()}
    return {"system": system, "model": model, "step_ms": statistics.median(steps),
            "in_calls_ms": max(sum(s for _, s in o["in_calls"].values()) for o in outs)
            / args.steps * 1e3, "calls": calls,
            "peak_bytes": sum(o["peak_bytes"] for o in outs) + daemon_bytes,
            "peak_reserved_bytes": sum(o["peak_bytes"] for o in outs) + reserved,
            "daemon_bytes": daemon_bytes, "daemon_reserved_bytes": reserved,
            "setup_bytes": [o["setup_bytes"] for o in outs],
            "phase_peak_bytes": [o["phase_peak_bytes"] for o in outs],
            "loss": statistics.mean(o["losses"][-1] for o in outs)}


def report(rows, model):
    by = {r["system"]: r for r in rows}
    plain, peer = by.get("plain"), by.get("FSDP2")
    print(f"\n{model}: median step of {rows[0].get('steps')} after warm-up; peak device memory "
          "with the daemon's arenas whole (reserved) and with what its buffers use")
    print(f"  {'system':10} {'step ms':>8} {'exposed':>8} {'in calls':>8} {'reserved':>9} "
          f"{'used':>6} {'step/FSDP2':>10} {'mem/FSDP2':>9} {'used/FSDP2':>10} {'loss':>7}")
    nan = float("nan")
    for r in rows:
        exposed = r["step_ms"] - plain["step_ms"] if plain else nan
        vs = (r["step_ms"] / peer["step_ms"], r["peak_reserved_bytes"] / peer["peak_bytes"],
              r["peak_bytes"] / peer["peak_bytes"]) if peer and peer["peak_bytes"] else (nan,) * 3
        r.update(exposed_ms=exposed, step_vs_fsdp2=vs[0], memory_vs_fsdp2=vs[1],
                 used_memory_vs_fsdp2=vs[2])
        print(f"  {r['system']:10} {r['step_ms']:8.1f} {exposed:8.1f} {r['in_calls_ms']:8.1f} "
              f"{r['peak_reserved_bytes'] / 2**30:8.2f}G {r['peak_bytes'] / 2**30:5.2f}G "
              f"{vs[0]:9.2f}x {vs[1]:8.2f}x {vs[2]:9.2f}x {r['loss']:7.4f}")
    for r in rows:
        if r["system"].startswith("fsdpd") and peer and peer["peak_bytes"]:
            print(f"  target {r['system']}: step {r['step_vs_fsdp2']:.2f}x <= 1.05x "
                  f"{'met' if r['step_vs_fsdp2'] <= 1.05 else 'MISSED'}; memory "
                  f"{r['memory_vs_fsdp2']:.2f}x <= 1.0x "
                  f"{'met' if r['memory_vs_fsdp2'] <= 1.0 else 'MISSED'} (used: "
                  f"{r['used_memory_vs_fsdp2']:.2f}x)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["blocks24", "1b"])
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--json-out", metavar="FILE")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--model", choices=sorted(MODELS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: torch sees no GPU")
        return 77
    print(f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name(0)}"
                                          if args.device == "cuda" else ", CPU"))
    results = []
    for model in args.models:
        rows = []
        for system in args.systems:
            rows.append(run_system(system, args, model))
            rows[-1]["steps"] = args.steps
            # Each as it comes: a run cut short keeps what it measured.
            print("RESULT " + json.dumps(rows[-1]), file=sys.stderr, flush=True)
        report(rows, model)
        results += rows
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
