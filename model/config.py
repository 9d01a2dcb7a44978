"""Model configuration dataclasses and presets.

`DecoderConfig` covers GPT-2 style (LayerNorm, learned positions, GELU, MHA) and Llama style
(RMSNorm, RoPE, SwiGLU, GQA) decoders. `Seq2SeqConfig` is the encoder-decoder of
"Attention Is All You Need" (post-LN, sinusoidal positions, shared scaled embeddings).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from model.strict_fields import FromDict, check_choices


class _Config(FromDict):
    """Numbers are never negative, floats never NaN or infinite, `Literal` fields hold one of their choices;
    from_dict is strict."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and v < 0:
                raise ValueError(f"{type(self).__name__}.{f.name} must be non-negative, got {v}")
            if isinstance(v, float) and not 0 <= v < math.inf:  # a NaN eps or theta makes every logit NaN
                raise ValueError(f"{type(self).__name__}.{f.name} must be a finite non-negative number, got {v}")
        check_choices(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DecoderConfig(_Config):
    vocab_size: int = 50257
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None  # None = n_heads (MHA); fewer = grouped-query attention
    d_ff: int = 3072
    max_seq_len: int = 1024
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    positions: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0
    mlp: Literal["gelu", "swiglu"] = "gelu"
    attn_bias: bool = True
    attn_out_bias: bool | None = None  # the output projection's bias; None = attn_bias (Qwen2: q/k/v only)
    mlp_bias: bool = True
    norm_bias: bool = True
    tie_embeddings: bool = True
    dropout: float = 0.0
    head_dim: int | None = None  # None = d_model // n_heads
    bos_id: int | None = None
    eos_id: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.kv_heads}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")
        if self.positions == "rope" and self.dim_head % 2:  # RoPE rotates pairs of a head's dimensions
            raise ValueError(f"RoPE needs an even head dimension, got {self.dim_head}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def o_proj_bias(self) -> bool:
        return self.attn_bias if self.attn_out_bias is None else self.attn_out_bias


@dataclass(frozen=True)
class Seq2SeqConfig(_Config):
    vocab_size: int = 16000
    d_model: int = 512
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    n_heads: int = 8
    d_ff: int = 2048
    activation: Literal["relu", "gelu"] = "relu"
    norm_first: bool = False  # False = post-LN, as in the paper
    norm_eps: float = 1e-5
    max_src_len: int = 256
    max_tgt_len: int = 256
    dropout: float = 0.1
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model)
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __post_init__(self):
        super().__post_init__()
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} not divisible by n_heads={self.n_heads}")
        if self.d_model % 2:  # the sinusoidal table pairs a sin and a cos dimension
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        for name in ("pad_id", "bos_id", "eos_id"):  # nn.Embedding asserts on pad_id; the others fail a decode
            if (token := getattr(self, name)) >= self.vocab_size:
                raise ValueError(f"Seq2SeqConfig.{name}={token} must be below vocab_size={self.vocab_size}")

    @property
    def dim_head(self) -> int:
        return self.d_model // self.n_heads


# --- presets -----------------------------------------------------------------------------------

SMOLLM2_135M = DecoderConfig(
    vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
    max_seq_len=8192, norm="rmsnorm", norm_eps=1e-5, positions="rope", rope_theta=100000.0,
    mlp="swiglu", attn_bias=False, mlp_bias=False, norm_bias=False, tie_embeddings=True,
)

TINY_GPT2 = DecoderConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=128)

TINY_LLAMA = DecoderConfig(
    vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=128,
    norm="rmsnorm", positions="rope", mlp="swiglu", attn_bias=False, mlp_bias=False,
    norm_bias=False,
)

TINY_SEQ2SEQ = Seq2SeqConfig(
    vocab_size=97, d_model=32, n_encoder_layers=2, n_decoder_layers=2, n_heads=4, d_ff=64,
    max_src_len=64, max_tgt_len=64, dropout=0.0,
)
