"""Multi-head attention for self- and cross-attention, with grouped-query heads and the slot KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model import native_ops
from model.dropout import dropout
from model.kv_cache import CacheContext, StepContext
from model.layers import apply_rope

# `prefix_attention`'s C++ kernel (model/csrc/prefix_attention.cpp) registers on CPU when native_ops loads.
_lib = torch.library.Library("attnserve", "FRAGMENT")
_lib.define("prefix_attention(Tensor q, Tensor k, Tensor v, Tensor k_new, Tensor v_new, Tensor prefix_ok) -> Tensor")
_KERNEL_DTYPES = {torch.float32, torch.bfloat16}  # what the kernel reads


@torch.library.register_fake("attnserve::prefix_attention", lib=_lib)
def _prefix_attention_fake(q, k, v, k_new, v_new, prefix_ok):
    return q.new_empty(q.shape, dtype=v.dtype)


class Attention(nn.Module):
    """Self-attention (fused q/k/v projection) or cross-attention (q from x, k/v from memory).

    n_kv_heads < n_heads: grouped-query attention. Masks are boolean (True = may attend). A cache context
    supplies the keys (model/kv_cache.py): a `CacheContext` writes the new K/V first; a `StepContext`
    keeps them apart, and each row attends its prefix plus its own new key.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
                 bias: bool = True, out_bias: bool = True, cross: bool = False, dropout: float = 0.0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.cross, self.dropout = cross, dropout
        q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
        if cross:
            self.q_proj = nn.Linear(d_model, q_dim, bias=bias)
            self.kv_proj = nn.Linear(d_model, 2 * kv_dim, bias=bias)
        else:
            self.qkv_proj = nn.Linear(d_model, q_dim + 2 * kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, d_model, bias=out_bias)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # (B, n, T, D)

    def project_kv(self, memory: torch.Tensor):
        """Cross-attention keys/values of an encoder output (B, S, d) -> 2 x (B, Hkv, S, D)."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)
        return self._heads(k, self.n_kv_heads), self._heads(v, self.n_kv_heads)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, *,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                memory: torch.Tensor | None = None,
                cache: CacheContext | StepContext | None = None, layer: int = 0) -> torch.Tensor:
        # x (B, T, d); mask broadcastable to (B, H, T, Tk)
        b, t, _ = x.shape
        hd = self.head_dim
        own = None  # (k, v) (B, Hkv, 1, D) of this step when the context keeps them out of k, v
        if self.cross:
            q = self._heads(self.q_proj(x), self.n_heads)  # (B, H, T, D)
            if cache is not None:
                k, v = cache.cross(layer)  # (B, Hkv, S, D), computed once per source
            else:
                k, v = self.project_kv(memory)
        else:
            qkv = self.qkv_proj(x)  # (B, T, (H + 2 Hkv) D)
            q, k, v = qkv.split([self.n_heads * hd, self.n_kv_heads * hd, self.n_kv_heads * hd], -1)
            q = self._heads(q, self.n_heads)  # (B, H, T, D)
            k = self._heads(k, self.n_kv_heads)  # (B, Hkv, T, D)
            v = self._heads(v, self.n_kv_heads)
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            if cache is not None:
                k, v, own = cache.update(layer, k, v)  # (B, Hkv, Tk, D): this row's slot prefix
        # a decode step over the cached source: the prefix kernel reads a narrower cache itself (below)
        cross_decode = self.cross and t == 1 and cache is not None and not self.training
        if k.dtype != q.dtype and own is None and not cross_decode and k.element_size() < q.element_size():
            # a cache kept narrower than the compute dtype (storage only): attend in the compute dtype,
            # not in a dtype the CPU may only emulate
            k, v = k.to(q.dtype), v.to(q.dtype)
        elif k.dtype != q.dtype:  # a wider cache, or the decode kernel (float32 sums): the cache's dtype
            q = q.to(k.dtype)
        if own is not None:
            y = prefix_attention(q, k, v, *own, mask)  # (B, H, 1, D)
        elif cross_decode:
            # a decode step over the cached source: every row's first source key is real (a source is never
            # empty), so it takes the kernel's own-key place and the rest is the masked prefix; the kernel
            # reads the strided cache in place where matmuls would copy it (docs/decisions.md)
            y = prefix_attention(q, k[:, :, 1:], v[:, :, 1:], k[:, :, :1], v[:, :, :1], mask[..., 1:])
        elif t == 1 and not self.training:
            y = decode_attention(q, k, v, mask)  # (B, H, 1, D)
        elif self.training and self.dropout > 0 and q.device.type == "cpu":
            y = dropout_attention(q, k, v, mask, self.dropout)  # (B, H, T, D)
        else:  # on CUDA, training too: SDPA's fused kernels drop out themselves
            y = sdpa(q, k, v, mask, self.dropout if self.training else 0.0,
                     expand_kv=q.device.type != "cpu")  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * hd).to(x.dtype)  # (B, T, H*D)
        return self.o_proj(y)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float = 0.0,
         *, expand_kv: bool = False) -> torch.Tensor:
    """SDPA over grouped-query heads. q (B, H, T, D); k, v (B, Hkv, S, D) -> (B, H, T, D).

    With a mask, CUDA's fused kernels refuse `enable_gqa` and SDPA falls back to its math kernel, so
    `expand_kv` repeats the K/V heads instead; CPU's flash kernel takes both."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and expand_kv and mask is not None:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, S, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          enable_gqa=k.shape[1] != q.shape[1])


def dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      p: float) -> torch.Tensor:
    """SDPA's math with model.dropout's mask on the weights (SDPA would draw torch's serial CPU Bernoulli).
    q (B, H, T, D); k, v (B, Hkv, S, D) -> (B, H, T, D)."""
    if k.shape[1] != q.shape[1]:  # grouped-query heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    w = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return dropout(w, p) @ v


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     own: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query per row (a decode step): grouped matmuls, as SDPA's CPU flash kernel is slow for one query
    and grouping needs no copy of K/V. q (B, H, 1, D); k, v (B, Hkv, L, D); mask broadcastable to (B, 1, 1, L);
    `own`: the row's new key and value (B, Hkv, 1, D), attended besides k, v (`prefix_attention`'s math).
    Strided cache slices narrower than fp32 are copied first: oneDNN's own transposing copy is far slower.
    """
    b, h, _, d = q.shape
    if k.device.type == "cpu" and k.dtype != torch.float32 and not k.is_contiguous():
        k, v = k.contiguous(), v.contiguous()
    qg = q.view(b, k.shape[1], h // k.shape[1], d)  # (B, Hkv, G, D): query heads grouped by their K/V head
    scores = (qg @ k.transpose(-1, -2)) * d ** -0.5  # (B, Hkv, G, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if own is None:
        p = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return (p @ v).view(b, h, 1, d)  # (B, H, 1, D)
    own_score = (qg * own[0]).sum(-1, keepdim=True) * d ** -0.5  # (B, Hkv, G, 1)
    p = torch.softmax(torch.cat([scores, own_score], dim=-1).float(), dim=-1).to(v.dtype)  # (B, Hkv, G, L + 1)
    return (p[..., :-1] @ v + p[..., -1:] * own[1]).view(b, h, 1, d)  # (B, H, 1, D)


def prefix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor,
                     v_new: torch.Tensor, prefix_ok: torch.Tensor) -> torch.Tensor:
    """One new query per row over its cached prefix plus its own new key, without writing the cache or
    copying the prefix. q (B, H, 1, D); k, v (B, Hkv, L, D) prefix views; k_new, v_new (B, Hkv, 1, D);
    prefix_ok (B, 1, 1, L) True for the cached keys a row may attend -> (B, H, 1, D) in v's dtype.

    On CPU the C++ kernel (sums in float32) runs where built, on the float32 and bfloat16 it reads (a float16
    cache, `kv_dtype: float16`, takes the torch ops); `decode_attention` is its oracle, in torch ops."""
    if q.device.type == "cpu" and {t.dtype for t in (q, k, v, k_new, v_new)} <= _KERNEL_DTYPES and _native():
        return torch.ops.attnserve.prefix_attention(q, k, v, k_new, v_new, prefix_ok)
    return decode_attention(q, k, v, prefix_ok, (k_new, v_new))


@torch.compiler.assume_constant_result
def _native() -> bool:
    """Whether the C++ kernel is registered; a constant to dynamo, as tracing the loader breaks the graph."""
    return native_ops.load()
