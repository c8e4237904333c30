"""FSDP2's fully_shard on fsdpd: a script written for torch.distributed.fsdp.fully_shard runs
on the daemon by importing fully_shard from fsdpd.torch instead.

    from fsdpd.torch import fully_shard              # instead of torch.distributed.fsdp's
    dist.init_process_group("gloo")                  # the DTensors' collectives, as before
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())      # DTensor parameters, sharded on dim 0
    loss_fn(model(x), y).backward(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()

Each call makes the module's parameters (those no earlier call on a submodule took) one
unit of the daemon's in FSDP2's layout (LAYOUT_PER_PARAM): each parameter cut on dim 0,
each rank's piece of it its own tensor in the daemon's memory. The module's parameters
become DTensors over those pieces (Shard(0) on the mesh), so the optimizer steps the
daemon's masters in place, `state_dict()` is sharded with no communication and
`clip_grad_norm_` works on them unchanged. Before a module's forward the daemon gathers its
unit (one copy per host, shared by its ranks) and the module computes with parameters that
view the copy; after it the module gets its DTensors back (reshard_after_forward); its
backward gathers again, autograd accumulates into the rank's gradient buffer the daemon
lends, and when the module's backward is done (a function on its inputs runs, as FSDP2's)
the daemon reduce-scatters the gradients into the pieces, which the DTensors' .grad view.
The end of the backward waits for the reduces.

The daemon's shards are the mesh's: a 1-D mesh of the job's ranks (FULL_SHARD across every
host's), or HSDP's 2-D mesh (replicas, shards) whose shard groups are the daemon's
(HYBRID_SHARD, cluster.shard_group_hosts); the daemon's socket, job and local rank come from
the environment, as fsdpd.Client's. The process group stays the user's: DTensor's own
collectives (a norm's all-reduce, full_tensor()) run over it.

A module built on the meta device is sharded as it is (shapes only); `to_empty()` keeps its
parameters over the daemon's pieces, which `init_weights()` (or any in-place init of the
DTensors) then writes.

DCP works as with FSDP2: the parameters and the optimizer's state are DTensors, which
torch.distributed.checkpoint's state-dict APIs, dcp.save and dcp.load read and write, at any
world size (test_dcp.py).

The module methods FSDP2 users call: unshard(async_op) and reshard(),
set_modules_to_forward_prefetch / set_modules_to_backward_prefetch (the daemon prefetches
by its own schedule too), set_is_last_backward, set_reshard_after_forward,
set_requires_gradient_sync, set_requires_all_reduce. Not yet: set_gradient_divide_factor,
set_reshard_after_backward.
"""

import atexit
import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdpd._nested import cast_floats, tensors

__all__ = ["fully_shard", "FSDPModule", "MixedPrecisionPolicy"]

_DTYPES = {None: None, torch.float32: "float32", torch.bfloat16: "bfloat16",
           torch.float16: "float16"}


class _Iteration:
    """The process's training iteration: the step (one forward of a root), who is the root
    (the module whose forward began it), and the groups a backward runs."""

    def __init__(self):
        self.client = None
        self.step = 0
        self.root = None
        self.groups = []          # every group, in the order fully_shard made them
        self.callback_queued = False  # a backward runs, its end queued
        self.scheduled = False    # the daemon knows which units reshard after forward
        self.last_backward = True  # the end of a backward waits for its reduces
        self.backward_pending = False  # a forward with a gradient ran, its backward not yet


_ITERATION = _Iteration()


def _client():
    """The process's fsdpd.Client, from the environment (FSDPD_SOCKET, LOCAL_RANK, ...);
    it detaches at the interpreter's exit, before the libraries' own teardown (gRPC's
    threads must not outlive it)."""
    if _ITERATION.client is None:
        import fsdpd
        _ITERATION.client = fsdpd.Client(timeout=30)
        atexit.register(_ITERATION.client.close)
    return _ITERATION.client


def _set_param(owner, attr, param):
    """The parameter registered as owner.attr, without nn.Module's checks (FSDP2 does the
    same to swap a module's sharded and unsharded parameters)."""
    owner._parameters[attr] = param


