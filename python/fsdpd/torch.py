"""fsdpd.torch: shard a torch.nn.Module's parameters through the fsdpd daemon, as FSDP does.

    import fsdpd, fsdpd.torch
    client = fsdpd.Client()                       # FSDPD_SOCKET, FSDPD_JOB, LOCAL_RANK, ...
    model = fsdpd.torch.shard_model(net, client, wrap={Block}, param_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())   # this rank's fp32 master shards
    loss = loss_fn(model(x), y); loss.backward(); model.clip_grad_norm_(1.0); opt.step()

Units. Every instance of a class in `wrap` (or every module the predicate accepts) becomes a
unit, the root unit takes the parameters left over. A parameter shared by several modules
(tied weights) belongs to the deepest wrapped module that contains all of them. Frozen
parameters (requires_grad=False) go into a unit of their own per wrapped module, which is
gathered but never reduced; buffers are never sharded.

Memory. A unit's fp32 master shards and fp32 gradient shards live in the daemon for the
job's life; its unsharded copy (param_dtype) and this rank's full-gradient buffer are lent
from the daemon's bounded pools only while the unit is in flight, as FSDP holds them. The
module's parameters point at views of the copy while the unit is unsharded, and at empty
tensors otherwise; in the backward their .grad are views of the lent full-gradient buffer,
into which autograd accumulates in place (no gradient is allocated or copied in the
trainer). A lent buffer always appears at the same address of this process (the library
maps it there), so the tensors autograd saved in the forward stay valid when the backward
gathers the unit again into another pool buffer.
`model.named_parameters()` yields the original parameters under their names, each this rank's
part of it (a 1-d view of its unit's master shard, possibly empty, whose .grad is the same
part of the gradient shard), as FSDP's use_orig_params: torch.optim works unchanged,
parameter groups included, and its state is sharded too; `model.flat_parameters()` yields
each unit's whole shard instead. `torch.nn.utils.clip_grad_norm_` given every parameter of
the model takes the global norm (`model.clip_grad_norm_`), and refuses a part of them.

State dicts. `model.state_dict()` is full by default (every parameter whole, fp32, under its
original names, with the buffers; `torch.save` it), built one unit at a time;
`with model.state_dict_type("sharded")` each rank's parts with their offsets, which
load_state_dict puts back at this or (given every rank's parts) another world size.

Launchers. Under torchrun the Client takes the job from TORCHELASTIC_RUN_ID and its ranks
and sizes from torchrun's variables; the daemon refuses an attach whose torchrun topology is
not its own. A DataLoader's workers may fork after the Client exists: the Client refuses
their calls, and their end does not touch the parent's session.

GPUs. With a daemon whose backend is cuda, the job's memory is its GPU's: the module is
moved there (`model.device`), the master and gradient shards and the lent buffers are CUDA
tensors over the memory the library maps, and each call to the daemon first waits for the
GPU's work (the daemon reads what the trainer's kernels wrote). The driver maps the daemon's
memory only whole, so a lent copy cannot appear at a fixed address: a unit's parameters view
a copy of it in a storage of the unit's own, which each reshard frees, as FSDP1 does with its
flat parameter (one copy on the GPU per rank while the unit is unsharded, as FSDP holds).
Feed the model inputs on `model.device`; the same code runs on a host daemon with the CPU.

Schedule (one step = one forward of the root): before a unit runs, it is unsharded for the
step; the daemon's gather of a new step is a collective of the local ranks (it waits for
every rank's Unshard of that step, so no rank reads a shard before its owner's optimizer step
is done). The daemon runs the prefetch (SetSchedule): it records the forward order from the
first step, and with forward prefetch gathers the next unit while the current one computes,
with backward prefetch the previous one as a unit's backward starts (FSDP's BACKWARD_PRE).
FULL_SHARD (and HYBRID_SHARD) reshards every unit but the root after its forward, and
unshards it again when its backward starts (a second gather, as FSDP); SHARD_GRAD_OP keeps
the copy until the unit's backward. The backward's Unshard also lends the gradient buffer. When a unit's backward is done it reshards, and its gradients are
reduce-scattered (averaged over the ranks, summed in reduce_dtype) into the gradient shards
while the backward goes on, written or, when the shard's .grad was kept
(zero_grad(set_to_none=False), no_sync), added; the end of the backward waits for them.

Restarts. The masters live in the daemon: a trainer process that dies and starts again
attaches, registers the same model, and finds its units trained (`model.resumed`); it does
not write initial values and goes on at `model.completed_steps + 1`. The optimizer's state is
the trainer's own: with a stateless optimizer (SGD without momentum) the run continues
exactly; otherwise restore the optimizer state yourself. The model's own scratch units go on
after the steps they hold; a unit of the trainer's (a loss to average) must too, as the
daemon refuses a step older than its unit's: number its steps by `model.step`.

Several hosts. The daemon's units span every host (FULL_SHARD, SHARD_GRAD_OP) or a shard
group (HYBRID_SHARD); gradients are averaged over every rank of every host. full_state_dict()
and summon_full_params() read the other local ranks' masters from the job's shared memory
when the host holds every shard, and otherwise gather them exactly through an all-reduce of
a scratch unit (the size of the largest unit, registered on first use).
"""

import contextlib
import fnmatch
import math
import os
import warnings
import weakref

import torch as _torch
from torch import nn as _nn

from fsdpd._nested import cast_floats, tensors

__all__ = ["shard_model", "ShardedModel", "WrapPolicy", "wrap_by_class", "wrap_by_name",
           "wrap_by_size"]

_SYNC_UNIT = "__fsdpd_sync__"
_GATHER_UNIT = "__fsdpd_gather__"
_BUFFER_UNIT = "root#buffers"  # the module's persistent buffers (no module name has a '#')
_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")
_RESHARD_AFTER_FORWARD = ("FULL_SHARD", "HYBRID_SHARD")


_FLOATS = (_torch.float32, _torch.bfloat16, _torch.float16)


def _in_backward():
    """Whether autograd's engine is running a backward on this thread: a module's forward
    then is activation checkpointing's recomputation (torch.utils.checkpoint), as FSDP2's
    hooks tell it."""
    return _torch._C._current_graph_task_id() != -1


def _is_meta(module):
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def _model_dtype(module):
    """A bfloat16 or float16 model's dtype, which its copies then compute in; None for a
    float32 one. Its parameters share one."""
    dtypes = {p.dtype for p in module.parameters()}
    if len(dtypes) > 1:
        raise TypeError(f"fsdpd.torch: the model's parameters are of several dtypes "
                        f"({', '.join(sorted(map(str, dtypes)))}): build it in one, and ask "
                        "for another with param_dtype")
    (dtype,) = dtypes or {_torch.float32}
    return None if dtype == _torch.float32 else dtype


class WrapPolicy:
    """Which modules of a model become units (shard_model's wrap=): select(module) returns
    their names, as named_modules() gives them; the root takes what is left."""

    def __init__(self, select, description):
        self.select = select
        self.description = description

    def __repr__(self):
        return f"<fsdpd.torch.WrapPolicy {self.description}>"


def wrap_by_class(*classes):
    """Every instance of these classes (transformer_auto_wrap_policy)."""
    def select(module):
        return {n for n, m in module.named_modules() if n and isinstance(m, classes)}
    return WrapPolicy(select, f"by class {', '.join(c.__name__ for c in classes)}")


