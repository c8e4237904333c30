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
  fsdpd x2  the same with two trainers sharing the GPU, each on half the batch
  fsdpd+opt the daemon's AdamW (fsdpd.optim.AdamW) stepping each unit on the GPU as its
            gradients are reduced, one trainer

Measured, per system: the step (forward, backward, optimizer step, then
torch.cuda.synchronize: the slowest trainer's, median of --steps after --warmup), peak
device memory (the trainers' torch.cuda.max_memory_allocated summed, plus the bytes the
daemon's job holds at the end: its pools keep the buffers they made, so this is its peak),
and exposed communication: the step minus plain's (the same compute, nothing else). The
ratios against FSDP2 are printed with the issue's targets (step at most 1.05x, memory at
most 1.0x). --device cpu runs the same on the host (gloo, the host backend) with a tiny
model: a check of the bench itself. Exits 77 without a GPU.
"""

import argparse
import gc
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

MODELS = {  # Config's sizes
    "blocks24": dict(vocab=8192, d_model=1024, n_heads=16, n_layers=24, seq_len=512),
    "1b": dict(vocab=8192, d_model=2048, n_heads=16, n_layers=20, seq_len=512),
    "tiny": dict(vocab=256, d_model=64, n_heads=4, n_layers=4, seq_len=32),  # --device cpu
}
SYSTEMS = ("plain", "FSDP2", "fsdpd", "fsdpd x2", "fsdpd+opt")
LR = 1e-4
TIMEOUT = 600


# --- one trainer -----------------------------------------------------------------------------

def _fully_shard(net, block_class, device):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = [m for m in net.modules() if isinstance(m, block_class)]
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    model = fully_shard(net, mesh=mesh, mp_policy=mp)
    for block, after in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([after])
    return model


def worker(args):
    import torch
    sys.path.insert(0, str(SOURCE_DIR / "examples"))
    sys.path.insert(0, str(SOURCE_DIR / "python"))
    from transformer import Block, Config, TinyGPT, batch, loss_fn, rank_slice

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    cfg = Config(**MODELS[args.model])
    rank, world = args.rank, args.world
    net = TinyGPT(cfg, seed=0).to(device)
    fused = {"fused": True} if cuda else {}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.worker == "plain")
    client = None
    if args.worker.startswith("fsdpd"):
        import fsdpd
        import fsdpd.optim
        import fsdpd.torch
        client = fsdpd.Client(rank=rank, local_world_size=world, timeout=120)
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

    times, losses = [], []
    for step in range(args.warmup + args.steps):
        tokens, targets = (t.to(device) for t in rank_slice(
            batch(step, args.global_batch, cfg.seq_len, cfg.vocab), rank, world))
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        with autocast:
            logits = model(tokens)
        loss = loss_fn(logits.float(), targets)
        loss.backward()
        opt.step()
        sync()
        t1 = time.perf_counter()
        losses.append(loss.item())
        if step >= args.warmup:
            times.append((t1 - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    print(json.dumps({"rank": rank, "step_ms": times, "losses": losses, "peak_bytes": peak}),
          flush=True)
    if client is not None:
        client.close()
    elif args.worker == "FSDP2":
        torch.distributed.destroy_process_group()
    return 0


# --- the bench -------------------------------------------------------------------------------

class Daemon:
    """fsdpd on the GPU (or the host's memory with --device cpu) in a temporary run dir."""

    def __init__(self, tmp, device):
        self.run_dir = tmp / "run"
        self.log_path = tmp / "fsdpd.log"
        backend = ["--backend", "cuda", "--set", "memory.job_limit=64GiB",
                   "--set", "memory.limit=80GiB"] if device == "cuda" else []
        self.proc = subprocess.Popen(
            [str(BUILD_DIR / "bin" / "fsdpd"), "--run-dir", str(self.run_dir),
             "--metrics-listen", "127.0.0.1:0", *backend],
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")})
        deadline = time.monotonic() + 60
        while b"serving on" not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"fsdpd did not serve:\n{self.log_path.read_text()}")
            time.sleep(0.05)

    def job_bytes(self):
        out = subprocess.run([str(BUILD_DIR / "bin" / "fsdpctl"), "--socket",
                              str(self.run_dir / "fsdpd.sock"), "--json", "status"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return sum(j["used_bytes"] for j in json.loads(out)["memory"]["jobs"])

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
        daemon = Daemon(Path(tmp), args.device) if system.startswith("fsdpd") else None
        env = {k: v for k, v in os.environ.items() if not k.startswith("FSDPD_")}
        env.update(FSDP_SOURCE_DIR=str(SOURCE_DIR), PYTHONUNBUFFERED="1")
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
            daemon_bytes = daemon.job_bytes() if daemon else 0
        finally:
            if daemon:
                daemon.stop()
    steps = [max(o["step_ms"][i] for o in outs) for i in range(args.steps)]
    return {"system": system, "model": model, "step_ms": statistics.median(steps),
            "peak_bytes": sum(o["peak_bytes"] for o in outs) + daemon_bytes,
            "daemon_bytes": daemon_bytes, "loss": statistics.mean(o["losses"][-1] for o in outs)}


def report(rows, model):
    by = {r["system"]: r for r in rows}
    plain, peer = by.get("plain"), by.get("FSDP2")
    print(f"\n{model}: median step of {rows[0].get('steps')} after warm-up; peak device memory")
    print(f"  {'system':10} {'step ms':>9} {'exposed ms':>10} {'peak GiB':>9} {'daemon GiB':>10}"
          f" {'step/FSDP2':>10} {'mem/FSDP2':>9} {'loss':>8}")
    for r in rows:
        exposed = r["step_ms"] - plain["step_ms"] if plain else float("nan")
        vs = (r["step_ms"] / peer["step_ms"], r["peak_bytes"] / peer["peak_bytes"]) \
            if peer and peer["peak_bytes"] else (float("nan"),) * 2
        r.update(exposed_ms=exposed, step_vs_fsdp2=vs[0], memory_vs_fsdp2=vs[1])
        print(f"  {r['system']:10} {r['step_ms']:9.1f} {exposed:10.1f} "
              f"{r['peak_bytes'] / 2**30:9.2f} {r['daemon_bytes'] / 2**30:10.2f} "
              f"{vs[0]:9.2f}x {vs[1]:8.2f}x {r['loss']:8.4f}")
    for r in rows:
        if r["system"].startswith("fsdpd") and peer and peer["peak_bytes"]:
            print(f"  target {r['system']}: step {r['step_vs_fsdp2']:.2f}x <= 1.05x "
                  f"{'met' if r['step_vs_fsdp2'] <= 1.05 else 'MISSED'}; memory "
                  f"{r['memory_vs_fsdp2']:.2f}x <= 1.0x "
                  f"{'met' if r['memory_vs_fsdp2'] <= 1.0 else 'MISSED'}")
        print("RESULT " + json.dumps(r), file=sys.stderr)


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
            print(f"  {model} {system}: {rows[-1]['step_ms']:.1f} ms", flush=True)
        report(rows, model)
        results += rows
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
