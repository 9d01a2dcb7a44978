"""One decode step of the decoder-only LM as a pure tensor function, shaped for `torch.compile`.

The counterpart of `model/seq2seq_step.py` for `DecoderLM` (same contract): one new token per row,
rows reading K/V prefix *views* of the slot cache, no data-dependent Python, no mutation; the new K/V
come back for the caller to store (`KVCache.write_step`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.decoder import DecoderLM
from model.layers import apply_rope


@torch.no_grad()
def decoder_step(model: DecoderLM, tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, positions (R,); k, v (NL, R, Hkv, L, D) cached keys/values, of which row r uses the
    first positions[r] (L >= max position) -> logits (R, V), new_k, new_v (NL, R, Hkv, D)."""
    cfg = model.cfg
    r, length = tokens.shape[0], k.shape[3]
    h, hkv, d = cfg.n_heads, cfg.kv_heads, cfg.dim_head
    g = h // hkv  # query heads per K/V head
    dtype, kv_dtype = model.embed.weight.dtype, k.dtype  # attention runs in the cache's dtype
    scale = d ** -0.5
    x = model.embed(tokens)  # (R, d_model)
    if model.pos_embed is not None:
        x = x + model.pos_embed(positions)
    rope = model.rope(positions[:, None], dtype) if model.rope is not None else None  # (R, 1, 1, D) x 2
    keys = torch.arange(length, device=tokens.device)
    cached_ok = (keys[None, :] < positions[:, None])[:, None, None, :]  # (R, 1, 1, L)
    new_k, new_v = [], []
    for i, block in enumerate(model.blocks):
        a = block.attn
        qkv = F.linear(block.attn_norm(x), a.qkv_proj.weight, a.qkv_proj.bias)  # (R, (H + 2 Hkv) D)
        q, kn, vn = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        q = q.view(r, h, 1, d)  # (R, H, 1, D)
        kn, vn = kn.view(r, hkv, 1, d), vn.view(r, hkv, 1, d)  # (R, Hkv, 1, D)
        if rope is not None:
            q, kn = apply_rope(q, *rope), apply_rope(kn, *rope)
        q, kn, vn = q.to(kv_dtype), kn.to(kv_dtype), vn.to(kv_dtype)
        qg = q.view(r, hkv, g, d)  # (R, Hkv, G, D): query heads grouped by their K/V head
        ki, vi = k[i], v[i]
        if ki.dtype != torch.float32:  # oneDNN's bf16 bmm copies strided K/V itself, slower (model/attention.py)
            ki, vi = ki.contiguous(), vi.contiguous()
        cached = (qg @ ki.transpose(-1, -2)) * scale  # (R, Hkv, G, L)
        cached = cached.masked_fill(~cached_ok, float("-inf"))
        own = (qg * kn).sum(-1, keepdim=True) * scale  # (R, Hkv, G, 1): the new token's own key
        p = torch.softmax(torch.cat([cached, own], dim=-1).float(), dim=-1).to(kv_dtype)  # (R, Hkv, G, L + 1)
        out = p[..., :length] @ vi + p[..., length:] * vn  # (R, Hkv, G, D)
        x = x + a.o_proj(out.reshape(r, h * d).to(dtype))
        x = x + block.mlp(block.mlp_norm(x))
        new_k.append(kn.view(r, hkv, d))
        new_v.append(vn.view(r, hkv, d))
    logits = model.lm_head(model.norm(x))  # (R, V)
    return logits, torch.stack(new_k), torch.stack(new_v)  # (R, V), (NL, R, Hkv, D) x 2