def wrap_by_name(*patterns):
    """Every module whose name matches one of the shell-style patterns ("blocks.?",
    "encoder.layers.*"), as fnmatch matches them."""
    def select(module):
        return {n for n, _ in module.named_modules()
                if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    return WrapPolicy(select, f"by name {', '.join(patterns)}")


def wrap_by_size(min_params):
    """Bottom up, every module whose parameters not already in a unit below it number at
    least min_params (size_based_auto_wrap_policy)."""
    def select(module):
        chosen = set()

        def left_over(name, m):
            count = sum(p.numel() for p in m.parameters(recurse=False))
            for child, c in m.named_children():
                count += left_over(f"{name}.{child}" if name else child, c)
            if name and count >= min_params:
                chosen.add(name)
                return 0
            return count
        left_over("", module)
        return chosen
    return WrapPolicy(select, f"by size, {min_params} parameters or more")


def _guard_clip_grad_norm():
    """torch.nn.utils.clip_grad_norm_ on a sharded model's parameters would clip by the
    norm of this rank's shards alone: given every trainable parameter of one model (either
    form), it takes the norm of the whole gradient through model.clip_grad_norm_; given some
    of them, it refuses, saying so. Other tensors go to torch's own."""
    original = _nn.utils.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, *args, **kwargs):
        params = [parameters] if isinstance(parameters, _torch.Tensor) else list(parameters)
        models = {id(m): m for m in (getattr(p, "_fsdpd_model", lambda: None)()
                                     for p in params) if m is not None}
        if not models:
            return original(params, max_norm, norm_type, *args, **kwargs)
        (model,) = models.values() if len(models) == 1 else (None,)
        given = {id(p) for p in params if p.requires_grad}
        forms = [{id(p) for p in model.parameters() if p.requires_grad},
                 {id(p) for p in model.flat_parameters() if p.requires_grad}] if model else []
        if given not in forms:
            raise RuntimeError("torch.nn.utils.clip_grad_norm_: these are parts of an "
                               "fsdpd.torch model's parameters, whose norm is every rank's "
                               "together: call model.clip_grad_norm_(max_norm) on every rank")
        return model.clip_grad_norm_(max_norm, norm_type)

    _nn.utils.clip_grad_norm_ = clip_grad_norm_
    _nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_


_guard_clip_grad_norm()


class _FlatUnit:
    """One fsdpd unit: the module it wraps, its parameters, and where each step stands."""

    def __init__(self, owner, name, module, params, trainable):
        self.owner = owner
        self.name = name
        self.module = module
        self.params = [p for _, p in params]
        self.trainable = trainable
        self.shapes = [owner._shape(p) for p in self.params]
        spec = [(n, shape, trainable) for (n, _), shape in zip(params, self.shapes)]
        self.unit = owner.client.register_unit(
            name, spec, strategy=owner.strategy, param_dtype=owner.param_dtype,
            reduce_dtype=owner.reduce_dtype)
        u = self.unit
        self.offsets = u.param_offsets
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.empty_data = _torch.empty(0, dtype=u.dtype, device=u.master.device)
        # On a GPU the lent copy is wherever the daemon's pool has it (the driver cannot map
        # part of its memory at an address of ours), so the parameters view a copy of it in
        # this storage instead, as FSDP1 keeps its unsharded flat parameter: freed at each
        # reshard (resize_(0)) and filled again by the next unshard, one storage throughout,
        # so that what autograd saved in the forward reads the backward's gather.
        self.own = _torch.empty(u.padded_numel, dtype=u.dtype, device=u.master.device) \
            if u.device >= 0 else None
        if self.own is not None:  # made by the first unshard: every unit's at once is the model
            self.own.untyped_storage().resize_(0)
        self.own_step = 0  # the step the storage holds (0: freed)
        # How much of its shard this rank steps: all of it, but with NO_SHARD, whose one
        # shard (the whole unit) every rank of a host shares in the host's memory, local rank
        # 0 alone, as each host's one replica (the ranks' optimizers would step it each).
        self.owned = u.shard_numel if owner.strategy != "NO_SHARD" or \
            owner.client.rank == 0 else 0
        # This rank's master shard as an optimizer parameter (shares the mapped memory): the
        # flat form (model.flat_parameters()).
        self.shard_param = _nn.Parameter(u.master_shard[:self.owned], requires_grad=trainable)
        self.shard_param._fsdpd_model = weakref.ref(owner)  # the clip_grad_norm_ guard
        # Each original parameter's part of this rank's shard, as an optimizer parameter of
        # its own (a 1-d view of the same memory, empty when the rank holds none of it), as
        # FSDP's use_orig_params: (name, parameter, begin, end) in the shard's elements.
        lo = u.shard * u.shard_numel
        self.orig = []
        for (pname, _), off, n in zip(params, self.offsets, self.sizes):
            begin = min(max(off, lo), lo + self.owned) - lo
            end = max(min(off + n, lo + self.owned), lo) - lo
            view = _nn.Parameter(u.master_shard[begin:end], requires_grad=trainable)
            view._fsdpd_model = weakref.ref(owner)
            self.orig.append((pname, view, begin, end))
        # What the daemon lends this rank now: the copy of step copy_step (0: none), which
        # stays until this rank reshards, and the full-gradient buffer (grad_lent) from the
        # backward's Unshard until the unit's ReduceScatter ends.
        self.copy_step = 0
        self.grad_lent = False
        self.reducing = False    # a reduce_scatter_async under way
        self.deferred = False    # its last reduce was under no_sync(): the daemon keeps the sum
        self.accumulators = [None] * len(self.params)  # the hooked autograd nodes
        self.ran_step = 0        # the step in which the unit last ran forward
        self.pending = 0         # gradients still to come in this backward
        self.reduced = True      # the gradients of ran_step were reduced (or need not be)
        self.backward_started = False

    def initial_flat(self):
        """The parameters' values as the unit's flat fp32 buffer (padding zeroed)."""
        u = self.unit
        flat = _torch.zeros(u.padded_numel, dtype=_torch.float32, device=u.master.device)
        for off, n, p in zip(self.offsets, self.sizes, self.params):
            flat[off:off + n].copy_(p.detach().reshape(-1))
        return flat

    def write_shard(self, flat):
        """Writes this rank's slice of a flat buffer of the unit into its master shard."""
        u = self.unit
        lo = u.shard * u.shard_numel
        u.master_shard[:self.owned].copy_(flat[lo:lo + self.owned])

    def part(self, i):
        """This rank's part of parameter i: its view, its first element in the parameter and
        how many it holds (0: none, the first then meaningless)."""
        _, view, begin, end = self.orig[i]
        first = self.unit.shard * self.unit.shard_numel + begin - self.offsets[i]
        return view, first, end - begin

    def grads_kept(self):
        """Whether the gradient shard's .grad was kept since the last reduce (zero_grad with
        set_to_none=False, no_sync), in the form the optimizer uses, flat or original."""
        return self.shard_param.grad is not None and \
            all(p.grad is not None for _, p, _, _ in self.orig)

    def point_shard_grads(self):
        """The .grad of the flat and the original parameters: views of the gradient shard."""
        grad = self.unit.grad_shard
        self.shard_param.grad = grad[:self.owned]
        for _, p, begin, end in self.orig:
            p.grad = grad[begin:end]

    def point_params(self, flat):
        """The parameters as views of a flat buffer (the unsharded copy, or a full copy)."""
        for off, n, shape, p in zip(self.offsets, self.sizes, self.shapes, self.params):
            p.data = flat[off:off + n].view(shape)

    def hook_accumulators(self):
        """A hook on each parameter's gradient accumulator, which runs once autograd has added
        the parameter's gradient."""
        for i, p in enumerate(self.params):
            # An accumulator is made for the parameter's shape of the moment: the first is
            # taken while the parameter is whole, and kept (so it stays the parameter's), and
            # hooked once; a graph still alive from an earlier step holds the same one.
            with _torch.enable_grad():  # also from backward's hooks, where it is off
                node = p.expand_as(p).grad_fn.next_functions[0][0]
            if node is not self.accumulators[i]:
                node.register_hook(self.owner._grad_done(self))
                self.accumulators[i] = node

    def point_grads(self):
        """The parameters' .grad as views of the lent full-gradient buffer, zeroed: autograd
        then accumulates into it in place (no gradient is allocated or copied)."""
        full = self.unit.full_grad
        full.zero_()
        for off, n, shape, p in zip(self.offsets, self.sizes, self.shapes, self.params):
            p.grad = full[off:off + n].view(shape)

    def detach_params(self):
        for p in self.params:
            p.grad = None
            p.data = self.empty_data

    def _needs_call(self, step, backward):
        return self.copy_step != step or (backward and self.trainable and not self.grad_lent)

    def settle(self):
        """Ends a reduce under way (its gradient buffer then went back)."""
        if self.reducing:
            self.reducing = False
            self.unit.wait()
            self.grad_lent = False

    def unshard(self, step, backward=False):
        """The copy of step for the forward, or for the backward with the gradient buffer
        (zeroed, and the parameters' .grad pointed at it)."""
        self.settle()
        lent = self.grad_lent
        if self._needs_call(step, backward):
            self.unit.unshard(step, backward=backward)
            self.copy_step = step
            self.grad_lent = self.unit.full_grad is not None
        self.point_params(self._copy_of(step) if self.own is not None else self.unit.unsharded)
        if backward and self.grad_lent and not lent:
            self.point_grads()

    def _copy_of(self, step):
        """The own storage (see __init__), holding the lent copy of step."""
        if self.own_step != step:
            storage = self.own.untyped_storage()
            if storage.size() == 0:
                storage.resize_(self.own.numel() * self.own.element_size())
            self.own.copy_(self.unit.unsharded)
            self.own_step = step
        return self.own

    def reshard(self):
        """Lets go of the copy, so that the daemon's pool can lend it to another unit; the
        parameters point at empty tensors (their gradients stay until the reduce ends)."""
        self.settle()
        for p in self.params:
            p.data = self.empty_data
        if self.own is not None:
            self.own.untyped_storage().resize_(0)
            self.own_step = 0
        if self.copy_step:
            self.unit.reshard(self.copy_step)
            self.copy_step = 0

    def reduce_async(self, step, accumulate, defer_all_reduce, step_optimizer):
        """Starts the reduce of the gradient buffer; the backward goes on meanwhile."""
        self.settle()
        self.unit.reduce_scatter_async(step, accumulate=accumulate,
                                       defer_all_reduce=defer_all_reduce,
                                       step_optimizer=step_optimizer)
        self.reducing = True
        self.deferred = defer_all_reduce

    def step_async(self, step):
        """Starts the daemon optimizer's step over the gradient shards, with no reduce."""
        self.settle()
        self.unit.step_optimizer_async(step)
        self.reducing = True


