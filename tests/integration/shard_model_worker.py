"""One process of the fsdpd.torch equivalence tests (test_shard_model.py): a local rank
training the small transformer of examples/transformer.py through the daemon, or the
single-process reference training the same model on the whole batch.

    shard_model_worker.py reference|rank --steps N [--world W] [--param-dtype bf16]
        [--strategy S] [--features] [--kill-at-step K] [--device cuda]

With --param-dtype bf16 the reference performs the ranks' mixed-precision computation
itself, rounding for rounding: each of the --world ranks' forward and backward on a bf16
copy of the fp32 masters, their gradients summed in bf16 in rank order and scaled as the
daemon's reduce does (kernels/kernels.h, fsdp_reduce), then the fp32 update. Its
results are then exact, on any CPU, whatever its bf16 kernels round like.

Prints one JSON line per step ({"step", "loss"}; the bf16 reference adds each rank's loss
as "rank_losses") as it goes, then one final line ({"final": true, "state": {name: flat
list}, ...}); a rank whose daemon call fails prints {"error": ...} and exits 3. --features ties the output head to the token embedding, freezes
the positions, and trains each step as two micro-batches (the first under no_sync) with the
gradient clipped to a norm of 0.5; it also round-trips the state dict. --kill-at-step K: the
rank SIGKILLs itself as the backward of step K starts (unless it resumed). --cap-from-step K
--cap N: the rank sets the job's max_inflight to N before step K. --optim adamw|sgd-momentum:
the ranks step with fsdpd.optim's optimizer in the daemon, the reference with torch.optim's
(--clip: both clip to MAX_NORM first).
"""

import argparse
import contextlib
import copy
import json
import math
import os
import signal
import sys
import zlib

import torch

sys.path.insert(0, os.path.join(os.environ["FSDP_SOURCE_DIR"], "examples"))
from transformer import Block, Config, TinyGPT, batch, loss_fn, rank_slice  # noqa: E402
from ieee_sqrt import ieee_sqrt  # noqa: E402

CFG = Config(vocab=300, d_model=32, n_heads=4, n_layers=2, seq_len=16, mlp_ratio=2)
GLOBAL_BATCH = 24  # its halves (the micro-batches) divide by 2, 3 and 4
LR = 1.0
MAX_NORM = 0.5
DEVICE = torch.device("cpu")  # --device: where the reference and the ranks compute


def build(features, meta=False):
    """The model; with meta, on the meta device, for init_by_name to give its values."""
    model = TinyGPT(CFG, seed=7).to("meta" if meta else DEVICE)
    if features:
        model.head.weight = model.tok.weight  # tied
        model.pos.requires_grad_(False)       # frozen
    return model


def init_by_name(model):
    """A param_init_fn whose values depend on each parameter's name alone, not on the order
    modules are made in: the reference applies it to its whole model, the ranks unit by
    unit from the meta device, and both get the same values."""
    names = {id(m): n for n, m in model.named_modules()}

    def init(module):
        for k, p in module.named_parameters(recurse=False):
            name = f"{names[id(module)]}.{k}".lstrip(".")
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            if k == "bias":
                p.zero_()
            elif p.dim() == 1:  # the norms' weights
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return init


def global_batch(step):
    tokens, targets = batch(step, GLOBAL_BATCH, CFG.seq_len, CFG.vocab)
    return tokens.to(DEVICE), targets.to(DEVICE)


def micro_batches(step, features):
    tokens, targets = global_batch(step)
    if not features:
        return [(tokens, targets)]
    half = GLOBAL_BATCH // 2
    return [(tokens[:half], targets[:half]), (tokens[half:], targets[half:])]


def emit(**record):
    print(json.dumps(record), flush=True)


# --optim: the ranks' optimizer and the reference's. "sgd": plain SGD in each trainer (the
# default); "adamw", "sgd-momentum": fsdpd.optim's in the daemon against torch.optim's, with
# weight decay excluded from biases and norms by a group, and an LR schedule.
DAEMON_OPTIM = {"adamw": dict(lr=1e-2, weight_decay=0.1),
                "sgd-momentum": dict(lr=1.0, momentum=0.9, weight_decay=1e-3)}


def no_decay(model):
    """Biases and the norms' weights, by name: the group that takes no weight decay."""
    return [n for n, p in model.named_parameters()
            if p.requires_grad and (n.endswith(".bias") or ".ln" in n or n.startswith("ln"))]


