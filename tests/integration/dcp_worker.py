"""One process of test_dcp.py: FSDP2's script on the small transformer (fsdp2_worker's model,
batches and AdamW) with fully_shard from torch (fsdp2) or from fsdpd.torch (fully_shard),
which loads a DCP checkpoint of model and optimizer before its steps (--load DIR), trains
--steps steps, saves one after them (--save DIR) through torch.distributed.checkpoint's
own state-dict APIs, and writes OUT/final-rank-R.pt: every parameter and AdamW state whole
(rank 0), for the test to compare.

    dcp_worker.py fsdp2|fully_shard --out OUT --steps N [--load DIR] [--save DIR]

RANK, WORLD_SIZE: the process group (a file store in OUT); with fully_shard the daemon's
socket, job and local rank from the environment too.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp2_worker import ADAMW, emit, end_process_group, micro_batches  # noqa: E402
from shard_model_worker import build  # noqa: E402
from transformer import Block, loss_fn, rank_slice  # noqa: E402


def whole(value):
    """A DTensor's full tensor (a collective), else the value."""
    from torch.distributed.tensor import DTensor
    return value.full_tensor() if isinstance(value, DTensor) else value


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("fsdp2", "fully_shard"))
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--load")
    p.add_argument("--save")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    if args.mode == "fully_shard":
        from fsdpd.torch import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{args.out}/store", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    net = build(False)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    model = fully_shard(net, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    first = 1
    if args.load:
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=args.load)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        first = int(open(os.path.join(args.load, "step")).read()) + 1
    for step in range(first, first + args.steps):
        opt.zero_grad()
        (tokens, targets), = micro_batches(step, False)
        x, y = rank_slice((tokens, targets), rank, world)
        loss = loss_fn(model(x).float(), y)
        loss.backward()
        opt.step()
        emit(step=step, loss=loss.item())
    if args.save:
        dcp.save({"model": get_model_state_dict(model),
                  "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=args.save)
        if rank == 0:
            with open(os.path.join(args.save, "step"), "w") as f:
                f.write(str(first + args.steps - 1))
    params = {n: whole(p.detach()) for n, p in model.named_parameters()}
    moments = {f"{n}.{k}": whole(v) for n, p in model.named_parameters()
               for k, v in opt.state.get(p, {}).items() if k != "step"}
    if rank == 0:
        torch.save({"params": params, "moments": moments},
                   os.path.join(args.out, f"final-rank-{rank}.pt"))
    end_process_group(args.mode)


if __name__ == "__main__":
    main()