class ShardedModel(_nn.Module):
    """The model as fsdpd shards it; see the module docstring. The wrapped module is
    `self.module`; parameters()/named_parameters() yield the original parameters' parts of
    the rank's master shards, flat_parameters() the shards whole."""

    def __init__(self, module, client, wrap, strategy, param_dtype, reduce_dtype,
                 forward_prefetch, backward_prefetch, max_inflight, param_init_fn=None,
                 sync_module_states=False):
        super().__init__()
        strategy = str(strategy).upper()
        if strategy not in _STRATEGIES:
            raise ValueError(f"fsdpd.torch: strategy {strategy!r}: expected one of "
                             f"{', '.join(_STRATEGIES)}")
        # Where the daemon keeps the job's buffers, and so where the module computes: its GPU
        # when the daemon's backend is cuda (the parameters become views of that memory).
        self.device = _torch.device(f"cuda:{client.device}" if client.device >= 0 else "cpu")
        # A model built on the meta device: its parameters become empty ones here, their
        # shapes kept aside, and each unit is materialized in turn below.
        self._meta_shapes = {}
        self._uninitialized = []  # modules with meta parameters or buffers, not yet made
        # A policy sees the model as built (its meta parameters have their sizes).
        chosen = wrap.select(module) if isinstance(wrap, WrapPolicy) else None
        self.module = self._take_meta(module) if _is_meta(module) else module.to(self.device)
        self.client = client
        self.strategy = strategy
        self.param_dtype = param_dtype if param_dtype is not None else _model_dtype(module)
        self.reduce_dtype = reduce_dtype
        self.step = 0
        self._sync_count = 0
        self._callback_queued = False
        self._no_sync = False  # inside no_sync(): reduces defer their all-reduce
        self._optimizer = None  # an fsdpd.optim optimizer: the daemon steps the units
        self._units = self._make_units(wrap, chosen)
        # The root module's units keep their copy from the forward to the backward, as FSDP's
        # root does, so they never hold up the pool of the units in flight.
        self._root_units = [fu for fu in self._units if fu.module is module]
        # The daemon records the forward order from the first step and prefetches along it.
        client.set_schedule(max_inflight=max_inflight or 0, reshard_after_forward={
            fu.unit: False for fu in self._root_units},
            forward_prefetch=int(bool(forward_prefetch)),
            backward_prefetch=int(bool(backward_prefetch)))
        self._sync = self._summing_unit(_SYNC_UNIT, 1)
        self._gather = None  # the scratch unit of _full_masters, made on first need
        self._state_dict_kind = ("full", False, False)
        self._global_rank = int(os.environ.get("RANK", client.rank))

        trained = [fu.unit for fu in self._units if fu.unit.gathered_step or fu.unit.reduced_step]
        self.resumed = bool(trained)
        if self.resumed:
            # The job trained before this process attached: the masters are the daemon's.
            # Steps go on after the last backward every rank reduced; a gather of a later
            # step (an eval forward) moves them past it.
            reduced = [fu.unit.reduced_step for fu in self._units if fu.trainable]
            self.completed_steps = min(reduced) if reduced else 0
            gathered = max(fu.unit.gathered_step for fu in self._units)
            self.step = max(self.completed_steps, gathered - 1)
            # Steps up to here may be served from the daemon's copy, gathered before this
            # process came: once masters are written from here, forwards need newer steps.
            self._daemon_gathered = gathered
        else:
            self.completed_steps = 0
            self._daemon_gathered = 0
        # One unit at a time: materialized (from the meta device), its initial values
        # written (unless the daemon has the job's), its parameters emptied.
        for fu in self._units:
            self._materialize(fu.params, param_init_fn)
            if not self.resumed:
                flat = fu.initial_flat()
                fu.write_shard(self._from_rank0(fu, flat) if sync_module_states else flat)
            fu.detach_params()
        self._materialize(None, param_init_fn)  # modules of meta buffers alone
        self.module.to(self.device)  # what of a meta model was elsewhere
        self._buffer_unit, self._buffer_list = self._register_buffers()
        # Resumed: the daemon's buffers (of the job's earlier trainers, or of the checkpoint
        # it resumes from, loaded at the job's first gather) replace the module's at the
        # first forward.
        self._buffers_pending = self.resumed
        if not self.resumed:
            self._write_buffers()

        for fu in self._units:
            fu.module.register_forward_pre_hook(self._pre_forward(fu))
            fu.module.register_forward_hook(self._post_forward(fu))


    def _shape(self, p):
        return self._meta_shapes.get(id(p), tuple(p.shape))

    def _take_meta(self, module):
        """The module with every meta parameter replaced by an empty one on the device (a
        tied one by one parameter), its shape in _meta_shapes, and its meta buffers
        allocated; the modules holding either wait in _uninitialized for _materialize."""
        made = {}
        for m in module.modules():
            meta = False
            for k, p in m._parameters.items():
                if p is None or not p.is_meta:
                    continue
                if id(p) not in made:
                    q = _nn.Parameter(_torch.empty(0, dtype=p.dtype, device=self.device),
                                      requires_grad=p.requires_grad)
                    self._meta_shapes[id(q)] = tuple(p.shape)
                    made[id(p)] = q
                m._parameters[k] = made[id(p)]
                meta = True
            for k, b in m._buffers.items():
                if b is not None and b.is_meta:
                    m._buffers[k] = _torch.empty(b.shape, dtype=b.dtype, device=self.device)
                    meta = True
            if meta:
                self._uninitialized.append(m)
        return module

    def _materialize(self, params, init):
        """Gives the modules still on the meta device that hold any of params (None: all
        that are left) their memory and initial values: init(module) (param_init_fn), else
        the module's reset_parameters(). Each sets the module's own parameters and
        buffers; a module is made once."""
        wanted = None if params is None else {id(p) for p in params}
        for m in list(self._uninitialized):
            own = [p for p in m._parameters.values() if p is not None]
            if wanted is not None and not any(id(p) in wanted for p in own):
                continue
            for p in own:
                if id(p) in self._meta_shapes and p.numel() == 0:
                    p.data = _torch.empty(self._meta_shapes[id(p)], dtype=p.dtype,
                                          device=self.device)
            with _torch.no_grad():
                if init is not None:
                    init(m)
                elif hasattr(m, "reset_parameters"):
                    m.reset_parameters()
                else:
                    raise TypeError(f"fsdpd.torch: a {type(m).__name__} is on the meta device "
                                    "and has no reset_parameters(): pass param_init_fn")
            self._uninitialized.remove(m)

    def _from_rank0(self, fu, flat):
        """Global rank 0's flat initial values of the unit, on every rank
        (sync_module_states): an all-reduce in which the other ranks add zeros."""
        return self._sum_over_ranks(flat.numel(), 0, flat if self._global_rank == 0 else None)

    def _make_units(self, wrap, chosen):
        module = self.module
        if isinstance(wrap, WrapPolicy):
            accept = None
        elif wrap is None:
            accept = lambda m: False  # noqa: E731
        elif callable(wrap) and not isinstance(wrap, (set, frozenset, list, tuple, type)):
            accept = wrap
        else:
            classes = (wrap,) if isinstance(wrap, type) else tuple(wrap)
            accept = lambda m: isinstance(m, classes)  # noqa: E731
        wrapped = [name for name, m in module.named_modules()
                   if name == "" or (name in chosen if accept is None else accept(m))]
        modules = dict(module.named_modules())
        # Deepest first, the root ("") last whatever the depths.
        deepest_first = sorted(wrapped, key=lambda w: -(w.count(".") + 1) if w else 1)

        def contains(w, module_name):
            return w == "" or module_name == w or module_name.startswith(w + ".")

        # The modules holding each parameter: several for a tied one.
        holders = {}
        for mname, m in module.named_modules(remove_duplicate=False):
            for _, p in m.named_parameters(recurse=False):
                holders.setdefault(id(p), []).append(mname)
        groups = {}  # (wrapped module name, trainable) -> [(param name, param)]
        for pname, p in module.named_parameters():  # a tied parameter once, first name
            if p.dtype not in _FLOATS:
                raise TypeError(f"fsdpd.torch: parameter {pname!r} is {p.dtype}: expected "
                                "float32, bfloat16 or float16 (the daemon keeps float32 "
                                "masters made from them)")
            owner = next(w for w in deepest_first
                         if all(contains(w, h) for h in holders[id(p)]))
            groups.setdefault((owner, p.requires_grad), []).append((pname, p))
        units = []
        for mname in wrapped:
            for trainable in (True, False):
                params = groups.get((mname, trainable))
                if params:
                    name = (mname or "root") + ("" if trainable else "#frozen")
                    units.append(_FlatUnit(self, name, modules[mname], params, trainable))
        return units

    # --- forward and backward ----------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._optimizer is not None:
            self._optimizer._sync()  # an LR scheduler's new values, before this step's reduces
        if self._buffers_pending:
            self._resume_buffers()
        self.step += 1
        self._callback_queued = False
        if self.param_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), self.param_dtype)
        return self.module(*args, **kwargs)

    def _pre_forward(self, fu):
        def hook(module, inputs):
            fu.unshard(self.step)
            if not _torch.is_grad_enabled():
                return
            if _in_backward() and (fu.ran_step == self.step or not fu.trainable):
                # Activation checkpointing recomputes the forward of a unit whose backward
                # is under way or next: it needs the copy (gathered again if let go), and
                # the unit's backward goes on as it stood. (A reentrant checkpoint's
                # forward ran without gradients: its recomputation is the unit's forward
                # for the backward that follows it, below.)
                return
            fu.backward_started = False
            if fu.trainable:
                fu.hook_accumulators()
            if fu.ran_step != self.step and fu.trainable:
                fu.ran_step = self.step
                fu.pending = len(fu.params)
                fu.reduced = False
        return hook

    def _post_forward(self, fu):
        def hook(module, inputs, output):
            if not _torch.is_grad_enabled():
                fu.reshard()
                return None
            # A recomputation inside the backward (activation checkpointing) keeps the copy:
            # the tensors it saved for the unit's backward view it, and the copy given back
            # would be another unit's soon (or, with FSDP_FENCES=1, unreadable: a segfault).
            # The unit's reduce lets go of it, or the end of the backward.
            if self.strategy in _RESHARD_AFTER_FORWARD and fu not in self._root_units and \
                    not _in_backward():
                fu.reshard()
            for t in tensors(output):
                if t.requires_grad:
                    t.register_hook(self._pre_backward(fu))
            return None
        return hook

    def _pre_backward(self, fu):
        def hook(grad):
            self._queue_finish()
            if not fu.backward_started:
                fu.backward_started = True
                fu.unshard(self.step, backward=fu.ran_step == self.step)
            return None
        return hook

    def _queue_finish(self):
        if not self._callback_queued:
            opt = self._optimizer
            if opt is not None and opt.step_in_backward and opt._stepped_in_backward:
                raise RuntimeError(
                    "fsdpd.optim: a second backward before optimizer.step(), with "
                    "step_in_backward=True: the daemon stepped in the first already. To "
                    "accumulate gradients, run the backwards but the last under "
                    "model.no_sync(), or make the optimizer with step_in_backward=False "
                    "(the default), which steps at step()")
            self._callback_queued = True
            _torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _grad_done(self, fu):
        def hook(grad_inputs, grad_outputs):
            self._queue_finish()
            fu.pending -= 1
            if fu.pending == 0:
                self._reduce(fu)
        return hook

    def _reduce(self, fu):
        """The unit's backward is done: its copy goes back, and its gradients are reduced
        while the backward goes on (into the gradient shards, or added to them when the
        shard's .grad was kept: zero_grad(set_to_none=False), or no_sync)."""
        if fu.reduced:
            return
        fu.reduced = True
        if not fu.grad_lent:  # a unit whose backward never came: its gradients count as 0
            fu.unshard(fu.ran_step, backward=True)
        fu.reshard()
        keep = fu.grads_kept()
        # fsdpd.optim steps at its step(), as a torch optimizer does (so that gradients
        # accumulate over backwards), or here with step_in_backward, outside no_sync.
        now = self._optimizer is not None and self._optimizer.step_in_backward and \
            not self._no_sync
        if now:
            self._optimizer._stepped_in_backward = True
        fu.reduce_async(fu.ran_step, accumulate=keep, defer_all_reduce=self._no_sync,
                        step_optimizer=now)
        if not keep:
            fu.point_shard_grads()

    def _finish_backward(self):
        """End of backward: units whose parameters did not all get a gradient are reduced
        now (the missing ones count as zero), so no rank waits for one; every reduce is
        waited for (the optimizer reads the gradient shards next), and every unit lets go
        of its copy."""
        for fu in self._units:
            if fu.trainable and fu.ran_step == self.step:
                self._reduce(fu)
        for fu in self._units:
            fu.reshard()
            fu.detach_params()
        if all(fu.reduced for fu in self._units if fu.trainable) and \
                any(fu.trainable for fu in self._units):
            self.completed_steps = self.step
        # The step's buffers, once its reduces ended: a snapshot of the step before has been
        # taken (it holds them), and the daemon's next save (at the next step's gathers, or
        # at a stop once the trainers are gone) holds these.
        self._write_buffers()

    @contextlib.contextmanager
    def no_sync(self):
        """For gradient accumulation: inside, backward passes add their gradients to the
        gradient shards (each unit reduces with accumulate), so the first backward outside
        adds the last micro-batch; the optimizer steps after it. With HYBRID_SHARD the
        reduces inside stop at each host's shard group, as FSDP2's
        set_requires_all_reduce(False) does: the daemon keeps their sum, and the backward
        outside all-reduces it among the replicas once, so the gradient shards hold the
        accumulated gradient only after that backward. The daemon lends full-gradient
        buffers per unit and backward, so none is kept between micro-batches."""
        outer = self._no_sync
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = outer

    # --- collectives of the whole model --------------------------------------------------
    def _summing_unit(self, name, numel):
        """A private NO_SHARD unit whose AllReduce sums over every rank of every host."""
        unit = self.client.register_unit(name, [("x", (numel,), True)], strategy="NO_SHARD",
                                         gradient_predivide_factor=1.0,
                                         gradient_postdivide_factor=1.0, scratch=True)
        # The job's earlier trainers (a process that attaches again) left the unit at their
        # last step, and the daemon refuses an older one: the count goes on after it. Every
        # rank reads the same, since no gather or reduce of a newer step completes before
        # every local rank asks for it, this one included.
        self._sync_count = max(self._sync_count, unit.gathered_step, unit.reduced_step)
        return unit

    def _lend(self, unit):
        """The summing unit's buffer for the next all-reduce, zeroed. The summing units
        share one step count, past the steps either holds."""
        self._sync_count += 1
        unit.unshard(self._sync_count, backward=True)
        unit.reshard(self._sync_count)
        unit.full_grad.zero_()

    def _all_reduce(self, unit):
        unit.reduce_scatter(self._sync_count)

    def _all_reduce_scalar(self, value):
        """The sum of value over every rank; also a barrier."""
        self._lend(self._sync)
        self._sync.full_grad[0] = value
        self._all_reduce(self._sync)
        return float(self._sync.grad[0])

    def _full_masters(self, fu):
        """The unit's whole flat fp32 masters, a fresh tensor; every rank calls it together
        (after a barrier when the host holds every shard)."""
        u = fu.unit
        if u.host_shards * u.shard_numel == u.padded_numel:
            return u.master.clone()  # this host holds every shard
        # Each shard once: adding zeros elsewhere is exact.
        return self._sum_over_ranks(u.padded_numel, u.shard * u.shard_numel,
                                    u.master_shard if u.replica == 0 else None)

    def _sum_over_ranks(self, numel, offset, part):
        """The sum over every rank of every host of a buffer of numel elements, zeros but for
        the part each rank adds at offset (None: nothing), through the gather unit; a fresh
        tensor. Every rank calls it together."""
        g = self._gather_unit()
        self._lend(g)
        if part is not None:
            g.full_grad[offset:offset + part.numel()].copy_(part)
        self._all_reduce(g)
        return g.grad[:numel].clone()

    def _gather_unit(self):
        """The scratch unit of the gathers among every rank, made on first need."""
        if self._gather is None:
            size = max(f.unit.padded_numel for f in self._units)
            self._gather = self._summing_unit(_GATHER_UNIT, size)
        return self._gather

    def _attach_optimizer(self, optimizer):
        """fsdpd.optim's: from now on the daemon steps the units, at optimizer.step() (or in
        the reduces of a step, with step_in_backward)."""
        self._optimizer = optimizer

    def _optimizer_names(self):
        """What fsdpd.optim maps an optimizer's parameters with: {"by_id": {id(parameter):
        its original names}, for the original parameters' parts and the flat shards (every
        name of the unit), "by_name": {name: original parameter's part}, "trainable": the
        names of the trainable ones}."""
        by_id, by_name, trainable = {}, {}, set()
        for fu in self._units:
            by_id[id(fu.shard_param)] = [n for n, _, _, _ in fu.orig]
            for n, view, _, _ in fu.orig:
                by_id[id(view)] = [n]
                by_name[n] = view
                if fu.trainable:
                    trainable.add(n)
        return {"by_id": by_id, "by_name": by_name, "trainable": trainable}

    def _step_optimizer(self):
        """fsdpd.optim's step(): the daemon steps each trainable unit whose gradient shards
        hold a gradient (every one with max_grad_norm, whose norm is all of theirs), once,
        with what the backwards since zero_grad() reduced into them, as torch's optimizers
        step after gradient accumulation, at the step of the last forward. Every local rank
        calls it together.

        The step alone, with no reduce, where the shards hold the gradient. Two cases need a
        reduce, of a zero gradient, that asks for the step: a unit with no gradient since
        zero_grad() (its shards hold an older one, which the reduce overwrites with zeros),
        and one whose last reduce, under no_sync(), left the sum among the shard group to
        the daemon (the reduce adds +0.0 to it, which changes no value, and all-reduces it
        among the replicas into the shards)."""
        units = [fu for fu in self._units if fu.trainable and
                 (fu.grads_kept() or self._optimizer.max_grad_norm)]
        step = self.step
        reduced = []
        try:
            for fu in reversed(units):  # the backward's order
                kept = fu.grads_kept()
                if kept and not fu.deferred:
                    fu.step_async(step)
                    continue
                reduced.append(fu)
                fu.unshard(step, backward=True)  # the gradient buffer, zeroed
                fu.reshard()
                fu.reduce_async(step, accumulate=kept, defer_all_reduce=False,
                                step_optimizer=True)
                if not kept:
                    fu.point_shard_grads()
            for fu in units:
                fu.settle()
        finally:
            for fu in reduced:
                fu.detach_params()

    def _trainable_units(self):
        return [fu.unit for fu in self._units if fu.trainable]

    # --- the module's buffers in the daemon ----------------------------------------------
    def _register_buffers(self):
        """The persistent buffers of the module (BatchNorm's running statistics: its
        state dict's entries that are no parameter) as a unit of the daemon's, NO_SHARD and
        not trainable, so that every checkpoint (the schedule's and the stop's too) and
        `fsdpctl export` hold them under their names. The daemon keeps them in fp32 (an
        integer buffer such as num_batches_tracked exactly up to 2^24). None without any."""
        params = {id(p) for p in self.module.parameters()}
        seen, buffers = set(), []
        for name, t in self.module.state_dict(keep_vars=True).items():
            if id(t) in params or id(t) in seen or not isinstance(t, _torch.Tensor) or \
                    t.is_complex():
                continue
            seen.add(id(t))
            buffers.append((name, tuple(t.shape)))
        if not buffers:
            return None, []
        unit = self.client.register_unit(_BUFFER_UNIT, [(n, s, False) for n, s in buffers],
                                         strategy="NO_SHARD")
        return unit, [n for n, _ in buffers]

    def _module_buffers(self):
        entries = self.module.state_dict(keep_vars=True)
        return [entries[n] for n in self._buffer_list]

    def _write_buffers(self):
        """Local rank 0 copies the module's buffers into the daemon's unit (the host's one
        copy, which a save then holds), between steps: the other ranks' are alike or, as
        FSDP's state dict takes them, not the saved ones."""
        if self._buffer_unit is None or self.client.rank != 0:
            return
        u = self._buffer_unit
        with _torch.no_grad():
            for off, t in zip(u.param_offsets, self._module_buffers()):
                u.master[off:off + t.numel()].copy_(t.detach().reshape(-1))

    def _read_buffers(self):
        """The module's buffers from the daemon's unit (a checkpoint's once loaded)."""
        u = self._buffer_unit
        with _torch.no_grad():
            for off, t in zip(u.param_offsets, self._module_buffers()):
                t.copy_(u.master[off:off + t.numel()].view(t.shape))

    def _resume_buffers(self):
        """At a resumed model's first forward: a gather (which waits for the checkpoint the
        job resumes from, if any), then the daemon's buffers into the module, on every rank
        before local rank 0 writes them again. Also says once that a trainer's own
        optimizer does not resume from the daemon."""
        self._buffers_pending = False
        if self._optimizer is None:
            warnings.warn(
                f"fsdpd.torch: job resumed after step {self.completed_steps} with the "
                "daemon's masters, but no optimizer state of a torch optimizer is kept "
                "there (the daemon's checkpoints hold fsdpd.optim's alone): load it "
                "(load_checkpoint(dir, optimizer=opt), load_optim_state_dict) or it starts "
                "afresh, its moments at zero", stacklevel=3)
        if self._buffer_unit is None:
            return
        self._all_reduce_scalar(0.0)
        self._read_buffers()

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """Scales every gradient shard so that the norm of the whole gradient (all ranks'
        shards together) is at most max_norm; returns that norm before clipping. Every local
        rank calls it."""
        if self._optimizer is not None:
            raise RuntimeError("clip_grad_norm_: the daemon's optimizer (fsdpd.optim) steps "
                               "the units during the backward, before this could clip: give "
                               "it max_grad_norm instead")
        norm_type = float(norm_type)
        if norm_type == float("inf") or norm_type <= 0:
            raise ValueError(f"clip_grad_norm_: norm_type {norm_type} is not supported "
                             "(a positive finite p-norm is)")
        grads = [fu.unit.grad_shard[:fu.owned] for fu in self._units
                 if fu.trainable and fu.grads_kept()]
        # Each shard counts once, however many hosts keep a copy of it.
        local = sum(float(_torch.sum(fu.unit.grad_shard.abs().double() ** norm_type))
                    for fu in self._units if fu.trainable and fu.grads_kept()
                    and fu.unit.replica == 0)
        total = self._all_reduce_scalar(local) ** (1.0 / norm_type)
        # torch 2.13's clip_grad_norm_ from here on, rounding for rounding, so that equal
        # norms clip to equal bits: its total_norm is an fp32 tensor, and its coefficient
        # that tensor's arithmetic (1e-6 added in fp32, max_norm / t as t.reciprocal() *
        # max_norm, clamped to 1). A coefficient of 1 would change no gradient.
        norm = _torch.tensor(total, dtype=_torch.float32)
        coef = _torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
        if coef.item() != 1.0:
            for g in grads:
                g.mul_(coef)
        return norm

    def save_checkpoint(self, directory, optimizer=None):
        """The daemons write the job's state (the units' masters and the daemon optimizer's
        state) into directory/step-N/, N the last completed step, which every rank gets
        back. Every rank calls it between steps, after its optimizer step. A torch
        optimizer given here has its state saved beside, by original names
        (optim_state_dict), as step-N/optimizer.pt (fsdpd.optim's is in the checkpoint).
        The module's buffers are in the checkpoint too."""
        self._write_buffers()
        self._all_reduce_scalar(0.0)  # every rank's masters are final
        if self.client.rank == 0:
            self.client.save_checkpoint(directory, step=self.step)
        self._all_reduce_scalar(0.0)  # the files are written
        if optimizer is not None and optimizer is not self._optimizer:
            state = self.optim_state_dict(optimizer, rank0_only=True)
            if self._global_rank == 0:
                path = os.path.join(os.path.abspath(directory), f"step-{self.step}",
                                    "optimizer.pt")
                _torch.save(state, path + ".tmp")
                os.replace(path + ".tmp", path)
            self._all_reduce_scalar(0.0)
        return self.step

    def load_checkpoint(self, directory, optimizer=None):
        """Reads directory (or its newest step-N/) into the daemons' units, at this model's
        layout whatever the saved one, and goes on after its step N, which every rank gets
        back: the next forward is step N + 1. Every rank calls it between steps; a torch
        optimizer given here takes its state from the checkpoint's optimizer.pt, or, where
        the checkpoint has none (saved with fsdpd.optim, or without optimizer=), starts
        afresh with a warning. A checkpoint of another job (an earlier launch) loads too, and
        with or without the daemon's optimizer on either side (its state is left out, or
        starts at zero, as the daemon's log says). The module's buffers come back with it."""
        self._all_reduce_scalar(0.0)  # nobody is in a step
        first = self.client.rank == 0  # each host's local rank 0 loads its daemon's part
        step = self.client.load_checkpoint(directory) if first else 0
        hosts = self._all_reduce_scalar(1.0 if first else 0.0)
        step = int(self._all_reduce_scalar(float(step)) / hosts)
        self.completed_steps = self.step = step
        self._daemon_gathered = 0
        if self._buffer_unit is not None:
            self._read_buffers()
            self._all_reduce_scalar(0.0)  # read before local rank 0 writes them again
        self._buffers_pending = False
        if optimizer is not None and optimizer is not self._optimizer:
            step_dir = os.path.abspath(directory)
            if not os.path.exists(os.path.join(step_dir, "manifest.json")):
                step_dir = os.path.join(step_dir, f"step-{step}")
            path = os.path.join(step_dir, "optimizer.pt")
            if os.path.exists(path):
                self.load_optim_state_dict(optimizer, _torch.load(path))
            else:
                warnings.warn(f"fsdpd.torch: {step_dir} holds no torch optimizer state "
                              f"(optimizer.pt): the {type(optimizer).__name__} starts afresh, "
                              "its moments at zero (it was saved with fsdpd.optim, whose "
                              "state is the daemon's, or without save_checkpoint's "
                              "optimizer=)", stacklevel=2)
        return step

    @contextlib.contextmanager
    def summon_full_params(self, writeback=True):
        """Inside, the module's parameters are full fp32 copies (what the masters hold, for
        every rank's shard); with writeback, what they hold on leaving is written back into
        this rank's master shards. Every rank enters it together."""
        self._all_reduce_scalar(0.0)  # every rank's masters are final
        flats = []
        for fu in self._units:
            flat = self._full_masters(fu)
            fu.point_params(flat)
            flats.append(flat)
        try:
            yield
        finally:
            if writeback:
                self.step = max(self.step, self._daemon_gathered)
            for fu, flat in zip(self._units, flats):
                if writeback:
                    for off, n, p in zip(fu.offsets, fu.sizes, fu.params):
                        flat[off:off + n].copy_(p.detach().reshape(-1))
                    fu.write_shard(flat)
                fu.detach_params()
            self._all_reduce_scalar(0.0)  # nobody reads masters another rank still writes

    # --- state dicts ---------------------------------------------------------------------
    @contextlib.contextmanager
    def state_dict_type(self, kind, rank0_only=False, offload_to_cpu=False):
        """What state_dict() returns inside (FSDP's state_dict_type): "full", the default,
        every original parameter whole in fp32 (a tied one under each of its names) and the
        buffers, on every rank or, with rank0_only, on global rank 0 alone (the others get
        {}); "sharded", each parameter's part this rank holds, as {"shard": 1-d tensor,
        "offset": its first element in the parameter, "shape": the parameter's}, and the
        buffers. Either is built one unit at a time: beyond the result a rank holds at most
        one unit's full masters. offload_to_cpu: the result's tensors in host memory (with a
        GPU daemon; on the host they are there anyway)."""
        if kind not in ("full", "sharded"):
            raise ValueError(f"state_dict_type {kind!r}: expected 'full' or 'sharded'")
        outer = self._state_dict_kind
        self._state_dict_kind = (kind, bool(rank0_only), bool(offload_to_cpu))
        try:
            yield
        finally:
            self._state_dict_kind = outer

    def _entries(self):
        """The wrapped module's state dict entries (Parameters and buffers, by name) and where
        each parameter lies: {id(param): (unit, index in the unit)}."""
        entries = self.module.state_dict(keep_vars=True)
        where = {id(p): (fu, i) for fu in self._units for i, p in enumerate(fu.params)}
        return entries, where

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The model's state dict as state_dict_type says (full by default), under the
        original names; every rank calls it together."""
        kind, rank0_only, offload = self._state_dict_kind
        keep_copy = (lambda t: t.to("cpu", copy=True)) if offload else (lambda t: t.clone())
        entries, where = self._entries()
        self._all_reduce_scalar(0.0)  # every rank's masters are final
        keep = not rank0_only or self._global_rank == 0
        params = {}
        for fu in self._units:
            names = [(n, where[id(v)][1]) for n, v in entries.items()
                     if id(v) in where and where[id(v)][0] is fu]
            if kind == "sharded":
                for n, i in names:
                    view, first, count = fu.part(i)
                    params[n] = {"shard": keep_copy(view.detach()),
                                 "offset": first if count else 0,
                                 "shape": tuple(fu.shapes[i])}
                continue
            flat = self._full_masters(fu)  # every rank, in the same order
            for n, i in names:
                off, size = fu.offsets[i], fu.sizes[i]
                params[n] = keep_copy(flat[off:off + size].view(fu.shapes[i]))
            del flat
        if not keep:
            return {}
        out = {} if destination is None else destination
        for n, v in entries.items():
            out[prefix + n] = params[n] if n in params else keep_copy(v.detach())
        return out

    def load_state_dict(self, state_dict, strict=True):
        """Loads a state dict of either type (a sharded one's entries may be lists of every
        rank's parts, to load at another world size) into the masters and buffers; every
        rank calls it together, each with what it has to give. Returns nn.Module's
        (missing_keys, unexpected_keys); with strict, either raises as nn.Module does."""
        entries, where = self._entries()
        self._all_reduce_scalar(0.0)  # nobody is in a step
        missing = [n for n in entries if n not in state_dict]
        unexpected = [n for n in state_dict if n not in entries]
        if strict and (missing or unexpected):
            raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys "
                               f"{unexpected}")
        written = set()
        for n, v in entries.items():
            if n not in state_dict:
                continue
            if id(v) not in where:
                v.data.copy_(state_dict[n])  # a buffer
                continue
            fu, i = where[id(v)]
            if (id(fu), i) not in written:  # a tied parameter once
                self._load_param(fu, i, n, state_dict[n])
                written.add((id(fu), i))
        self.step = max(self.step, self._daemon_gathered)
        self._all_reduce_scalar(0.0)  # nobody reads masters another rank still writes
        return _nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _load_param(self, fu, i, name, value):
        """This rank's part of parameter i of unit fu from a full tensor or sharded parts."""
        view, first, count = fu.part(i)
        if isinstance(value, _torch.Tensor):
            if tuple(value.shape) != tuple(fu.shapes[i]):
                raise RuntimeError(f"load_state_dict: {name!r} has shape "
                                   f"{tuple(value.shape)}, the model's is {fu.shapes[i]}")
            view.data.copy_(value.detach().reshape(-1)[first:first + count])
            return
        covered = 0
        for part in value if isinstance(value, (list, tuple)) else [value]:
            if tuple(part["shape"]) != tuple(fu.shapes[i]):
                raise RuntimeError(f"load_state_dict: {name!r} has shape {part['shape']}, "
                                   f"the model's is {fu.shapes[i]}")
            a = max(first, part["offset"])
            b = min(first + count, part["offset"] + part["shard"].numel())
            if a < b:
                view.data[a - first:b - first].copy_(
                    part["shard"][a - part["offset"]:b - part["offset"]])
                covered += b - a
        if covered != count:
            raise RuntimeError(f"load_state_dict: the parts of {name!r} given to this rank "
                               f"hold {covered} of its elements [{first}, "
                               f"{first + count}); give every rank's parts")

    # --- the optimizer's state dict by original names ------------------------------------
    def _orig_params(self):
        """[(name, parameter view, unit, index)] of every trainable original parameter, in
        the same order on every rank."""
        return [(n, v, fu, i) for fu in self._units if fu.trainable
                for i, (n, v, _, _) in enumerate(fu.orig)]

    def _param_index(self, optimizer):
        """The optimizer's parameters as its state_dict numbers them."""
        return [p for g in optimizer.param_groups for p in g["params"]]

    def optim_state_dict(self, optimizer, rank0_only=False):
        """The state dict of a torch optimizer over model.parameters(), keyed by original
        parameter names, each per-element state tensor whole (every rank's parts gathered
        through the daemon, one parameter at a time) and the rest as this rank holds it
        (FSDP's full optimizer state dict); with rank0_only global rank 0 alone gets it.
        load_optim_state_dict loads it at any world size. Every rank calls it together,
        after a step on every rank."""
        index = {id(p): k for k, p in enumerate(self._param_index(optimizer))}
        native = optimizer.state_dict()
        keep = not rank0_only or self._global_rank == 0
        state = {}
        for name, view, fu, i in self._orig_params():
            mine = native["state"].get(index.get(id(view)), {})
            full = {}
            for key in sorted(mine):  # the same keys on every rank once each has stepped
                value = mine[key]
                if isinstance(value, _torch.Tensor) and value.dim() == 1 and \
                        value.numel() == view.numel():
                    full[key] = self._gather_param(fu, i, value)
                else:
                    full[key] = value
            if keep and full:
                state[name] = full
        names = {id(view): name for name, view, _, _ in self._orig_params()}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [names[id(p)] for p in g["params"] if id(p) in names]}
                  for g in optimizer.param_groups]
        return {"state": state, "param_groups": groups} if keep else {}

    def _gather_param(self, fu, i, part):
        """Parameter i of unit fu whole, from every rank's part (part: this rank's)."""
        _, first, count = fu.part(i)
        mine = part if fu.unit.replica == 0 and count else None  # each part once
        return self._sum_over_ranks(fu.sizes[i], first, mine).view(fu.shapes[i])

    def load_optim_state_dict(self, optimizer, state_dict):
        """Loads optim_state_dict's result (of this or another world size) into a torch
        optimizer over model.parameters(): each rank takes its part of every per-element
        state, and each group's hyperparameters from the saved group of the same
        parameters."""
        params = self._param_index(optimizer)
        names = {id(view): (name, fu, i) for name, view, fu, i in self._orig_params()}
        native_state = {}
        for k, p in enumerate(params):
            if id(p) not in names:
                continue
            name, fu, i = names[id(p)]
            saved = state_dict["state"].get(name)
            if not saved:
                continue
            _, first, count = fu.part(i)
            native_state[k] = {
                key: value.reshape(-1)[first:first + count].clone()
                if isinstance(value, _torch.Tensor) and value.numel() == fu.sizes[i] and
                value.dim() > 0 else value
                for key, value in saved.items()}
        saved_groups = {g["params"][0]: g for g in state_dict["param_groups"] if g["params"]}
        groups, k = [], 0
        for g in optimizer.param_groups:
            ids = list(range(k, k + len(g["params"])))
            k += len(g["params"])
            first = next((names[id(p)][0] for p in g["params"] if id(p) in names), None)
            hyper = {key: v for key, v in saved_groups.get(first, g).items() if key != "params"}
            groups.append({**hyper, "params": ids})
        optimizer.load_state_dict({"state": native_state, "param_groups": groups})

    def full_state_dict(self):
        """The full state dict on every rank (state_dict() of type "full")."""
        with self.state_dict_type("full"):
            return self.state_dict()

    def load_full_state_dict(self, state_dict, strict=True):
        """Loads a full state dict (load_state_dict)."""
        return self.load_state_dict(state_dict, strict=strict)

    # --- what the optimizer sees ---------------------------------------------------------
    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """The original parameters under their names (a tied one once, under its first
        name), each this rank's part of it: a 1-d view of the unit's master shard, possibly
        empty, whose .grad is the same part of the gradient shard after the backward, as
        FSDP's use_orig_params. Torch optimizers, parameter groups included, step them."""
        for fu in self._units:
            for name, p, _, _ in fu.orig:
                yield (prefix + "." if prefix else "") + name, p

    def parameters(self, recurse=True):
        for _, p in self.named_parameters():
            yield p

    def named_flat_parameters(self):
        """The flat form: each unit's whole master shard of this rank, named after the
        unit."""
        for fu in self._units:
            yield fu.name, fu.shard_param

    def flat_parameters(self):
        for _, p in self.named_flat_parameters():
            yield p

    @property
    def units(self):
        """The fsdpd.Unit of each unit, in module order (the root's first)."""
        return [fu.unit for fu in self._units]


