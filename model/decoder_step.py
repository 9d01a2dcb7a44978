"""One decode step of the decoder-only LM as a pure tensor function, shaped for `torch.compile`.

The counterpart of `model/seq2seq_step.py` for `DecoderLM` (same contract): one new token per row,
rows reading K/V prefix *views* of the slot cache, no data-dependent Python, no mutation; the new K/V
come back for the caller to store (`KVCache.write_step`). It runs the model's own forward, with a
`StepContext` in place of the cache.
"""

from __future__ import annotations

import torch

from model.decoder import DecoderLM
from model.kv_cache import StepContext


@torch.no_grad()
def decoder_step(model: DecoderLM, tokens: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, positions (R,); k, v (NL, R, Hkv, L, D) cached keys/values, of which row r uses the
    first positions[r] (L >= max position) -> logits (R, V), new_k, new_v (NL, R, Hkv, D)."""
    ctx = StepContext(k, v, positions)
    logits = model(tokens[:, None], positions[:, None], ctx)[:, 0]  # (R, V)
    return logits, *ctx.stacked_new_kv()  # (R, V), (NL, R, Hkv, D) x 2
