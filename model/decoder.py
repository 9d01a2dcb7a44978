"""Decoder-only language model: GPT-2 style or Llama style from one `DecoderConfig`.

A pure function of (tokens, positions, cache): no sampling, no scheduling.
"""

from __future__ import annotations

import torch
from torch import nn

from model.attention import Attention
from model.config import DecoderConfig
from model.dropout import Dropout
from model.kv_cache import KVCache, StepContext
from model.layers import GeluMLP, RotaryEmbedding, SwiGLU, make_norm


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.attn_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head,
                              bias=cfg.attn_bias, out_bias=cfg.o_proj_bias, dropout=cfg.dropout)
        self.mlp_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias)
        self.mlp = (SwiGLU if cfg.mlp == "swiglu" else GeluMLP)(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.drop = Dropout(cfg.dropout)

    def forward(self, x, mask, rope, cache, layer):
        x = x + self.drop(self.attn(self.attn_norm(x), mask, rope=rope, cache=cache, layer=layer))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class DecoderLM(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positions == "learned" else None
        self.rope = (RotaryEmbedding(cfg.dim_head, cfg.max_seq_len, cfg.rope_theta)
                     if cfg.positions == "rope" else None)
        self.drop = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def new_cache(self, n_slots: int, max_len: int | None = None, dtype=None) -> KVCache:
        c, p = self.cfg, self.embed.weight
        return KVCache(c.n_layers, n_slots, c.kv_heads, max_len or c.max_seq_len, c.dim_head,
                       dtype=dtype or p.dtype, device=p.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | StepContext | None = None, slots: torch.Tensor | list[int] | None = None,
                output_index: torch.Tensor | None = None,
                key_valid: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions (B, T) -> logits (B, T, V), or (B, V) at `output_index` (B,).

        With a `KVCache`, row b's new K/V go to slot `slots[b]` at `positions[b]` and the row attends that
        slot's prefix; a `StepContext` (T = 1) collects them instead. Without a cache, attention is causal;
        `key_valid` (B, T) marks real (non-pad) tokens of left-padded batches.
        """
        b, t = tokens.shape
        if positions is None:
            positions = torch.arange(t, device=tokens.device).expand(b, t)
        # A step's positions lie within views of a cache no longer than max_seq_len (the engine's), and
        # reading a tensor value here would break the compiled graph.
        if not isinstance(cache, StepContext) and int(positions.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"position {int(positions.max())} beyond max_seq_len {self.cfg.max_seq_len}")
        x, rope = self.embed_tokens(tokens, positions)
        ctx = cache
        if isinstance(cache, KVCache):
            ctx = cache.context(list(range(b)) if slots is None else slots, positions)
        if ctx is not None:
            mask = ctx.self_mask()  # (B, 1, T, Tk)
        else:
            mask = (positions[:, None, :] <= positions[:, :, None])[:, None]  # (B, 1, T, T)
            if key_valid is not None:
                eye = torch.eye(t, dtype=torch.bool, device=tokens.device)
                mask = mask & (key_valid[:, None, None, :] | eye)  # pad rows still see themselves
        for i, block in enumerate(self.blocks):
            x = block(x, mask, rope, ctx, i)
        if output_index is not None:
            x = x[torch.arange(b, device=x.device), output_index]  # (B, d)
        return self.head(x)  # (B, [T,] V)

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor):
        """tokens, positions (B, T) -> x (B, T, d) and the RoPE tables (cos, sin (B, 1, T, D)), or None."""
        x = self.embed(tokens)  # (B, T, d)
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        x = self.drop(x)
        return x, self.rope(positions, x.dtype) if self.rope is not None else None

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., d) -> logits (..., V)."""
        return self.lm_head(self.norm(x))