def shard_model(model, client, wrap=None, strategy="FULL_SHARD", param_dtype=None,
                reduce_dtype=None, forward_prefetch=True, backward_prefetch=True,
                max_inflight=None, param_init_fn=None, sync_module_states=False):
    """Shards model's parameters through client's daemon and returns the model to train.

    wrap: a set of module classes whose instances each become a unit (like
    transformer_auto_wrap_policy), a WrapPolicy (wrap_by_class, wrap_by_name, wrap_by_size),
    or a predicate on a module, or None for one unit; the root takes the rest. strategy:
    FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD (on one host, the same as FULL_SHARD), or
    NO_SHARD (DDP: every rank gathers nothing and all-reduces its gradients; each host keeps
    one replica, which its local rank 0 steps: the other ranks' parameters are empty).
    param_dtype: the unsharded parameters' dtype, in which forward and backward compute
    (floating inputs are cast to it; default: a bfloat16 or float16 model's own dtype);
    reduce_dtype: the gradient reduction's (default param_dtype); masters are float32, made
    from the model's values. max_inflight: how many units' unsharded copies (of those
    resharded after forward) and full-gradient buffers per rank the daemon lends at once,
    FSDP's limit_all_gathers (None: the daemon's store.max_inflight, 2 by default).

    Initial values: every local rank calls this with the same model (same definition, same
    seed) and takes its own slice of them. A model built on the meta device is materialized
    one unit at a time (no rank ever holds the whole model): each module holding a meta
    parameter or buffer gets memory and then param_init_fn(module), or its own
    reset_parameters(), which sets the module's own parameters (recurse=False) the same way
    on every rank. sync_module_states: every rank takes global rank 0's values instead, sent
    through the daemon (an all-reduce in which the other ranks add zeros; a -0.0 arrives as
    0.0)."""
    return ShardedModel(model, client, wrap, strategy, param_dtype, reduce_dtype,
                        forward_prefetch, backward_prefetch, max_inflight, param_init_fn,
                        sync_module_states)


# FSDP2's API over the daemon (fsdpd/fsdp2.py): `from fsdpd.torch import fully_shard`.
from fsdpd.fsdp2 import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402

__all__ += ["fully_shard", "FSDPModule", "MixedPrecisionPolicy"]