def daemon_units(model):
    """The trainable units shard_model(model, wrap={Block}) registers, in its order (the
    root, then the blocks), each as (name, its parameters in the order of its flat buffer):
    a parameter belongs to the deepest wrapped module holding it."""
    wrapped = [n for n, m in model.named_modules() if n == "" or isinstance(m, Block)]
    units = {w: [] for w in wrapped}
    for pname, p in model.named_parameters():
        if p.requires_grad:
            owner = max((w for w in wrapped if w == "" or pname.startswith(w + ".")),
                        key=lambda w: w.count(".") + 1 if w else 0)
            units[owner].append(p)
    return [(w or "root", ps) for w, ps in units.items() if ps]


def sum_squares(values):
    """fsdp_backend_sum_squares on the host: each element's square (exact in double) added
    in double, in element order."""
    total = 0.0
    for v in values.double().tolist():
        total += v * v
    return total


@torch.no_grad()
def clip_as_the_daemon(model, max_norm, strategy, world, hosts):
    """The daemon's clipping (max_grad_norm), rounding for rounding (daemon/dataplane:
    start_step, start_norm_ring, step_if_every_norm). Each unit's part of the squared norm:
    the squares of each host's gradient shards summed in double (sum_squares); when the
    unit's shard group spans several hosts (FULL_SHARD and SHARD_GRAD_OP across hosts;
    HYBRID_SHARD's group is cluster.shard_group_hosts, 1 by default), each host's part
    rounded to fp32 and added among them in fp32 in the ring's order (host 1's, plus host
    2's, ..., plus host 0's). The units' parts are added in double in registration order,
    the norm is its square root rounded to fp32, and the coefficient is torch's
    clip_grad_norm_'s from that norm. Emits the units it assumed, for the test to check
    against the ranks'."""
    group = hosts if strategy in ("FULL_SHARD", "SHARD_GRAD_OP") else 1
    local = world // hosts
    shards = group * local
    pad = shards * (hosts // group)  # the layout's pad_multiple (daemon/store/topology.c)
    total, units = 0.0, []
    for name, params in daemon_units(model):
        flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else
                          torch.zeros(p.numel(), device=p.device) for p in params])
        units.append({"name": name, "numel": flat.numel()})
        if group == 1:
            total += sum_squares(flat)
            continue
        shard_numel = -(-flat.numel() // pad) * pad // shards
        region = local * shard_numel
        parts = [torch.tensor(sum_squares(flat[h * region:(h + 1) * region]),
                              dtype=torch.float32) for h in range(group)]
        ring = parts[1]
        for part in parts[2:] + parts[:1]:
            ring = ring + part
        total += float(ring)
    norm = torch.tensor(math.sqrt(total), dtype=torch.float32)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return units


def torch_optimizer(model, args):
    """The reference's optimizer and LR schedule (None for plain SGD)."""
    if args.optim == "sgd":
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR), None
    skip = set(no_decay(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n not in skip]},
              {"params": [p for n, p in named if n in skip], "weight_decay": 0.0}]
    kind = args.optim.removeprefix("torch-")
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.SGD
    opt = cls(groups, **DAEMON_OPTIM[kind])
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def ranks_gradients(model, tokens, targets, world, hosts):
    """The daemons' reduce of `world` ranks' gradients, each rank on its slice of the batch:
    summed in fp32 in rank order on each of `hosts` hosts (its world / hosts ranks), the hosts'
    sums then added in host order, times the fp32 nearest 1/world. Returns the ranks' mean
    loss."""
    post = torch.tensor(1.0 / world, dtype=torch.float32)
    per_host = world // hosts
    host_sums, sums, losses = {}, {}, []
    for r in range(world):
        model.zero_grad(set_to_none=True)
        x, y = rank_slice((tokens, targets), r, world)
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        for name, p in model.named_parameters():
            if p.grad is not None:
                first = r % per_host == 0
                host_sums[name] = p.grad.clone() if first else host_sums[name] + p.grad
                if r % per_host == per_host - 1:
                    sums[name] = host_sums[name] if r < per_host else sums[name] + host_sums[name]
    for name, p in model.named_parameters():
        if name in sums:
            p.grad = sums[name] * post
    return sum(losses) / world


