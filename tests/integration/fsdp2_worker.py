"""One process of test_fsdp2.py: a rank training the small transformer of
examples/transformer.py (shard_model_worker's, the same weights and batches) either through
fsdpd (`fsdpd.torch.shard_model`) or under PyTorch's FSDP2 (`fully_shard` per block and at
the root, gloo on the CPU), with torch.optim.AdamW on either side.

    fsdp2_worker.py fsdpd|fsdp2 --out DIR --steps N [--strategy S] [--bf16]
        [--accumulate [--sync-every]] [--clip]

fsdpd: a local rank of the daemon at FSDPD_SOCKET (RANK and WORLD_SIZE across hosts).
fsdp2: global rank RANK of WORLD_SIZE, rendezvous through the file store DIR/store;
HYBRID_SHARD is a 2-D mesh (replicate, shard) of WORLD_SIZE / LOCAL_WORLD_SIZE replicas.
FSDP2 runs every case on the CPU with gloo (bf16 compute included), so FSDP1 stands in for
none.

Each rank prints one JSON line per step ({"step", "loss", "norm"}: its loss on its slice of
the batch, the gradient's norm before clipping with --clip) and writes
DIR/step-K-rank-R.pt after each step: {"grads": {name: (offset, part)}, "params": {...}},
this rank's part of each original parameter's reduced gradient (before clipping) and of the
parameter after the optimizer's step, as a flat tensor and its first element in the
parameter. The test puts the parts together into whole tensors.

--accumulate: each step is two micro-batches, the first without the gradient's sync
(fsdpd's no_sync(), FSDP2's set_requires_gradient_sync(False)); with --sync-every FSDP2
reduce-scatters every micro-batch and adds the reduced shards, as fsdpd's no_sync does.
--clip: the gradient is clipped to a norm of MAX_NORM before the step (fsdpd's
model.clip_grad_norm_, FSDP2's torch.nn.utils.clip_grad_norm_ on its DTensor gradients).
--bf16: parameters computed in bfloat16 and gradients reduced in fp32 (fsdpd's param_dtype
and reduce_dtype, FSDP2's MixedPrecisionPolicy).
--defer-all-reduce (fsdp2, fully_shard, with --accumulate and HYBRID_SHARD): the first
micro-batch under set_requires_all_reduce(False) instead of set_requires_gradient_sync.
--explicit (fsdp2, fully_shard): FSDP2's module methods in use: reshard_after_forward as an
int (1 on even blocks, the world size on odd ones), forward and backward prefetch lists, the
first block gathered before each forward by unshard(async_op=True), the last given back by
reshard() after each step, set_is_last_backward(True).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shard_model_worker import CFG, GLOBAL_BATCH, build  # noqa: E402
from transformer import Block, batch, loss_fn, rank_slice  # noqa: E402

ADAMW = dict(lr=1e-2, weight_decay=0.1, foreach=False)  # one arithmetic on both sides
MAX_NORM = 0.05  # below the gradient's norm at every step, so that each step clips


def end_process_group(mode):
    """destroy_process_group, then, under torch's FSDP2, an exit that skips the
    interpreter's teardown, where gloo's threads now and then abort the process ("terminate
    called without an active exception"; pytorch/pytorch#179291 is about that teardown)
    after everything it had to write is written."""
    import torch.distributed as dist
    dist.destroy_process_group()
    if mode == "fsdp2":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def emit(**record):
    print(json.dumps(record), flush=True)


def micro_batches(step, accumulate):
    tokens, targets = batch(step, GLOBAL_BATCH, CFG.seq_len, CFG.vocab)
    if not accumulate:
        return [(tokens, targets)]
    half = GLOBAL_BATCH // 2
    return [(tokens[:half], targets[:half]), (tokens[half:], targets[half:])]


def train(args, model, parts_of, rank, world, no_sync, clip, save,
          before_forward=lambda: None, after_step=lambda: None):
    """The steps, the same on every side: parts_of(p) is (offset, flat part) of this rank's
    share of parameter p (or of its gradient, grad=True)."""
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    names = [n for n, _ in model.named_parameters()]
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        before_forward()
        parts = micro_batches(step, args.accumulate)
        total = 0.0
        for i, (tokens, targets) in enumerate(parts):
            x, y = rank_slice((tokens, targets), rank, world)
            loss = loss_fn(model(x).float(), y) / len(parts)
            with no_sync(i + 1 < len(parts)):
                loss.backward()
            total += loss.item()
        grads = {n: parts_of(p, grad=True) for n, p in zip(names, model.parameters())
                 if p.grad is not None}  # frozen and unused parameters have none
        norm = float(clip()) if args.clip else None
        opt.step()
        after_step()
        params = {n: parts_of(p) for n, p in zip(names, model.parameters())}
        if save:
            torch.save({"grads": grads, "params": params},
                       os.path.join(args.out, f"step-{step}-rank-{rank}.pt"))
        emit(step=step, loss=total, norm=norm)


def run_fsdpd(args):
    import contextlib

    import fsdpd
    import fsdpd.torch

    client = fsdpd.Client(timeout=30)
    rank = int(os.environ.get("RANK", client.rank))
    world = int(os.environ.get("WORLD_SIZE", client.local_world_size))
    low = torch.bfloat16 if args.bf16 else None
    model = fsdpd.torch.shard_model(build(False), client, wrap={Block}, strategy=args.strategy,
                                    param_dtype=low, reduce_dtype=low and torch.float32)
    # Where each parameter's part lies in it: the sharded state dict's offsets, which are
    # those of named_parameters()'s views.
    with model.state_dict_type("sharded"):
        offsets = {n: e["offset"] for n, e in model.state_dict().items()}
    name_of = {id(p): n for n, p in model.named_parameters()}

    def parts_of(p, grad=False):
        t = p.grad if grad else p
        return offsets[name_of[id(p)]], t.detach().clone()

    def no_sync(skip):
        return model.no_sync() if skip else contextlib.nullcontext()

    train(args, model, parts_of, rank, world, no_sync,
          lambda: model.clip_grad_norm_(MAX_NORM), save=True)
    client.close()


def run_fsdp2(args):
    """FSDP2 as its docs write it; with mode fully_shard, the same script with fully_shard
    and MixedPrecisionPolicy imported from fsdpd.torch (the daemon's socket and the rank's
    job from the environment)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{args.out}/store", rank=rank,
                            world_size=world)
    net = build(False).to("meta") if args.meta else build(False)
    if args.odd_parameters:
        torch.manual_seed(0)  # the unused layers' values, the same on every rank
        for block in net.blocks:
            block.ln1.weight.requires_grad_(False)  # frozen inside a unit
            block.unused = torch.nn.Linear(4, 4)     # never called: no gradient
    hybrid = args.strategy == "HYBRID_SHARD"
    if hybrid:
        per_host = int(os.environ["LOCAL_WORLD_SIZE"])
        mesh = init_device_mesh("cpu", (world // per_host, per_host),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    if args.mode == "fully_shard":
        from fsdpd.torch import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if args.bf16 else MixedPrecisionPolicy()
    kwargs = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=args.strategy != "SHARD_GRAD_OP")
    for i, block in enumerate(net.blocks):
        if args.explicit:  # an int: 1 keeps the copy (FSDP2: on this rank), the world gives it back
            kwargs["reshard_after_forward"] = 1 if i % 2 == 0 else world
        fully_shard(block, **kwargs)
    kwargs["reshard_after_forward"] = args.strategy != "SHARD_GRAD_OP"
    model = fully_shard(net, **kwargs)
    if args.explicit:  # the prefetch lists FSDP2's docs show, one block ahead each way
        blocks = list(net.blocks)
        for before, after in zip(blocks, blocks[1:]):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    if args.meta:  # FSDP2's docs: materialize the sharded model, then initialize it
        model.to_empty(device="cpu")
        _init_sharded(model)
    if args.checkpoint:  # each block's call recomputed in the backward, hooks and all
        for i, block in enumerate(net.blocks):
            net.blocks[i] = _Checkpointed(block)
    # gloo has no ReduceOp.AVG, which FSDP2 uses for fp32 and bf16 reductions: sums, then a
    # division by the world size (a power of two here, so exactly fsdpd's multiplication by
    # its inverse).
    model.set_force_sum_reduction_for_comms(True)

    def parts_of(p, grad=False):
        t = p.grad if grad else p
        return 0, t.detach().full_tensor().reshape(-1).clone()  # a collective

    def no_sync(skip):
        import contextlib
        if args.defer_all_reduce:  # HSDP: the first micro-batch reduce-scatters alone
            model.set_requires_all_reduce(not skip)
        else:
            model.set_requires_gradient_sync(args.sync_every or not skip)
        return contextlib.nullcontext()

    def before_forward():
        """--explicit: the first block gathered before the forward (async, then waited), the
        last one given back after the step, every backward the last."""
        if args.explicit:
            model.set_is_last_backward(True)
            net.blocks[0].unshard(async_op=True).wait()

    def after_step():
        if args.explicit:
            net.blocks[-1].reshard()

    train(args, model, parts_of, rank, world, no_sync,
          lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
          save=rank == 0, before_forward=before_forward, after_step=after_step)
    end_process_group(args.mode)


@torch.no_grad()
def _init_sharded(model):
    """Each parameter's values from its name alone (shard_model_worker's init_by_name),
    written into its DTensor shards: every rank makes the whole and keeps its pieces."""
    import zlib
    from torch.distributed.tensor import distribute_tensor
    for name, p in model.named_parameters():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        if name.endswith("bias"):
            whole = torch.zeros(p.shape)
        elif p.dim() == 1:  # the norms' weights
            whole = torch.ones(p.shape)
        else:
            whole = torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5)
        p.copy_(distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None))


class _Checkpointed(torch.nn.Module):
    """Activation checkpointing of a whole block's call, PyTorch's recommended form."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, x, use_reentrant=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("fsdpd", "fsdp2", "fully_shard"))
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--strategy", default="FULL_SHARD",
                   choices=("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"))
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--accumulate", action="store_true")
    p.add_argument("--sync-every", action="store_true")
    p.add_argument("--clip", action="store_true")
    p.add_argument("--odd-parameters", action="store_true")
    p.add_argument("--checkpoint", action="store_true")
    p.add_argument("--meta", action="store_true")
    p.add_argument("--explicit", action="store_true")
    p.add_argument("--defer-all-reduce", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    (run_fsdpd if args.mode == "fsdpd" else run_fsdp2)(args)


if __name__ == "__main__":
    main()
