"""Small building blocks: normalisation, MLPs, positional encodings."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.dropout import Dropout


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability, return in the input dtype (as Llama does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def make_norm(kind: str, dim: int, eps: float, bias: bool = True) -> nn.Module:
    return RMSNorm(dim, eps) if kind == "rmsnorm" else nn.LayerNorm(dim, eps=eps, bias=bias)


class GeluMLP(nn.Module):
    """GPT-2 / paper feed-forward: Linear -> activation -> Linear."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True, activation: str = "gelu",
                 dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff, bias=bias)
        self.proj = nn.Linear(d_ff, d_model, bias=bias)
        self.act = nn.GELU(approximate="tanh") if activation == "gelu" else nn.ReLU()
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.dropout(self.act(self.fc(x))))


class SwiGLU(nn.Module):
    """Llama feed-forward: down(silu(gate(x)) * up(x)); gate and up fused in one matmul."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False):
        super().__init__()
        self.d_ff = d_ff
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.d_ff, dim=-1)  # (B, T, F) each
        return self.down(F.silu(gate) * up)


class RotaryEmbedding(nn.Module):
    """RoPE tables, non-interleaved ("rotate half") convention as in Hugging Face Llama."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (L, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (L, D)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions (B, T) -> cos, sin (B, 1, T, D), broadcast over heads
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (B, H, T, D); rotate pairs (i, i + D/2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def sinusoidal_table(max_len: int, d_model: int) -> torch.Tensor:
    """The paper's fixed positional encodings: (L, d_model)."""
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe.float()
