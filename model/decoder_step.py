"""One decode step of the decoder-only LM as pure tensor functions, as model/seq2seq_step.py: whole
(`decoder_step`) or in pieces (`blocks_step`, `head_step`), so identical layers can share one compiled graph."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from model.decoder import DecoderLM
from model.kv_cache import ChunkContext, StepContext


@torch.no_grad()
def blocks_step(blocks: Sequence[nn.Module], x: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, *rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (R, 1, d) at positions (R,) through consecutive `blocks` (G layers) over their cached prefixes
    k, v (G, R, Hkv, L, D), of which row r uses the first positions[r]; rope: the model's (cos, sin)
    (R, 1, 1, D) or nothing -> x (R, 1, d), new_k, new_v (G, R, Hkv, D)."""
    return _through(blocks, x, StepContext(k, v, positions), rope)


@torch.no_grad()
def chunk_blocks_step(blocks: Sequence[nn.Module], x: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, *rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt chunk x (1, T, d) at consecutive positions (1, T) through consecutive `blocks` (G layers)
    over its slot's cached prefix k, v (G, 1, Hkv, L, D), of which it uses the first positions[0, 0]; rope:
    (cos, sin) (1, 1, T, D) or nothing -> x (1, T, d), new_k, new_v (G, 1, Hkv, T, D)."""
    return _through(blocks, x, ChunkContext(k, v, positions), rope)


def _through(blocks: Sequence[nn.Module], x: torch.Tensor, ctx: StepContext, rope: tuple):
    mask = ctx.self_mask()
    for i, block in enumerate(blocks):
        x = block(x, mask, rope or None, ctx, i)
    return x, *ctx.stacked_new_kv()


@torch.no_grad()
def head_step(model: DecoderLM, x: torch.Tensor) -> torch.Tensor:
    """Last hidden states (R, d) -> logits (R, V)."""
    return model.head(x)


@torch.no_grad()
def decoder_step(model: DecoderLM, tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, positions (R,); k, v (NL, R, Hkv, L, D) cached keys/values, of which row r uses the
    first positions[r] (L >= max position) -> logits (R, V), new_k, new_v (NL, R, Hkv, D)."""
    x, rope = model.embed_tokens(tokens[:, None], positions[:, None])  # (R, 1, d)
    x, new_k, new_v = blocks_step(model.blocks, x, positions, k, v, *(rope or ()))
    return head_step(model, x[:, 0]), new_k, new_v  # (R, V), (NL, R, Hkv, D) x 2
