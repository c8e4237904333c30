"""One process of test_pytorch_habits.py: a local rank training the small transformer of
shard_model_worker.py through the daemon as a PyTorch user writes it, or the single process
that trains it with torch's optimizer on the ranks' gradients summed as the daemon sums them.

    pytorch_habits_worker.py reference|rank --steps N [--world W] [--optim O] [--form F]
        [--micro K] [--no-sync] [--checkpoint C] [--strategy S] [--param-dtype bf16]
        [--max-inflight N] [--step-in-backward]

--optim: sgd (torch.optim.SGD in every process), daemon-sgd / daemon-adamw (the ranks step
with fsdpd.optim's SGD with momentum / AdamW, the reference with torch.optim's). --form: how
the ranks make fsdpd.optim's optimizer: "params" (model.parameters()), "groups" (torch's
groups of tensors: no weight decay on biases and norms), "named" (the older AdamW(model,
groups=[names])). Every optimizer but plain SGD has an LR schedule (StepLR, halved every 2
steps). --micro K: each step is K micro-batches, each `(loss / K).backward()`, then one
step() (torch's gradient accumulation); with --no-sync all but the last under
model.no_sync(). --checkpoint: each block runs under
torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) ("default"), also without
torch's early stop of the recomputation ("no-early-stop").

Prints one JSON line per step ({"step", "loss"}, loss the mean over the micro-batches' of
this rank, or for the reference the mean over the ranks) and a final line ({"final": true,
"state": ..., "groups": [...], "optimizer_steps": n}); a failure prints {"error": ...} and
exits 3.
"""

import argparse
import json
import os
import sys

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shard_model_worker import CFG, GLOBAL_BATCH, build, global_batch, no_decay  # noqa: E402
from transformer import Block, loss_fn, rank_slice  # noqa: E402

HYPER = {"sgd": dict(lr=1.0), "daemon-sgd": dict(lr=1.0, momentum=0.9, weight_decay=1e-3),
         "daemon-adamw": dict(lr=1e-2, weight_decay=0.1)}


def emit(**record):
    print(json.dumps(record), flush=True)


def checkpointed(model, how):
    """The model whose forward runs each block as torch's docs write activation
    checkpointing: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)."""
    if how == "none":
        return model

    def forward(tokens):
        x = model.tok(tokens) + model.pos[:tokens.shape[1]]
        for block in model.blocks:
            if how == "no-early-stop":
                with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return model.head(model.ln_f(x))
    model.forward = forward
    return model


def groups_of(named):
    """torch's groups over (name, parameter) pairs: no weight decay on biases and norms."""
    skip = set(no_decay(build(False)))
    return [{"params": [p for n, p in named if n not in skip]},
            {"params": [p for n, p in named if n in skip], "weight_decay": 0.0}]


def schedule(opt, args):
    return None if args.optim == "sgd" else \
        torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def micro_batches(step, k):
    tokens, targets = global_batch(step)
    n = GLOBAL_BATCH // k
    return [(tokens[i * n:(i + 1) * n], targets[i * n:(i + 1) * n]) for i in range(k)]


def reference(args):
    """torch's optimizer on the gradients the daemon reduces: per micro-batch, each rank's
    gradient of (its loss / K) summed in fp32 in rank order and times the fp32 nearest
    1/world (the daemon's reduce), added in fp32 over the micro-batches (the reduces that
    accumulate into the gradient shards)."""
    model = build(False)
    named = list(model.named_parameters())
    if args.optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), **HYPER["sgd"])
    else:
        cls = torch.optim.AdamW if args.optim == "daemon-adamw" else torch.optim.SGD
        opt = cls(model.parameters() if args.form == "params" else groups_of(named),
                  **HYPER[args.optim])
    sched = schedule(opt, args)
    post = torch.tensor(1.0 / args.world, dtype=torch.float32)
    for step in range(1, args.steps + 1):
        acc, losses = {}, []
        for tokens, targets in micro_batches(step, args.micro):
            sums = {}
            for r in range(args.world):
                model.zero_grad(set_to_none=True)
                x, y = rank_slice((tokens, targets), r, args.world)
                loss = loss_fn(model(x), y) / args.micro
                loss.backward()
                losses.append(loss.item())
                for name, p in named:
                    sums[name] = p.grad.clone() if r == 0 else sums[name] + p.grad
            for name, _ in named:
                reduced = sums[name] * post
                acc[name] = reduced if name not in acc else acc[name] + reduced
        for name, p in named:
            p.grad = acc[name]
        opt.step()
        if sched:
            sched.step()
        emit(step=step, loss=sum(losses) / args.world)
    emit(final=True, state={k: v.reshape(-1).tolist() for k, v in model.state_dict().items()})


def rank(args):
    import fsdpd
    import fsdpd.optim
    import fsdpd.torch

    client = fsdpd.Client(timeout=30)
    r, world = client.rank, client.local_world_size
    net = checkpointed(build(False), args.checkpoint)
    model = fsdpd.torch.shard_model(
        net, client, wrap={Block}, strategy=args.strategy, max_inflight=args.max_inflight,
        param_dtype=torch.bfloat16 if args.param_dtype == "bf16" else None)
    named = list(model.named_parameters())
    if args.optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), **HYPER["sgd"])
    else:
        cls = fsdpd.optim.AdamW if args.optim == "daemon-adamw" else fsdpd.optim.SGD
        extra = dict(step_in_backward=True) if args.step_in_backward else {}
        if args.form == "params":
            opt = cls(model.parameters(), **HYPER[args.optim], **extra)
        elif args.form == "groups":
            opt = cls(groups_of(named), **HYPER[args.optim], **extra)
        else:
            opt = cls(model, groups=[{"params": no_decay(build(False)), "weight_decay": 0.0}],
                      **HYPER[args.optim], **extra)
    sched = schedule(opt, args)
    try:
        for step in range(1, args.steps + 1):
            opt.zero_grad()
            total = 0.0
            parts = micro_batches(step, args.micro)
            for i, (tokens, targets) in enumerate(parts):
                x, y = rank_slice((tokens, targets), r, world)
                loss = loss_fn(model(x).float(), y) / args.micro
                if args.no_sync and i + 1 < len(parts):
                    with model.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                total += loss.item()
            opt.step()
            if sched:
                sched.step()
            emit(step=step, loss=total)
    except (fsdpd.Error, RuntimeError) as e:
        emit(error=str(e))
        sys.exit(3)
    groups = [{"names": g.get("param_names"), "numel": [p.numel() for p in g["params"]],
               "lr": g["lr"]} for g in opt.param_groups]
    steps = model.units[1].optimizer_steps if args.optim != "sgd" else 0
    state = model.full_state_dict()
    emit(final=True, state={k: v.reshape(-1).tolist() for k, v in state.items()},
         groups=groups, optimizer_steps=steps)
    client.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("reference", "rank"))
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--optim", choices=tuple(HYPER), default="sgd")
    p.add_argument("--form", choices=("params", "groups", "named"), default="params")
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--no-sync", action="store_true")
    p.add_argument("--checkpoint", choices=("none", "default", "no-early-stop"),
                   default="none")
    p.add_argument("--strategy", default="FULL_SHARD")
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--max-inflight", type=int, default=None)
    p.add_argument("--step-in-backward", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    (rank if args.mode == "rank" else reference)(args)


if __name__ == "__main__":
    main()
