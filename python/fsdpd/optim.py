"""Optimizers that fsdpd runs in the daemon, over the master shards of a shard_model:

    model = fsdpd.torch.shard_model(net)
    decay = [p for n, p in model.named_parameters() if not n.endswith(".bias")]
    rest = [p for n, p in model.named_parameters() if n.endswith(".bias")]
    opt = fsdpd.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, weight_decay=0.1)     # or AdamW(model.parameters(), ...)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    for x, y in data:
        loss_fn(model(x), y).backward()   # the gradients are reduced into the shards
        opt.step(); opt.zero_grad(); sched.step()   # the daemon steps every unit

torch.optim's formulas and defaults. As a torch optimizer does, `step()` steps once with the
gradients the backwards since `zero_grad()` left (gradient accumulation, a GradScaler's
unscale_ in between), after an LR scheduler's new values went to the daemon. The state
(exp_avg, exp_avg_sq, momentum buffers, step counts) lives in the daemon, beside the masters,
and outlives this process: a trainer that restarts finds it there.

The parameters are the model's (model.parameters(), its original parameters' parts of this
rank's shards, or model.flat_parameters()), in torch's forms: an iterable of them, or groups
`[{"params": [...], "weight_decay": 0.0}, ...]`; `param_groups[i]["params"]` holds them and
`param_groups[i]["param_names"]` their original names, which the daemon steps by. The older
form `AdamW(model, groups=[{"params": [names], ...}])` steps the parameters no group names in
a first group, with the constructor's hyperparameters.

step_in_backward=True: the daemon steps each unit as soon as the reduce of its gradients
ends, while the backward goes on (the step then costs the trainers nothing), so by the end of
`backward()` the step is done and `step()` has nothing left to do. Every backward then steps,
but those under `model.no_sync()` (gradients accumulate; the backward after it steps); a
second backward before `step()` is refused, as it would step twice.

Gradient clipping by global norm: pass `max_grad_norm` (clip_grad_norm_'s max_norm, 2-norm,
over every host's shards), and the daemon clips before it steps; `model.clip_grad_norm_`
refuses to run with a daemon optimizer.
"""

import torch

_KEYS = ("lr", "weight_decay", "maximize", "betas", "eps", "amsgrad", "momentum", "dampening",
         "nesterov")


def _groups_of(params, groups, who):
    """(model, torch-style groups whose "params" are the model's parameters and whose
    "param_names" are their original names) from an optimizer's arguments: the model and
    groups of names (the older form), or torch's forms (an iterable of the model's
    parameters, of (name, parameter) pairs, or of groups of either)."""
    if hasattr(params, "_attach_optimizer"):  # AdamW(model, groups=[{"params": [names]}])
        model = params
        named = [dict(g) for g in (groups or [])]
        for g in named:
            names = g.get("params")
            if isinstance(names, str) or not names or \
                    not all(isinstance(n, str) for n in names):
                raise ValueError(f"fsdpd.optim.{who}(model, groups=...): each group's 'params' "
                                 "is a non-empty list of original parameter names")
            g["params"] = list(names)
        # The parameters no group names: the first group, with the constructor's values,
        # named one by one, so that the daemon steps the model's units and no other.
        taken = {n for g in named for n in g["params"]}
        rest = [n for n, _, _, _ in model._orig_params() if n not in taken]
        named = [{"params": rest}] + named
    else:
        if groups is not None:
            raise ValueError(f"fsdpd.optim.{who}: groups= goes with a model as the first "
                             "argument; with parameters, pass torch's groups "
                             "[{'params': [...], ...}, ...] as the first argument instead")
        if isinstance(params, torch.Tensor):
            raise TypeError(f"fsdpd.optim.{who}: params argument given to the optimizer "
                            "should be an iterable of Tensors or dicts, but got a Tensor")
        named = list(params)
        if not named:
            raise ValueError(f"fsdpd.optim.{who}: optimizer got an empty parameter list")
        if not isinstance(named[0], dict):
            named = [{"params": named}]
        named = [dict(g) for g in named]
        model = None
        for g in named:
            items = g.get("params")
            items = [items] if isinstance(items, torch.Tensor) else list(items or ())
            for item in items:
                t = item[1] if isinstance(item, tuple) else item
                owner = getattr(t, "_fsdpd_model", lambda: None)()
                if owner is None:
                    raise TypeError(
                        f"fsdpd.optim.{who} steps the parameters of a model made by "
                        "fsdpd.torch.shard_model (model.parameters(), "
                        "model.named_parameters(), model.flat_parameters()); got "
                        f"{_describe(item)}, which is not one: use a torch.optim optimizer "
                        "for other tensors")
                if model is not None and owner is not model:
                    raise ValueError(f"fsdpd.optim.{who}: the parameters are of two models; "
                                     "give each its own optimizer")
                model = owner
            g["params"] = items
    names = model._optimizer_names()
    for g in named:
        tensors, param_names = [], []
        for item in g["params"]:
            t = item[1] if isinstance(item, tuple) else item
            if isinstance(t, str):
                if t not in names["by_name"]:
                    raise ValueError(f"fsdpd.optim.{who}: {t!r} is no original parameter of "
                                     "the model")
                t = names["by_name"][t]
            tensors.append(t)
            param_names.extend(names["by_id"][id(t)])
        g["params"] = tensors
        g["param_names"] = param_names
    return model, named