def reference(args):
    """One process on the whole batch; with the daemon's optimizer and --world W, the
    gradients are the W ranks' reduced as the daemon does, so that the comparison is of the
    optimizers' arithmetic alone."""
    model = build(args.features)
    if args.meta:  # the ranks' values, made by name
        init = init_by_name(model)
        with torch.no_grad():
            for m in model.modules():
                init(m)
    # Against the daemon's optimizer on a GPU, the step on a CPU copy: the host's arithmetic,
    # which the daemon's kernels compute on the GPU too (no a*b+c contracted), where torch's
    # CUDA optimizers contract it.
    shadow = copy.deepcopy(model).cpu() \
        if DEVICE.type == "cuda" and args.optim in DAEMON_OPTIM else None
    opt, schedule = torch_optimizer(model if shadow is None else shadow, args)
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        model.zero_grad()
        parts = micro_batches(step, args.features)
        total = 0.0
        world, hosts = args.world, args.hosts
        if args.layout_from and step >= args.layout_from[0]:  # a checkpoint loaded elsewhere
            world, hosts = args.layout_from[1:]
        if args.optim != "sgd" and world > 1:
            (tokens, targets), = parts
            parts, total = [], ranks_gradients(model, tokens, targets, world, hosts)
        for tokens, targets in parts:
            loss = loss_fn(model(tokens), targets) / len(parts)
            loss.backward()
            total += loss.item()
        if args.clip and args.daemon_clip:
            units = clip_as_the_daemon(model, MAX_NORM, args.strategy, world, hosts)
            if step == 1:
                emit(units=units)
        elif args.features or args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        # Against the daemon's optimizer, torch.optim's with the IEEE square root that the
        # daemon's kernels take (ieee_sqrt.py says why).
        if shadow is not None:
            for p, q in zip(model.parameters(), shadow.parameters()):
                q.grad = None if p.grad is None else p.grad.cpu()
        with ieee_sqrt() if args.optim in DAEMON_OPTIM else contextlib.nullcontext():
            opt.step()
        if shadow is not None:
            with torch.no_grad():
                for p, q in zip(model.parameters(), shadow.parameters()):
                    p.copy_(q)
        if schedule:
            schedule.step()
        emit(step=step, loss=total)
    emit(final=True, state={k: v.reshape(-1).tolist() for k, v in model.state_dict().items()})


def reference_bf16(args):
    """The ranks' bf16 computation in one process. Matches fsdpd.torch with
    param_dtype=bfloat16 and its defaults (reduce_dtype = param_dtype, gradients averaged
    over the ranks: no pre-scale, a post-scale of 1/world), FULL_SHARD or SHARD_GRAD_OP."""
    masters = build(False)
    low = build(False)
    for p in low.parameters():
        p.data = p.data.to(torch.bfloat16)
    params = dict(masters.named_parameters())
    opt = torch.optim.SGD(masters.parameters(), lr=LR)
    # The daemon's post-scale is the fp32 nearest to 1/world, multiplied in fp32.
    post = torch.tensor(1.0 / args.world, dtype=torch.float32)
    for step in range(1, args.steps + 1):
        tokens, targets = global_batch(step)
        sums, losses = {}, []
        for r in range(args.world):
            with torch.no_grad():
                for name, p in low.named_parameters():
                    p.copy_(params[name])  # the daemon's cast: round to nearest even
            low.zero_grad(set_to_none=True)
            x, y = rank_slice((tokens, targets), r, args.world)
            loss = loss_fn(low(x).float(), y)
            loss.backward()
            losses.append(loss.item())
            for name, p in low.named_parameters():
                # Each addition in fp32, rounded to bf16: the kernel's sum in reduce_dtype.
                g = p.grad
                sums[name] = g if r == 0 else (sums[name].float() + g.float()).bfloat16()
        opt.zero_grad()
        for name, p in params.items():
            p.grad = (sums[name].float() * post).bfloat16().float()
        opt.step()
        emit(step=step, loss=sum(losses) / len(losses), rank_losses=losses)
    emit(final=True, state={k: v.reshape(-1).tolist() for k, v in masters.state_dict().items()})