class _Group:
    """One fully_shard call: its module, its parameters (each owner module and attribute),
    the daemon's unit, the sharded DTensor parameters over the unit's pieces, and the
    unsharded ones over its copy, which the module holds while it computes."""

    def __init__(self, module, params, mesh, reshard_after_forward, mp):
        client = _client()
        self.module = module
        self.owners = [(owner, attr) for owner, attr, _ in params]
        self.mesh = mesh
        self.reshard_after_forward = reshard_after_forward
        self.mp = mp
        originals = [p for _, _, p in params]
        for owner, attr, p in params:
            if p.dim() == 0:  # as FSDP2: dim 0 is what is cut
                raise ValueError(f"fsdpd.torch.fully_shard: parameter '{attr}' of "
                                 f"{type(owner).__name__} is a scalar; a sharded parameter "
                                 "has at least one dimension")
        name = f"fully_shard.{len(_ITERATION.groups)}.{type(module).__name__}"
        self.unit = client.register_unit(
            name, [(f"{i}.{attr}", tuple(p.shape), p.requires_grad)
                   for i, (_, attr, p) in enumerate(params)],
            strategy="HYBRID_SHARD" if mesh.ndim == 2 else "FULL_SHARD",
            param_dtype=_DTYPES[mp.param_dtype], reduce_dtype=_DTYPES[mp.reduce_dtype],
            layout="PER_PARAM")
        u = self.unit
        world = u.padded_numel // u.shard_numel
        # The shard dimension is the mesh's last (HSDP's 2-D mesh: replicas, shards).
        if mesh.ndim not in (1, 2) or mesh.size(mesh.ndim - 1) != world or \
                mesh.get_local_rank(mesh.ndim - 1) != u.shard:
            raise ValueError(
                f"fsdpd.torch.fully_shard: the mesh {mesh} is not the daemon's {world} shards "
                f"with this rank on shard {u.shard}: give a 1-D mesh of the job's ranks, or a "
                "2-D one (replicas, shards) whose shard groups are the daemon's")
        self.placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
        pieces = u.master_pieces()
        with torch.no_grad():
            if not u.reduced_step:  # a job trained before keeps its masters
                for piece, p in zip(pieces, originals):
                    if piece.numel() and not p.is_meta:  # meta: init_weights() writes them
                        piece.copy_(torch.chunk(p.detach().float(), world)[u.shard])
            self.sharded = [nn.Parameter(self._dtensor(piece, p), requires_grad=p.requires_grad)
                            for piece, p in zip(pieces, originals)]
        self.shapes = [tuple(p.shape) for p in originals]
        self.trainable = any(p.requires_grad for p in originals)
        self.fired = [False] * len(originals)  # the parameters whose gradient came
        self.unsharded = None      # made at the first gather: views of the copy
        self.copy_step = 0         # the step of the copy this rank holds (0: none)
        self.ran_step = 0          # the step whose forward ran with a gradient
        self.backward_step = 0     # the step whose backward unsharded
        self.reducing = False
        self.requires_all_reduce = True  # False: the reduce leaves the replicas' all-reduce
        self.deferred = False      # to the next one (set_requires_all_reduce)
        self.started = None        # (step, backward) of an Unshard started, not yet waited
        self.forward_prefetch = []   # groups whose Unshard this one's forward starts
        self.backward_prefetch = []  # and its backward
        self.sharded_state()

    def _dtensor(self, piece, like):
        return DTensor.from_local(piece, self.mesh, self.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())

    def rebind(self):
        """After nn.Module._apply (to_empty() of a module built on the meta device, .to()):
        a parameter the module now holds in place of a sharded one has its values copied
        into the piece and becomes a DTensor over the piece again, so that what is written
        to it next (init_weights()) reaches the daemon."""
        for i, ((owner, attr), piece) in enumerate(zip(self.owners, self.unit.master_pieces())):
            new = owner._parameters[attr]  # the same object, its data set anew, or another
            local = new._local_tensor
            if local.numel() and local.data_ptr() == piece.data_ptr():
                continue
            if not local.is_meta:
                piece.copy_(local)
            self.sharded[i] = nn.Parameter(self._dtensor(piece, new),
                                           requires_grad=new.requires_grad)
        self.sharded_state()

    def sharded_state(self):
        for (owner, attr), p in zip(self.owners, self.sharded):
            _set_param(owner, attr, p)

    def unsharded_state(self):
        for (owner, attr), p in zip(self.owners, self.unsharded):
            _set_param(owner, attr, p)

    def start_unshard(self, step, backward=False):
        """Starts the Unshard of step (a prefetch, or unshard(async_op=True)), unless the
        copy is held or one is under way; unshard() ends it."""
        self.settle()
        if self.started or (self.copy_step == step and not backward):
            return
        self.unit.unshard_async(step, backward=backward)
        self.started = (step, backward)

    def _end_started(self):
        if self.started:
            step, self.started = self.started[0], None  # the client ends it, even failing
            self.unit.wait()
            self.copy_step = step

    def unshard(self, step, backward=False):
        """The copy of step (with backward, the gradient buffer too), the module computing
        with it; a started Unshard of the same is waited for, not asked again."""
        u = self.unit
        self.settle()  # a reduce left in flight (set_is_last_backward(False)) ends first
        ready = self.started and self.started[0] == step and (self.started[1] or not backward)
        self._end_started()
        if not ready and (self.copy_step != step or backward):
            u.unshard(step, backward=backward)
            self.copy_step = step
        if self.unsharded is None:
            # The copy appears at the same address at every gather: views made once.
            self.unsharded = []
            for off, shape, sp in zip(u.param_offsets, self.shapes, self.sharded):
                p = nn.Parameter(u.unsharded[off:off + math.prod(shape)].view(shape),
                                 requires_grad=sp.requires_grad)
                if sp.requires_grad:
                    p.register_post_accumulate_grad_hook(self._accumulated(len(self.unsharded)))
                self.unsharded.append(p)
        self.unsharded_state()

    def reshard(self):
        self._end_started()
        if self.copy_step:
            self.unit.reshard(self.copy_step)
            self.copy_step = 0
        self.sharded_state()

    def gives_back_after_forward(self, root):
        """Whether the copy goes back to the daemon after the forward: True, None but at the
        root (FSDP2's default), or an int of the shard group's size. An int below it, or
        False, keeps the copy, which is the host's: one per host serves the backward."""
        r = self.reshard_after_forward
        if r is None:
            return not root
        if isinstance(r, bool):
            return r
        return r == self.unit.padded_numel // self.unit.shard_numel

    def point_grads(self):
        """The unsharded parameters' .grad: views of the lent gradient buffer, zeroed, into
        which autograd accumulates in place."""
        full = self.unit.full_grad
        full.zero_()
        for off, shape, p in zip(self.unit.param_offsets, self.shapes, self.unsharded):
            p.grad = full[off:off + math.prod(shape)].view(shape) if p.requires_grad else None
        self.fired = [False] * len(self.unsharded)

    def _accumulated(self, i):
        """Parameter i's gradient came."""
        def hook(param):
            self.fired[i] = True
        return hook

    def reduce(self):
        """The module's backward is done: the copy goes back and the gradients are
        reduce-scattered into the pieces, added to them while the sharded .grad are kept
        (accumulation: set_requires_gradient_sync(False) changes nothing else)."""
        if self.reducing or self.backward_step != _ITERATION.step or not self.trainable:
            return
        for p in self.unsharded:
            p.grad = None
        self.unit.reshard(self.copy_step)
        self.copy_step = 0
        # Added to the pieces while some .grad are kept (accumulation); a parameter whose
        # .grad is not (it had no gradient yet) gets its piece zeroed first.
        kept = [p.grad is not None for p in self.sharded]
        keep = any(k for k, p in zip(kept, self.sharded) if p.requires_grad)
        if keep:
            with torch.no_grad():
                for k, piece, p in zip(kept, self.unit.grad_pieces(), self.sharded):
                    if p.requires_grad and not k:
                        piece.zero_()
        self.deferred = not self.requires_all_reduce
        self.unit.reduce_scatter_async(_ITERATION.step, accumulate=keep,
                                       defer_all_reduce=self.deferred)
        self.reducing = True

    def settle(self):
        """Waits for the reduce; the .grad of the sharded parameters whose gradient came
        view their gradient pieces (one that got none keeps None, as FSDP2's)."""
        if not self.reducing:
            return
        self.reducing = False
        self.unit.wait()
        if self.deferred:  # the daemon keeps the sum: the pieces are written by the next
            return         # reduce, which all-reduces both among the replicas
        with torch.no_grad():
            for fired, piece, p in zip(self.fired, self.unit.grad_pieces(), self.sharded):
                if p.requires_grad and p.grad is None and fired:
                    p.grad = self._dtensor(piece, p)


