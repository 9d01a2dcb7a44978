"""Dropout whose mask is a hash of (seed, element index).

On CPU a C++ kernel (model/csrc/dropout.cpp) applies it in one parallel pass and the backward recomputes it
from the seed; torch's CPU dropout, without MKL, draws from one serial Mersenne Twister (docs/decisions.md).
Elsewhere `F.dropout` serves, with the same distribution (kept with probability 1 - p, to 1/65536).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import native_ops

_lib = torch.library.Library("attnserve", "FRAGMENT")
_lib.define("dropout(Tensor x, float p, int seed) -> Tensor")


@torch.library.register_fake("attnserve::dropout", lib=_lib)
def _dropout_fake(x, p, seed):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


class _HashDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, seed: int) -> torch.Tensor:
        ctx.p, ctx.seed = p, seed
        return torch.ops.attnserve.dropout(x, p, seed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _HashDropout.apply(grad, ctx.p, ctx.seed), None, None  # the same mask and scale (linear in x)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    if not training or p == 0.0:
        return x
    if x.device.type == "cpu" and round(p * 65536) < 65536 and native_ops.load():
        seed = int(torch.randint(0, 2**62, ()).item())  # from torch's generator: torch.manual_seed repeats it
        return _HashDropout.apply(x, p, seed)
    return F.dropout(x, p, True)


class Dropout(nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