def rank(args):
    import fsdpd
    import fsdpd.torch

    client = fsdpd.Client(timeout=30)
    # Across hosts, the global rank and world size as torchrun sets them.
    r = int(os.environ.get("RANK", client.rank))
    world = int(os.environ.get("WORLD_SIZE", client.local_world_size))
    param_dtype = torch.bfloat16 if args.param_dtype == "bf16" else None
    net = build(args.features, meta=args.meta)
    model = fsdpd.torch.shard_model(net, client, wrap={Block}, strategy=args.strategy,
                                    param_dtype=param_dtype, max_inflight=args.max_inflight,
                                    param_init_fn=init_by_name(net) if args.meta else None)
    schedule = None
    if args.optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    elif args.optim == "torch-adamw":  # the original parameters, in two groups, in torch's
        opt, schedule = torch_optimizer(model, args)
    else:
        import fsdpd.optim
        cls = fsdpd.optim.AdamW if args.optim == "adamw" else fsdpd.optim.SGD
        opt = cls(model, groups=[{"params": no_decay(build(False)), "weight_decay": 0.0}],
                  max_grad_norm=MAX_NORM if args.clip else None, **DAEMON_OPTIM[args.optim])
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    torch_opt = opt if args.optim == "torch-adamw" else None  # its state is the trainers'
    start = model.completed_steps + 1
    if args.load:  # a job restarted from a checkpoint goes on after its step
        start = model.load_checkpoint(args.load, optimizer=torch_opt) + 1
        for g in opt.param_groups if torch_opt else ():  # the schedule replays below
            g["lr"] = g["initial_lr"]
    for _ in range(start - 1 if schedule else 0):  # a restarted trainer's schedule
        schedule.step()                               # stands where the job does
    emit(resumed=model.resumed, start=start,
         units=[{"name": u.name, "numel": u.numel, "shard": u.shard} for u in model.units])
    if args.features and not model.resumed:
        # A round trip through the full state dict changes nothing.
        sd = model.full_state_dict()
        model.load_full_state_dict(sd)
        assert all(torch.equal(sd[k], v) for k, v in model.full_state_dict().items())
    loader = iter(torch.utils.data.DataLoader(
        Steps(start, args.steps, args.features, client), batch_size=None,
        num_workers=args.loader_workers)) if args.loader_workers else None
    try:
        for step in range(start, args.steps + 1):
            if step == args.cap_from_step:  # the schedule changes between steps
                client.set_schedule(max_inflight=args.cap, forward_prefetch=1,
                                    backward_prefetch=1)
            opt.zero_grad()
            if loader:  # from the DataLoader's worker processes, forked after the client
                parts, refusal = next(loader)
                if refusal:
                    emit(worker_refused=refusal)
            else:
                parts = micro_batches(step, args.features)
            total = 0.0
            for i, (tokens, targets) in enumerate(parts):
                x, y = rank_slice((tokens, targets), r, world)
                loss = loss_fn(model(x).float(), y) / len(parts)
                if step == args.kill_at_step and not model.resumed:
                    loss.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
                if i + 1 < len(parts):
                    with model.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                total += loss.item()
            norm = model.clip_grad_norm_(MAX_NORM) if args.features else None
            opt.step()
            if schedule:
                schedule.step()
            emit(step=step, loss=total, norm=None if norm is None else float(norm))
            if step == args.save_at_step:
                emit(saved=model.save_checkpoint(args.checkpoint, optimizer=torch_opt))
                break
            if step == args.state_dict_at_step:
                round_trip_state_dicts(model, torch_opt, args.checkpoint, r)
    except fsdpd.Error as e:
        emit(error=str(e), status=e.status)
        sys.exit(3)
    if args.optim in DAEMON_OPTIM and client.rank == 0:  # the ranks share the daemon's state
        check_optimizer_state_dict(opt, model)
    state = model.full_state_dict()
    emit(final=True, state={k: v.reshape(-1).tolist() for k, v in state.items()})
    client.close()


class Steps(torch.utils.data.Dataset):
    """Each step's micro-batches, for a DataLoader whose workers fork after the client
    exists; the first item also says how the client refuses a call from a worker."""

    def __init__(self, first, last, features, client):
        self.first, self.last, self.features, self.client = first, last, features, client

    def __len__(self):
        return self.last - self.first + 1

    def __getitem__(self, i):
        refusal = None
        if i == 0:
            try:
                self.client.keepalive()
            except RuntimeError as e:
                refusal = str(e)
        return micro_batches(self.first + i, self.features), refusal