def _describe(item):
    if isinstance(item, torch.Tensor):
        return f"a tensor of shape {tuple(item.shape)}"
    if isinstance(item, str):
        return f"the name {item!r} (names go with AdamW(model, groups=...))"
    return f"a {type(item).__name__}"


class _DaemonOptimizer(torch.optim.Optimizer):
    _kind = None

    def __init__(self, params, defaults, groups, max_grad_norm, step_in_backward=False):
        model, named = _groups_of(params, groups, type(self).__name__)
        self._model = model
        self.max_grad_norm = float(max_grad_norm or 0.0)
        self.step_in_backward = bool(step_in_backward)
        self._stepped_in_backward = False  # a backward stepped since the last step()
        super().__init__(named, defaults)
        self._sent = None
        model._attach_optimizer(self)
        self._sync()

    def _wire_groups(self):
        """param_groups by trainable original names; a group naming none would take every
        parameter no other group names, so it is left out."""
        trainable = self._model._optimizer_names()["trainable"]
        groups = []
        for g in self.param_groups:
            names = [n for n in g["param_names"] if n in trainable]
            if names:
                groups.append({"params": names, **{k: g[k] for k in _KEYS if k in g}})
        return groups

    def _sync(self):
        """Sends param_groups' hyperparameters to the daemon when they changed (an LR
        scheduler's step); the model calls it before each forward."""
        sent = (self._wire_groups(), self.max_grad_norm)
        if sent != self._sent:
            self._model.client.set_optimizer(self._kind, *sent)
            self._sent = sent

    def step(self, closure=None):
        """The daemon steps every unit whose parameters have gradients, once, with what the
        backwards since zero_grad() reduced into the gradient shards; every local rank
        calls it. With step_in_backward, the backward stepped them already."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.step_in_backward:
            self._stepped_in_backward = False
            return loss
        self._sync()
        self._model._step_optimizer()
        return loss

    def zero_grad(self, set_to_none=True):
        self._model.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        """torch's layout keyed by unit name: each unit's step count and state arrays
        (this host's shards, copied), and param_groups with their parameter names."""
        state = {}
        for unit in self._model._trainable_units():
            arrays = zip(self._state_names(), unit.optimizer_state)
            state[unit.name] = {"step": unit.optimizer_steps,
                                **{name: a.clone() for name, a in arrays}}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Writes a state_dict() of the same model and host layout back into the daemon."""
        groups = state_dict["param_groups"]
        if [g["param_names"] for g in groups] != [g["param_names"] for g in self.param_groups]:
            raise ValueError("fsdpd.optim: the state_dict's groups name other parameters")
        for mine, theirs in zip(self.param_groups, groups):
            mine.update({k: v for k, v in theirs.items() if k in _KEYS})
        for unit in self._model._trainable_units():
            saved = state_dict["state"].get(unit.name)
            if saved is None:
                continue
            for name, array in zip(self._state_names(), unit.optimizer_state):
                array.copy_(saved[name])
            unit.optimizer_steps = saved["step"]
        self._sync()

    def _state_names(self):
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _adam(lr, betas, eps, weight_decay, amsgrad, maximize):
    return dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                maximize=maximize)


class AdamW(_DaemonOptimizer):
    """torch.optim.AdamW in the daemon: decoupled weight decay (default 1e-2)."""
    _kind = "AdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, groups=None, max_grad_norm=None,
                 step_in_backward=False):
        super().__init__(params, _adam(lr, betas, eps, weight_decay, amsgrad, maximize),
                         groups, max_grad_norm, step_in_backward)


class Adam(_DaemonOptimizer):
    """torch.optim.Adam in the daemon: weight decay added to the gradient (default 0)."""
    _kind = "Adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, groups=None, max_grad_norm=None,
                 step_in_backward=False):
        super().__init__(params, _adam(lr, betas, eps, weight_decay, amsgrad, maximize),
                         groups, max_grad_norm, step_in_backward)


class SGD(_DaemonOptimizer):
    """torch.optim.SGD in the daemon: momentum, dampening, nesterov, weight decay."""
    _kind = "SGD"

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, groups=None, max_grad_norm=None,
                 step_in_backward=False):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov,
                                      maximize=maximize), groups, max_grad_norm,
                         step_in_backward)

    def _state_names(self):
        return ("momentum_buffer",)


__all__ = ["AdamW", "Adam", "SGD"]
