"""Encoder-decoder Transformer of "Attention Is All You Need".

Sinusoidal positions, shared source/target/output embeddings scaled by sqrt(d_model), post-LN by default.
`set_cross` stores each decoder layer's cross-attention K/V in the cache once per source; `decode` steps
over the cache; `forward` is teacher forcing.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.attention import Attention
from model.config import Seq2SeqConfig
from model.dropout import Dropout
from model.kv_cache import CacheContext, KVCache, StepContext
from model.layers import GeluMLP, sinusoidal_table


class _Residual(nn.Module):
    """One sublayer with its residual and LayerNorm, post-LN (paper) or pre-LN."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.drop = Dropout(cfg.dropout)
        self.norm_first = cfg.norm_first

    def forward(self, x, fn):
        return x + self.drop(fn(self.norm(x))) if self.norm_first else self.norm(x + self.drop(fn(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        h = cfg.n_heads
        self.self_attn = Attention(cfg.d_model, h, h, cfg.dim_head, dropout=cfg.dropout)
        self.ff = GeluMLP(cfg.d_model, cfg.d_ff, activation=cfg.activation, dropout=cfg.dropout)
        self.r1, self.r2 = _Residual(cfg), _Residual(cfg)

    def forward(self, x, mask):
        x = self.r1(x, lambda y: self.self_attn(y, mask))
        return self.r2(x, self.ff)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        h = cfg.n_heads
        self.self_attn = Attention(cfg.d_model, h, h, cfg.dim_head, dropout=cfg.dropout)
        self.cross_attn = Attention(cfg.d_model, h, h, cfg.dim_head, cross=True, dropout=cfg.dropout)
        self.ff = GeluMLP(cfg.d_model, cfg.d_ff, activation=cfg.activation, dropout=cfg.dropout)
        self.r1, self.r2, self.r3 = _Residual(cfg), _Residual(cfg), _Residual(cfg)

    def forward(self, x, self_mask, memory, cross_mask, cache: CacheContext | StepContext | None, layer: int):
        x = self.r1(x, lambda y: self.self_attn(y, self_mask, cache=cache, layer=layer))
        x = self.r2(x, lambda y: self.cross_attn(y, cross_mask, memory=memory, cache=cache, layer=layer))
        return self.r3(x, self.ff)


class EncoderDecoder(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.register_buffer("pe", sinusoidal_table(max(cfg.max_src_len, cfg.max_tgt_len), cfg.d_model),
                             persistent=False)
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        self.drop = Dropout(cfg.dropout)
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # pre-LN stacks end with a LayerNorm; post-LN (paper) outputs are already normalised
        self.enc_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.norm_first else nn.Identity()
        self.dec_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps) if cfg.norm_first else nn.Identity()
        self._init()

    def _init(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                nn.init.xavier_uniform_(p)
            elif "bias" in name:
                nn.init.zeros_(p)
        nn.init.normal_(self.embed.weight, std=self.cfg.d_model ** -0.5)
        with torch.no_grad():
            self.embed.weight[self.cfg.pad_id].zero_()

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.drop(self.embed(tokens) * self.scale + self.pe[positions].to(self.embed.weight.dtype))

    def new_cache(self, n_slots: int, max_len: int | None = None, dtype=None, cross_len: int | None = None) -> KVCache:
        """`cross_len` >= max_src_len: source positions per slot (a compiled step wants one spare: a view
        that spans a whole dimension has other strides than a part of it)."""
        c, p = self.cfg, self.embed.weight
        return KVCache(c.n_decoder_layers, n_slots, c.n_heads, max_len or c.max_tgt_len, c.dim_head,
                       cross_len=max(cross_len or 0, c.max_src_len), dtype=dtype or p.dtype, device=p.device)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """src (B, S) token ids, src_mask (B, S) True for real tokens -> memory (B, S, d)."""
        b, s = src.shape
        if s > self.cfg.max_src_len:
            raise ValueError(f"source length {s} beyond max_src_len {self.cfg.max_src_len}")
        if src_mask is None:
            src_mask = src != self.cfg.pad_id
        positions = torch.arange(s, device=src.device).expand(b, s)
        x = self._embed(src, positions)  # (B, S, d)
        attn_mask = src_mask[:, None, None, :]  # (B, 1, 1, S)
        for layer in self.encoder:
            x = layer(x, attn_mask)
        return self.enc_norm(x)

    def cross_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer's cross-attention K/V of memory (B, S, d): 2 x (NL, B, H, S, D)."""
        kv = [layer.cross_attn.project_kv(memory) for layer in self.decoder]  # NL x 2 x (B, H, S, D)
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])

    def set_cross(self, memory: torch.Tensor, src_mask: torch.Tensor, cache: KVCache,
                  slots: torch.Tensor | list[int]) -> None:
        """Compute every decoder layer's cross K/V for memory (B, S, d) once; keep them in `slots`."""
        slots_t = torch.as_tensor(slots, dtype=torch.long, device=memory.device)
        cache.set_cross_all(slots_t, *self.cross_kv(memory), src_mask.sum(-1))

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | StepContext,
               slots: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """Decoder step(s) over the cache: tokens, positions (B, T) -> logits (B, T, V). With a `KVCache`, row
        b's new K/V go to slot `slots[b]`; a `StepContext` (T = 1) collects them instead."""
        if isinstance(cache, KVCache):
            if int(positions.max()) >= self.cfg.max_tgt_len:
                raise ValueError(f"target position {int(positions.max())} beyond max_tgt_len {self.cfg.max_tgt_len}")
            ctx = cache.context(list(range(len(tokens))) if slots is None else slots, positions)
        else:  # positions lie within its views (no check: reading a value would break a compiled graph)
            ctx = cache
        x = self._embed(tokens, positions)
        self_mask, cross_mask = ctx.self_mask(), ctx.cross_mask()
        for i, layer in enumerate(self.decoder):
            x = layer(x, self_mask, None, cross_mask, ctx, i)
        return self.dec_norm(x) @ self.embed.weight.T  # (B, T, V), tied output projection

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher forcing: src (B, S), tgt_in (B, T) -> logits (B, T, V)."""
        if src_mask is None:
            src_mask = src != self.cfg.pad_id
        memory = self.encode(src, src_mask)
        b, t = tgt_in.shape
        if t > self.cfg.max_tgt_len:
            raise ValueError(f"target length {t} beyond max_tgt_len {self.cfg.max_tgt_len}")
        positions = torch.arange(t, device=tgt_in.device).expand(b, t)
        x = self._embed(tgt_in, positions)
        # right padding: real tokens never see later pads; pads see the causal prefix (ignored in loss)
        self_mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]  # (1, 1, T, T)
        cross_mask = src_mask[:, None, None, :]  # (B, 1, 1, S)
        for i, layer in enumerate(self.decoder):
            x = layer(x, self_mask, memory, cross_mask, None, i)
        return self.dec_norm(x) @ self.embed.weight.T
