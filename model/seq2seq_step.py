"""One decoder step of the encoder-decoder as a pure tensor function (`EncoderDecoder.decode` over a
`StepContext`), so one compiled graph serves every batch (docs/decisions.md, "torch.compile")."""

from __future__ import annotations

import torch

from model.kv_cache import StepContext
from model.seq2seq import EncoderDecoder


@torch.no_grad()
def decode_step(model: EncoderDecoder, tokens: torch.Tensor, positions: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor,
                src_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, positions, src_len (R,); k, v (NL, R, H, L, D) cached keys/values, of which row r uses
    the first positions[r] (L >= max position); cross_k, cross_v (NL, R, H, S, D), row r uses the first
    src_len[r] -> logits (R, V), new_k, new_v (NL, R, H, D) to store at (row, positions[r])."""
    ctx = StepContext(k, v, positions, cross_k, cross_v, src_len)
    logits = model.decode(tokens[:, None], positions[:, None], ctx)[:, 0]  # (R, V)
    return logits, *ctx.stacked_new_kv()  # (R, V), (NL, R, H, D) x 2


@torch.no_grad()
def encode_cross(model: EncoderDecoder, src: torch.Tensor,
                 src_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder plus every decoder layer's cross-attention K/V, in one pure function:
    src, src_mask (N, S) -> cross_k, cross_v (NL, N, H, S, D) for `KVCache.set_cross_all`."""
    return model.cross_kv(model.encode(src, src_mask))  # (NL, N, H, S, D) x 2
