"""torch.optim with an IEEE square root: for the references that hold the daemon's optimizer
to torch.optim's arithmetic bit for bit.

PyTorch 2's x86-64 wheels take a CPU tensor's square root from MKL's vsSqrt (ATen's
cpu/vml.h), which is not correctly rounded: with torch 2.13.0 on an AMD EPYC (Zen 4), 17 % of
random fp32 values come out one ulp off, equally in the LA, HA and EP modes and whatever
MKL_CBWR or MKL_ENABLE_INSTRUCTIONS say. MKL picks its code path by CPU, so no fixed
arithmetic gives its bits on every machine. The daemon's kernels take the IEEE square root
(sqrtf: kernels/optim_elements.h), as torch's CUDA kernels and its builds without MKL (such
as Debian's 1.13) do. Inside ieee_sqrt(), torch.sqrt and Tensor.sqrt of a CPU fp32 tensor
return the IEEE root; everything else torch.optim does, every other operation and its
order, is torch's own.

The root is MKL's, corrected to the nearest fp32 value: r is the correctly rounded root of x
when the midpoints between r and its neighbours bracket it, (r - u/2)^2 < x < (r + u'/2)^2.
Those midpoints have 25 significant bits, so their squares are exact in double and the test
is exact (it is never a tie: such a square has more bits than x). MKL's error is below an ulp,
so one step to a neighbour is enough, and the result is checked.
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode


def _midpoints(r):
    """The midpoints, in double, between r and its neighbours below and above."""
    r64 = r.double()
    below = torch.nextafter(r, torch.zeros_like(r))
    above = torch.nextafter(r, torch.full_like(r, float("inf")))
    return below, (below.double() + r64) * 0.5, above, (r64 + above.double()) * 0.5


def _nearest_root(x):
    r = torch.ops.aten.sqrt.default(x)  # MKL's
    x64 = x.double()
    below, low, above, high = _midpoints(r)
    r = torch.where(low * low > x64, below, torch.where(high * high < x64, above, r))
    _, low, _, high = _midpoints(r)
    off = ((low * low > x64) | (high * high < x64)) & (x > 0) & torch.isfinite(x)
    assert not bool(off.any()), "torch's square root was more than an ulp off"
    return r


class _IEEESqrt(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.sqrt, torch.Tensor.sqrt) and not kwargs and len(args) == 1:
            (x,) = args
            if x.device.type == "cpu" and x.dtype == torch.float32:
                return _nearest_root(x)
        return func(*args, **kwargs)


@contextlib.contextmanager
def ieee_sqrt():
    """torch.sqrt and Tensor.sqrt of CPU fp32 tensors correctly rounded, within the block."""
    with _IEEESqrt():
        yield
