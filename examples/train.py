"""The fsdpd demo trainer: one process per local rank trains examples/transformer.py's
TinyGPT with its parameters sharded through a running fsdpd.

Environment (as torchrun sets it, plus fsdpd's own):
  LOCAL_RANK, LOCAL_WORLD_SIZE   this process's local rank and the number of ranks
  FSDPD_SOCKET, FSDPD_JOB        the daemon's socket and the job name
  FSDPD_LIB                      libfsdp.so, when not in the default build tree (build/lib)

    PYTHONPATH=python FSDPD_SOCKET=run/fsdpd.sock FSDPD_JOB=demo LOCAL_RANK=0 \
        LOCAL_WORLD_SIZE=2 .venv/bin/python examples/train.py --steps 30 &
    ... the same with LOCAL_RANK=1 ...

Every rank builds the same model (same seed), hands it to fsdpd.torch.shard_model with one
unit per transformer Block (the root unit takes the embeddings, the final LayerNorm and the
head), and trains with Adam on its slice of each global batch. Adam steps the rank's fp32
master shards, so each rank holds the optimizer state of its shard only.

The loss rank 0 prints is the mean over all ranks, averaged by the daemon itself: every rank
writes its loss into a one-element unit ("demo.loss") and reduce-scatters it, exactly as
gradients are averaged; element 0 of the result lands in rank 0's shard. With equal slices
this is the loss of the whole global batch.

A job the daemon holds already (its trainers ran within store.job_retention, or crashed and
were restarted) goes on after its last completed step, up to --steps; the loss unit's steps
are the model's, which go on too.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformer import Block, Config, TinyGPT, batch, loss_fn, rank_slice  # noqa: E402

import fsdpd  # noqa: E402
import fsdpd.torch  # noqa: E402

LOSS_UNIT = "demo.loss"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30,
                   help="the step the job trains up to (default 30)")
    p.add_argument("--global-batch", type=int, default=8,
                   help="sequences per step over all ranks (default 8)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--d-model", type=int, default=Config.d_model)
    p.add_argument("--layers", type=int, default=Config.n_layers)
    p.add_argument("--timeout", type=float, default=30.0,
                   help="deadline of each call to the daemon, seconds (default 30)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)  # one process per core: the ranks share the host's cores
    cfg = Config(d_model=args.d_model, n_layers=args.layers)

    with fsdpd.Client(timeout=args.timeout) as client:
        rank, world = client.rank, client.local_world_size
        model = fsdpd.torch.shard_model(TinyGPT(cfg, seed=args.seed), client, wrap={Block})
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        # Not the model's (scratch): checkpoints leave it out.
        loss_unit = client.register_unit(LOSS_UNIT, [("loss", (1,), True)], scratch=True)
        first = model.completed_steps + 1
        if rank == 0:
            units = model.units
            n = sum(u.numel for u in units)
            print(f"job {client.job!r}: {world} ranks, {len(units)} units, {n:,} parameters "
                  f"({', '.join(u.name for u in units)}); global batch {args.global_batch} x "
                  f"{cfg.seq_len} tokens", flush=True)
            if model.resumed:
                print(f"the daemon holds the job trained to step {first - 1}: going on "
                      f"from step {first} to {args.steps}", flush=True)

        for step in range(first, args.steps + 1):
            t0 = time.perf_counter()
            tokens, targets = rank_slice(
                batch(step, args.global_batch, cfg.seq_len, cfg.vocab, seed=args.seed),
                rank, world)
            loss = loss_fn(model(tokens), targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step_ms = (time.perf_counter() - t0) * 1e3

            # The mean over ranks, reduced by the daemon (fp32): the backward's Unshard lends
            # the buffer to reduce from. Its steps are the model's, which go on after a
            # restart, past those the unit holds (the daemon refuses an older one).
            loss_unit.unshard(model.step, backward=True)
            loss_unit.reshard(model.step)
            loss_unit.full_grad.zero_()
            loss_unit.full_grad[0] = loss.item()
            loss_unit.reduce_scatter(model.step)
            if rank == 0:
                mean = loss_unit.grad_shard[0].item()
                print(f"step {step:3d}  loss {mean:.4f}  ({step_ms:6.1f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
