"""fsdpd.torch: shard a torch.nn.Module's parameters through the fsdpd daemon.

    import fsdpd, fsdpd.torch
    client = fsdpd.Client()                       # FSDPD_SOCKET, FSDPD_JOB, LOCAL_RANK, ...
    model = fsdpd.torch.shard_model(net, client, wrap={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)   # this rank's fp32 master shards
    loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()

First increment (fp32 only): every instance of a class in `wrap` becomes a unit, the root
unit takes the parameters left over; only parameters with requires_grad are sharded (frozen
ones and buffers stay local to each rank).

Schedule (documented limitation): a unit is unsharded by a forward pre-hook and stays
unsharded until its gradients are reduce-scattered in backward, i.e. the memory behaviour
of SHARD_GRAD_OP whatever `strategy` says; FULL_SHARD's reshard after forward and re-gather
in backward come next. A forward without grad (torch.no_grad(), eval) reshards right after
the unit runs.

Between ranks: every forward of the root starts with a barrier (a ReduceScatter of a tiny
private unit) so that no rank unshards before every rank has finished its optimizer step and
let go of the previous step's unsharded buffers (the daemon's Unshard reads the masters as
they are and reuses a buffer some rank still holds).
"""

import torch as _torch
from torch import nn as _nn

__all__ = ["shard_model", "ShardedModel"]

_BARRIER_UNIT = "__fsdpd_barrier__"
_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


class _FlatUnit:
    """One fsdpd unit: the module it wraps, its parameters and their hooks."""

    def __init__(self, owner, name, module, params):
        self.owner = owner
        self.name = name
        self.module = module
        self.params = [p for _, p in params]
        self.names = [n for n, _ in params]
        spec = [(n, tuple(p.shape), True) for n, p in params]
        self.unit = owner.client.register_unit(name, spec, strategy=owner.strategy)
        u = self.unit
        self.offsets = u.param_offsets
        self.sizes = [p.numel() for p in self.params]
        self.shapes = [tuple(p.shape) for p in self.params]
        # This rank's master shard as an optimizer parameter (shares the mapped memory).
        self.shard_param = _nn.Parameter(u.master_shard, requires_grad=True)
        assert self.shard_param.data_ptr() == u.master_shard.data_ptr()
        self.unsharded = False
        self.pending = 0       # gradients still to come in this backward
        self.reduced = True    # this step's gradients were reduce-scattered
        self.hooks = []

    def write_initial_shard(self):
        """Writes this rank's slice of the flat initial values into its master shard."""
        u = self.unit
        flat = _torch.zeros(u.padded_numel, dtype=_torch.float32)
        for off, n, p in zip(self.offsets, self.sizes, self.params):
            flat[off:off + n].copy_(p.detach().reshape(-1))
        lo = u.shard * u.shard_numel
        u.master_shard.copy_(flat[lo:lo + u.shard_numel])

    def point_params_at_unsharded(self):
        flat = self.unit.unsharded
        for off, n, shape, p in zip(self.offsets, self.sizes, self.shapes, self.params):
            p.data = flat[off:off + n].view(shape)

    def detach_params(self):
        # The views stay valid memory (the mapping lives until close) but are no longer
        # guaranteed to hold this unit: drop them so that misuse shows as an empty tensor.
        for p in self.params:
            p.data = _torch.empty(0, dtype=p.dtype)

    def unshard(self, step):
        if not self.unsharded:
            self.unit.unshard(step)
            self.unsharded = True
        self.point_params_at_unsharded()

    def reshard(self, step):
        if self.unsharded:
            # The parameters keep pointing at the unsharded buffer (still mapped; autograd
            # may still accumulate a gradient into them in this backward); the next forward
            # points them at the freshly gathered one.
            self.unit.reshard(step)
            self.unsharded = False


