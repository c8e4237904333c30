"""What fsdpd.torch's two APIs (shard_model's and fully_shard's) do alike with a module's
inputs and outputs: nested tuples, lists and dicts of tensors."""

import torch


def tensors(value):
    """The tensors in value."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)


def cast_floats(value, dtype):
    """value with its floating tensors cast to dtype."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(cast_floats(v, dtype) for v in value)
    if isinstance(value, list):
        return [cast_floats(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value
