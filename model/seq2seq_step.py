"""One decoder step of the encoder-decoder as a pure tensor function, shaped for `torch.compile`.

`EncoderDecoder.decode` is the general path: any slots, any number of new tokens, and it writes the
new K/V into the cache before attending. Its Python (slot lists, `int(positions.max())`, in-place
cache writes) breaks a compiled graph. `decode_step` computes the same logits for the common case —
one new token per row, rows reading cache *views* — with no data-dependent Python and no mutation:
it attends over the cached prefix plus the row's own new key, and returns the new K/V for the caller
to write (`KVCache.write_step`). Every size (rows, prefix length, source length) can stay symbolic,
so one compiled graph serves every batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.attention import _decode_attention, prefix_attention
from model.seq2seq import EncoderDecoder, _Residual


def _residual(r: _Residual, x: torch.Tensor, fn) -> torch.Tensor:
    if r.norm_first:
        return x + fn(r.norm(x))
    return r.norm(x + fn(x))


@torch.no_grad()
def decode_step(model: EncoderDecoder, tokens: torch.Tensor, positions: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor,
                src_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, positions, src_len (R,); k, v (NL, R, H, L, D) cached keys/values, of which row r uses
    the first positions[r] (L >= max position); cross_k, cross_v (NL, R, H, S, D), row r uses the first
    src_len[r] -> logits (R, V), new_k, new_v (NL, R, H, D) to store at (row, positions[r])."""
    cfg = model.cfg
    r, length, s = tokens.shape[0], k.shape[3], cross_k.shape[3]
    h, d = cfg.n_heads, cfg.dim_head
    dtype, kv_dtype = model.embed.weight.dtype, k.dtype  # attention runs in the cache's dtype, as in decode
    x = model.embed(tokens) * model.scale + model.pe[positions].to(dtype)  # (R, d_model)
    keys = torch.arange(length, device=tokens.device)
    self_ok = (keys[None, :] < positions[:, None])[:, None, None, :]  # (R, 1, 1, L): the cached prefix
    src = torch.arange(s, device=tokens.device)
    cross_ok = (src[None, :] < src_len[:, None])[:, None, None, :]  # (R, 1, 1, S)
    new_k, new_v = [], []
    for i, layer in enumerate(model.decoder):
        a = layer.self_attn

        def self_attention(y, a=a, i=i):
            qkv = F.linear(y, a.qkv_proj.weight, a.qkv_proj.bias)  # (R, 3 H D)
            q, kn, vn = qkv.view(r, 3, h, 1, d).to(kv_dtype).unbind(1)  # (R, H, 1, D) each
            out = prefix_attention(q, k[i], v[i], kn, vn, self_ok)  # (R, H, 1, D)
            new_k.append(kn.squeeze(2))
            new_v.append(vn.squeeze(2))
            return a.o_proj(out.reshape(r, h * d).to(dtype))  # (R, d_model)

        c = layer.cross_attn

        def cross_attention(y, c=c, i=i):
            q = c.q_proj(y).view(r, h, 1, d).to(kv_dtype)  # (R, H, 1, D)
            out = _decode_attention(q, cross_k[i], cross_v[i], cross_ok)  # (R, H, 1, D)
            return c.o_proj(out.reshape(r, h * d).to(dtype))  # (R, d_model)

        x = _residual(layer.r1, x, self_attention)
        x = _residual(layer.r2, x, cross_attention)
        x = _residual(layer.r3, x, layer.ff)
    logits = model.dec_norm(x) @ model.embed.weight.T  # (R, V), tied output projection
    return logits, torch.stack(new_k), torch.stack(new_v)  # (R, V), (NL, R, H, D) x 2


@torch.no_grad()
def encode_cross(model: EncoderDecoder, src: torch.Tensor,
                 src_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder plus every decoder layer's cross-attention K/V, in one pure function:
    src, src_mask (N, S) -> cross_k, cross_v (NL, N, H, S, D) for `KVCache.set_cross_all`."""
    return model.cross_kv(model.encode(src, src_mask))  # (NL, N, H, S, D) x 2