class ShardedModel(_nn.Module):
    """The model as fsdpd shards it. parameters()/named_parameters() yield the rank's fp32
    master shards (one Parameter per unit), which is what an optimizer should step; the
    wrapped module is `self.module`."""

    def __init__(self, module, client, wrap, strategy):
        super().__init__()
        strategy = str(strategy).upper()
        if strategy not in _STRATEGIES:
            raise NotImplementedError(f"fsdpd.torch: strategy {strategy!r} is not supported "
                                      f"yet (only {', '.join(_STRATEGIES)})")
        self.module = module
        self.client = client
        self.strategy = strategy
        self.step = 0
        self._barrier_count = 0
        self._callback_queued = False
        self._units = []

        # Owner of each sharded parameter: its deepest wrapped ancestor, else the root.
        wrapped = {}  # module name -> module, in module order
        for mname, m in module.named_modules():
            if mname == "" or (wrap and isinstance(m, tuple(wrap))):
                wrapped[mname] = m
        groups = {mname: [] for mname in wrapped}
        for pname, p in module.named_parameters():  # tied parameters appear once
            if not p.requires_grad:
                continue
            if p.dtype != _torch.float32:
                raise NotImplementedError(f"fsdpd.torch: parameter {pname!r} is {p.dtype}; "
                                          "only float32 is supported yet")
            owner = ""
            for mname in wrapped:
                if mname and (pname.startswith(mname + ".")) and len(mname) > len(owner):
                    owner = mname
            groups[owner].append((pname, p))
        for mname, m in wrapped.items():
            if groups[mname]:
                self._units.append(_FlatUnit(self, mname or "root", m, groups[mname]))

        self._barrier = client.register_unit(_BARRIER_UNIT, [("x", (1,), True)])
        for fu in self._units:
            fu.write_initial_shard()
            fu.detach_params()
        self._sync()  # every rank's masters are written before anyone unshards

        for fu in self._units:
            fu.hooks.append(fu.module.register_forward_pre_hook(self._pre_forward(fu)))
            fu.hooks.append(fu.module.register_forward_hook(self._post_forward(fu)))
            for i, p in enumerate(fu.params):
                fu.hooks.append(p.register_hook(self._grad_hook(fu, i)))

    # --- synchronization -------------------------------------------------------------
    def _sync(self):
        """A barrier of the job's local ranks: a ReduceScatter of the private tiny unit."""
        self._barrier_count += 1
        self._barrier.full_grad.zero_()
        self._barrier.reduce_scatter(self._barrier_count)

    # --- hooks -----------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self.step += 1
        self._sync()  # every rank stepped its optimizer and let go of the last step's units
        self._callback_queued = False
        return self.module(*args, **kwargs)

    def _pre_forward(self, fu):
        def hook(module, inputs):
            fu.unshard(self.step)
            fu.unit.full_grad.zero_()
            for p in fu.params:
                p.grad = None
            fu.pending = len(fu.params)
            fu.reduced = False
        return hook

    def _post_forward(self, fu):
        def hook(module, inputs, output):
            if not _torch.is_grad_enabled():
                fu.reduced = True
                fu.reshard(self.step)
            return None
        return hook

    def _grad_hook(self, fu, i):
        def hook(grad):
            off, n = fu.offsets[i], fu.sizes[i]
            fu.unit.full_grad[off:off + n].copy_(grad.reshape(-1))
            if not self._callback_queued:
                self._callback_queued = True
                _torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            fu.pending -= 1
            if fu.pending == 0:
                self._reduce(fu)
            return None
        return hook

    def _reduce(self, fu):
        if fu.reduced:
            return
        fu.unit.reduce_scatter(self.step)
        fu.reduced = True
        fu.shard_param.grad = fu.unit.grad_shard
        for p in fu.params:
            p.grad = None
        fu.reshard(self.step)

    def _finish_backward(self):
        """End of backward: units with parameters that got no gradient are reduced now
        (their missing gradients count as zero), so no rank waits for one."""
        for fu in self._units:
            self._reduce(fu)
        for fu in self._units:
            for p in fu.params:
                p.grad = None

    # --- what the optimizer sees ------------------------------------------------------
    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for fu in self._units:
            yield (prefix + "." if prefix else "") + fu.name, fu.shard_param

    def parameters(self, recurse=True):
        for _, p in self.named_parameters():
            yield p

    @property
    def units(self):
        """The fsdpd.Unit of each wrapped module, root first (module order)."""
        return [fu.unit for fu in self._units]

    def master_shards(self):
        """{unit name: this rank's fp32 master shard} (views of the shared memory)."""
        return {fu.name: fu.unit.master_shard for fu in self._units}


def shard_model(model, client, wrap=None, strategy="FULL_SHARD"):
    """Shards model's parameters through client's daemon and returns the model to train.

    wrap: a set of module classes whose instances each become a unit (like
    transformer_auto_wrap_policy), or None for one unit; the root takes the rest. Every local
    rank calls this with the same model (same definition, same seed): each writes its own
    slice of the initial values, then all wait for each other. See the module docstring for
    the schedule (SHARD_GRAD_OP-like for now) and what is not supported yet."""
    return ShardedModel(model, client, wrap, strategy)
