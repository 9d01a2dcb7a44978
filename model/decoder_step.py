"""One decode step of the decoder-only LM as a pure tensor function, shaped for `torch.compile`.

The counterpart of `model/seq2seq_step.py` for `DecoderLM` (same contract): one new token per row,
rows reading K/V prefix *views* of the slot cache, no data-dependent Python, no mutation; the new K/V
come back for the caller to store (`KVCache.write_step`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.attention import prefix_attention
from model.decoder import DecoderLM
from model.layers import apply_rope


@torch.no_grad()
def decoder_step(model: DecoderLM, tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, positions (R,); k, v (NL, R, Hkv, L, D) cached keys/values, of which row r uses the
    first positions[r] (L >= max position) -> logits (R, V), new_k, new_v (NL, R, Hkv, D)."""
    cfg = model.cfg
    r, length = tokens.shape[0], k.shape[3]  # rows, cached prefix length
    h, hkv, d = cfg.n_heads, cfg.kv_heads, cfg.dim_head
    dtype, kv_dtype = model.embed.weight.dtype, k.dtype  # attention runs in the cache's dtype
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
        qg = q.view(r, hkv, h // hkv, d)  # (R, Hkv, G, D): query heads grouped by their K/V head
        out = prefix_attention(qg, k[i], v[i], kn, vn, cached_ok)  # (R, Hkv, G, D)
        x = x + a.o_proj(out.reshape(r, h * d).to(dtype))
        x = x + block.mlp(block.mlp_norm(x))
        new_k.append(kn.view(r, hkv, d))
        new_v.append(vn.view(r, hkv, d))
    logits = model.lm_head(model.norm(x))  # (R, V)
    return logits, torch.stack(new_k), torch.stack(new_v)  # (R, V), (NL, R, Hkv, D) x 2