def round_trip_state_dicts(model, opt, directory, r):
    """The model's full and sharded state dicts through torch.save; the masters then zeroed
    through a full one and brought back from this rank's sharded file: the full state dict
    is again what it was, bit for bit. The optimizer's state, by original names, through
    torch.save too, its own cleared in between."""
    osd = model.optim_state_dict(opt)
    assert set(osd["state"]) == {n for n, p in build(False).named_parameters()}
    torch.save(osd, f"{directory}/optim-{r}.pt")
    opt.state.clear()
    model.load_optim_state_dict(opt, torch.load(f"{directory}/optim-{r}.pt"))
    full = model.state_dict()
    assert set(full) == set(build(False).state_dict())
    with model.state_dict_type("sharded", offload_to_cpu=True):
        sharded = model.state_dict()
    with model.state_dict_type("full", rank0_only=True):
        assert bool(model.state_dict()) == (r == 0)
    torch.save(sharded, f"{directory}/sharded-{r}.pt")
    zeros = {k: torch.zeros_like(v) for k, v in full.items()}
    model.load_state_dict(zeros)
    assert all(not v.any() for v in model.state_dict().values())
    model.load_state_dict(torch.load(f"{directory}/sharded-{r}.pt"))
    again = model.state_dict()
    assert all(torch.equal(again[k], v) for k, v in full.items())
    emit(round_trip=sorted(full))


def check_optimizer_state_dict(opt, model):
    """The daemon's optimizer state through state_dict / load_state_dict: read, overwritten
    in the daemon's memory, read back, restored."""
    sd = opt.state_dict()
    units = model._trainable_units()
    assert set(sd["state"]) == {u.name for u in units}
    assert all(s["step"] == units[0].optimizer_steps > 0 for s in sd["state"].values())
    cleared = {"param_groups": sd["param_groups"], "state": {
        name: {k: (0 if k == "step" else torch.zeros_like(v)) for k, v in s.items()}
        for name, s in sd["state"].items()}}
    opt.load_state_dict(cleared)
    assert all(u.optimizer_steps == 0 and all(float(a.abs().sum()) == 0
                                              for a in u.optimizer_state) for u in units)
    opt.load_state_dict(sd)
    back = opt.state_dict()["state"]
    assert all(torch.equal(back[n][k], v) if k != "step" else back[n][k] == v
               for n, s in sd["state"].items() for k, v in s.items())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("reference", "rank"))
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--strategy", default="FULL_SHARD")
    p.add_argument("--features", action="store_true")
    p.add_argument("--kill-at-step", type=int, default=0)
    p.add_argument("--max-inflight", type=int, default=None)
    p.add_argument("--cap-from-step", type=int, default=0,
                   help="from this step on, max_inflight is --cap (SetSchedule)")
    p.add_argument("--cap", type=int, default=1)
    p.add_argument("--optim", choices=("sgd", "torch-adamw", *DAEMON_OPTIM), default="sgd")
    p.add_argument("--daemon-clip", action="store_true",
                   help="with --clip: the reference clips as the daemon does (clip_as_the_daemon) "
                        "instead of with clip_grad_norm_")
    p.add_argument("--clip", action="store_true",
                   help="with --optim: clip the gradient to a norm of MAX_NORM before each step "
                        "(the daemon's max_grad_norm)")
    p.add_argument("--world", type=int, default=1,
                   help="the bf16 reference: how many ranks it computes for")
    p.add_argument("--save-at-step", type=int, default=0,
                   help="after this step, save a checkpoint into --checkpoint and stop")
    p.add_argument("--checkpoint", help="the checkpoints' directory")
    p.add_argument("--meta", action="store_true",
                   help="the model is built on the meta device and initialized by "
                        "init_by_name (the reference too)")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="the ranks take their batches from a DataLoader with this many "
                        "worker processes")
    p.add_argument("--state-dict-at-step", type=int, default=0,
                   help="after this step, round-trip the state dicts through files in "
                        "--checkpoint")
    p.add_argument("--load", help="first load the checkpoint in this directory")
    p.add_argument("--hosts", type=int, default=1,
                   help="with --optim and --world: the ranks' gradients are summed per host "
                        "first, as that many daemons do")
    p.add_argument("--layout-from", type=int, nargs=3, metavar=("STEP", "WORLD", "HOSTS"),
                   help="the reference: from STEP on, --world and --hosts are these (the "
                        "ranks went on from a checkpoint at another layout)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the reference on the GPU, the ranks on a daemon whose backend "
                        "is cuda")
    args = p.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.device == "cuda":  # what deterministic cuBLAS needs
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    bf16_reference = args.mode == "reference" and args.param_dtype == "bf16"
    if bf16_reference and (args.features or args.world < 1):
        p.error("the bf16 reference takes a --world of 1 or more and no --features")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=args.device == "cuda")
    if args.mode == "rank":
        rank(args)
    else:
        (reference_bf16 if bf16_reference else reference)(args)


if __name__ == "__main__":
    main()
