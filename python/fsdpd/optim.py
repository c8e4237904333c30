"""Optimizers that fsdpd runs in the daemon, over the master shards of a shard_model:

    model = fsdpd.torch.shard_model(net)
    opt = fsdpd.optim.AdamW(model, lr=1e-3, weight_decay=0.1,
                            groups=[{"params": ["norm.weight", "head.bias"], "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    for x, y in data:
        loss_fn(model(x), y).backward()   # each unit is stepped as its gradients are reduced
        opt.step(); opt.zero_grad(); sched.step()

torch.optim's formulas and defaults (Debian's torch 1.13, single-tensor path). The daemon
steps each unit as soon as the reduce of its gradients ends, while the backward goes on, so
by the end of `backward()` the step is done and `step()` has nothing left to do. The state
(exp_avg, exp_avg_sq, momentum buffers, step counts) lives in the daemon, beside the masters,
and outlives this process: a trainer that restarts finds it there.

Groups are torch's param_groups by original parameter name (the names the model's modules
give them), so that, say, biases and norms skip weight decay inside one flat unit; the
model's parameters no group names form the first group, with the constructor's
hyperparameters. LR schedulers work unchanged: the hyperparameters of `param_groups` go to
the daemon before the next step's backward. Under `model.no_sync()` nothing is stepped
(gradients accumulate); the backward after it steps.

Gradient clipping by global norm must happen before the step, which here is inside the
backward: pass `max_grad_norm` (clip_grad_norm_'s max_norm, 2-norm, over every host's shards),
and the daemon clips before it steps; `model.clip_grad_norm_` refuses to run with a daemon optimizer.
"""

import torch

_KEYS = ("lr", "weight_decay", "maximize", "betas", "eps", "amsgrad", "momentum", "dampening",
         "nesterov")


class _DaemonOptimizer(torch.optim.Optimizer):
    _kind = None

    def __init__(self, model, defaults, groups, max_grad_norm):
        if not hasattr(model, "_attach_optimizer"):
            raise TypeError(f"fsdpd.optim.{type(self).__name__} steps the masters of a model "
                            "made by fsdpd.torch.shard_model; got a "
                            f"{type(model).__name__}")
        self._model = model
        self.max_grad_norm = float(max_grad_norm or 0.0)
        named = [dict(g) for g in (groups or [])]
        for g in named:
            names = g.get("params")
            if not names or not all(isinstance(n, str) for n in names):
                raise ValueError("fsdpd.optim: each group's 'params' is a non-empty list of "
                                 "original parameter names")
            g["param_names"] = list(names)
            g["params"] = []
        # The parameters no group names: the first group, with the constructor's values,
        # named one by one, so that the daemon steps the model's units and no other.
        taken = {n for g in named for n in g["param_names"]}
        rest = [n for u in model._trainable_units() for n in u.param_names if n not in taken]
        super().__init__([{"params": [], "param_names": rest}] + named, defaults)
        self._sent = None
        model._attach_optimizer(self)
        self._sync()

    def _wire_groups(self):
        return [{"params": g["param_names"], **{k: g[k] for k in _KEYS if k in g}}
                for g in self.param_groups]

    def _sync(self):
        """Sends param_groups' hyperparameters to the daemon when they changed (an LR
        scheduler's step); the model calls it before each forward."""
        sent = (self._wire_groups(), self.max_grad_norm)
        if sent != self._sent:
            self._model.client.set_optimizer(self._kind, *sent)
            self._sent = sent

    def step(self, closure=None):
        """Nothing left to do: the daemon stepped each unit when the backward reduced its
        gradients (the backward returns after the last step)."""
        if closure is not None:
            raise ValueError("fsdpd.optim: step(closure) is not supported: the daemon steps "
                             "the units in the backward")

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

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, groups=None, max_grad_norm=None):
        super().__init__(model, _adam(lr, betas, eps, weight_decay, amsgrad, maximize), groups,
                         max_grad_norm)


class Adam(_DaemonOptimizer):
    """torch.optim.Adam in the daemon: weight decay added to the gradient (default 0)."""
    _kind = "Adam"

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, groups=None, max_grad_norm=None):
        super().__init__(model, _adam(lr, betas, eps, weight_decay, amsgrad, maximize), groups,
                         max_grad_norm)


class SGD(_DaemonOptimizer):
    """torch.optim.SGD in the daemon: momentum, dampening, nesterov, weight decay."""
    _kind = "SGD"

    def __init__(self, model, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, groups=None, max_grad_norm=None):
        super().__init__(model, dict(lr=lr, momentum=momentum, dampening=dampening,
                                     weight_decay=weight_decay, nesterov=nesterov,
                                     maximize=maximize), groups, max_grad_norm)

    def _state_names(self):
        return ("momentum_buffer",)


__all__ = ["AdamW", "Adam", "SGD"]