def _pre_forward(group):
    def hook(module, args, kwargs):
        it = _ITERATION
        if it.callback_queued:  # a recomputation in the backward (activation checkpointing)
            group.unshard(it.step)
            return _cast_inputs(group, args, kwargs)
        if it.root is None:  # the outermost module's forward begins the step
            it.root = group
            it.step += 1
            it.backward_pending = False
            it.callback_queued = False
            if not it.scheduled:
                _schedule(group)
        group.unshard(it.step)
        for other in group.forward_prefetch:
            other.start_unshard(it.step)
        args, kwargs = _cast_inputs(group, args, kwargs)
        if torch.is_grad_enabled():
            group.ran_step = it.step
            if group.trainable:
                args, kwargs = _post_backward_on_inputs(group, args, kwargs)
        return args, kwargs
    return hook


class _PostBackward(torch.autograd.Function):
    """Between a module's inputs and its forward (FSDP2's RegisterPostBackwardFunction): its
    backward runs once the module's whole backward has, the gradients of its inputs made, so
    the module reads its copy no more and its gradients are all in."""

    @staticmethod
    def forward(ctx, group, *inputs):
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.group.reduce()
        return (None, *grads)


def _post_backward_on_inputs(group, args, kwargs):
    """args and kwargs with their tensors that need a gradient passed through
    _PostBackward; a module without one is reduced at the backward's end."""
    flat = [t for t in tensors((args, kwargs)) if t.requires_grad]
    if not flat:
        return args, kwargs
    passed = dict(zip(map(id, flat), _PostBackward.apply(group, *flat)))

    def swap(value):
        if isinstance(value, torch.Tensor):
            return passed.get(id(value), value)
        if isinstance(value, (tuple, list)):
            return type(value)(swap(v) for v in value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value
    return swap(args), swap(kwargs)


def _cast_inputs(group, args, kwargs):
    if group.mp.param_dtype is not None and group.mp.cast_forward_inputs:
        return cast_floats((args, kwargs), group.mp.param_dtype)
    return args, kwargs


def _schedule(root):
    """Tells the daemon, at the first forward or gather, which units reshard after forward
    (FSDP2's None: all but the root): it lends those a copy from the job's pool
    (max_inflight of them), and the others a copy of their own, held through the
    backward."""
    it = _ITERATION
    reshard = {g.unit: g.gives_back_after_forward(g is root) for g in it.groups}
    _client().set_schedule(reshard_after_forward=reshard)
    it.scheduled = True


def _outermost():
    """The group whose module no other group's holds: the root before a forward says so."""
    inner = {id(m) for g in _ITERATION.groups for m in g.module.modules() if m is not g.module}
    return next(g for g in reversed(_ITERATION.groups) if id(g.module) not in inner)


def _post_forward(group):
    def hook(module, args, output):
        it = _ITERATION
        if it.callback_queued:  # a recomputation: its backward reads the copy next
            return output
        root = it.root is group
        if root:
            it.root = None
        if output is None or not torch.is_grad_enabled():  # raised (always_call), or eval
            group.reshard()
            if root:  # no backward ends this step: its prefetches end here
                for g in it.groups:
                    if g.started:
                        g.reshard()
        else:
            if group.gives_back_after_forward(root):
                group.reshard()
            elif not isinstance(group.reshard_after_forward, bool) and \
                    group.reshard_after_forward is not None:
                group.sharded_state()  # an int: the module's parameters go back, the copy stays
            for t in tensors(output):
                if t.requires_grad:
                    t.register_hook(_pre_backward(group))
                    it.backward_pending = it.backward_pending or root
        if group.mp.output_dtype is not None:
            output = cast_floats(output, group.mp.output_dtype)
        return output
    return hook


def _pre_backward(group):
    def hook(grad):
        it = _ITERATION
        if not it.callback_queued:
            it.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(_finish_backward)
        if group.backward_step != it.step and group.ran_step == it.step:
            group.backward_step = it.step
            group.unshard(it.step, backward=group.trainable)
            if group.trainable:
                group.point_grads()
            for other in group.backward_prefetch:
                if other.ran_step == it.step and other.backward_step != it.step:
                    other.start_unshard(it.step, backward=other.trainable)
        return None
    return hook


def _finish_backward():
    """End of backward: the groups whose gradients did not all come are reduced now (the
    missing ones count as zero, so no rank waits for one), every reduce is waited for (the
    optimizer reads the pieces next; with set_is_last_backward(False), at the module's next
    gather instead), and every module holds its DTensors again."""
    it = _ITERATION
    for g in it.groups:
        if g.backward_step == it.step:
            g.reduce()
    for g in it.groups:
        if it.last_backward:
            g.settle()
        g.reshard()
    it.callback_queued = False
    it.backward_pending = False


class FSDPModule:
    """What fully_shard adds to a module's class (FSDP2's FSDPModule)."""

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """Accepted, and the same either way: fsdpd reduces every backward into the pieces
        and adds to them while their .grad are kept, as FSDP2 does with the sync on. (FSDP2
        with it off holds each rank's unsharded gradients until the last micro-batch, one
        buffer per unit and rank; the daemon lends those per backward.)"""
        del requires_gradient_sync, recurse

    def unshard(self, async_op=False):
        """Gathers the module's parameters now (for the coming forward, or the one under
        way): the module holds them unsharded until reshard(), and its forward gathers
        nothing more. async_op: returns a handle whose wait() ends the gather."""
        g = self._fsdpd_group
        it = _ITERATION
        if not it.scheduled:  # a gather before the first forward: the daemon learns first
            _schedule(_outermost())
        # During a step (its forward, the backward it waits for) the step's copy; between
        # steps, the next one's.
        current = it.root is not None or it.callback_queued or it.backward_pending
        step = it.step if current else it.step + 1
        g.start_unshard(step)
        handle = _UnshardHandle(g, step)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self):
        """Gives the module's gathered parameters back: it holds its DTensors again."""
        self._fsdpd_group.reshard()

    def set_modules_to_forward_prefetch(self, modules):
        """The modules whose gather this module's forward starts once its own is done."""
        self._fsdpd_group.forward_prefetch = [_group(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules):
        """The modules whose backward's gather this module's backward starts."""
        self._fsdpd_group.backward_prefetch = [_group(m) for m in modules]

    def set_is_last_backward(self, is_last_backward):
        """False: the end of a backward leaves its reduces in flight (the next micro-batch's
        gathers end them), as FSDP2 does; True, FSDP2's default: it waits for them."""
        _ITERATION.last_backward = bool(is_last_backward)

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        """HSDP: False reduce-scatters within the shard group and leaves the all-reduce among
        the replicas to the next backward that asks for it, which all-reduces the sum of
        both (the daemon keeps the partial sum); the sharded .grad are set then, as FSDP2's
        are once the all-reduce ran."""
        for g in _groups_of(self, recurse):
            g.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        """From the next step on (the daemon hears it at the next forward)."""
        for g in _groups_of(self, recurse):
            g.reshard_after_forward = reshard_after_forward
        _ITERATION.scheduled = False

    def _apply(self, *args, **kwargs):
        """nn.Module's, the sharded parameters kept over the daemon's pieces (FSDP2's
        `reset_sharded_param`): to_empty() and init_weights() on a module built on the meta
        device write the masters."""
        groups = _groups_of(self, True)
        for g in groups:
            g.reshard()
        result = super()._apply(*args, **kwargs)
        with torch.no_grad():
            for g in groups:
                g.rebind()
        return result

    def set_force_sum_reduction_for_comms(self, enable):
        """fsdpd sums the ranks' gradients, then multiplies by 1 / world (the same bits as
        a division when world is a power of two): nothing to change."""


class _UnshardHandle:
    """FSDP2's UnshardHandle: wait() ends the gather the module's unshard() started."""

    def __init__(self, group, step):
        self.group, self.step = group, step

    def wait(self):
        self.group.unshard(self.step)


def _group(module):
    g = getattr(module, "_fsdpd_group", None)
    if g is None:
        raise ValueError(f"fsdpd.torch: {type(module).__name__} was not given to fully_shard")
    return g


def _groups_of(module, recurse):
    modules = module.modules() if recurse else [module]
    return [m._fsdpd_group for m in modules if getattr(m, "_fsdpd_group", None)]


def fully_shard(module, *, mesh=None, reshard_after_forward=None, mp_policy=None,
                ignored_params=None, **unsupported):
    """FSDP2's fully_shard (see the module docstring): the module's parameters, but those
    an earlier call on a submodule took and ignored_params, become one unit of the daemon's.
    mesh: a 1-D DeviceMesh of the job's ranks (None: one over the default process group), or
    a 2-D one (replicas, shards) for HSDP.
    reshard_after_forward: True, False, None (True but for the root), or an int dividing the
    shard size: that size gives the copy back after the forward as True does; a smaller one
    keeps the host's copy for the backward (fsdpd's post-forward group is the host, whose
    ranks share one copy) while the module holds its DTensors. mp_policy: FSDP2's
    MixedPrecisionPolicy (param_dtype, reduce_dtype, output_dtype, cast_forward_inputs).
    Returns the module, whose class is now also an FSDPModule."""
    if unsupported:
        raise TypeError(f"fsdpd.torch.fully_shard: {', '.join(sorted(unsupported))} not "
                        "supported yet")
    if not isinstance(reshard_after_forward, (bool, int, type(None))):
        raise TypeError(f"fsdpd.torch.fully_shard: reshard_after_forward "
                        f"{reshard_after_forward!r} is not a bool, an int or None")
    if mesh is None:
        import torch.distributed as dist
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fsdpd.torch.fully_shard: mesh {mesh!r} is not a DeviceMesh")
    shards = mesh.size(mesh.ndim - 1)
    if not isinstance(reshard_after_forward, (bool, type(None))) and \
            not (1 <= reshard_after_forward <= shards and shards % reshard_after_forward == 0):
        raise ValueError(f"fsdpd.torch.fully_shard: reshard_after_forward "
                         f"{reshard_after_forward} must divide the mesh's shard size {shards}")
    mp = mp_policy or MixedPrecisionPolicy()
    ignored = {id(p) for p in (ignored_params or ())}
    taken = {id(p) for m in module.modules() if getattr(m, "_fsdpd_group", None)
             for p in m._fsdpd_group.sharded}
    params, seen = [], set()
    for owner_name, owner in module.named_modules():
        for attr, p in owner.named_parameters(recurse=False):
            if p is None or id(p) in ignored or id(p) in taken or id(p) in seen:
                continue
            seen.add(id(p))
            params.append((owner, attr, p))
    if not params:
        raise ValueError(f"fsdpd.torch.fully_shard: {type(module).__name__} has no parameter "
                         "left to shard")
    group = _Group(module, params, mesh, reshard_after_forward, mp)
    module._fsdpd_group = group
    _ITERATION.groups.append(group)
    module.register_forward_pre_hook(_pre_forward(group), with_kwargs=True)
    module.register_forward_hook(_post_forward(group), always_call=True)
    cls = type(module)
    if not issubclass(cls, FSDPModule):
        module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return module
