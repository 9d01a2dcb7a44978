"""Import a Llama-architecture GGUF file (llama.cpp's format) into our `DecoderLM`.

Reads metadata -> `DecoderConfig`, dequantizes every tensor to fp32 with `gguf.quants.dequantize`,
renames llama.cpp tensors to our parameter names, fuses q/k/v and gate/up, and undoes llama.cpp's
Q/K row permutation (it reorders each head's rows for its interleaved RoPE; we use the Hugging Face
"rotate half" RoPE, which wants the original order). The tokenizer and chat template come out as
plain metadata for `model.bpe_tokenizer.BPETokenizer.from_gguf_metadata`.

Anything we cannot represent faithfully (another architecture, a quantization type we do not
dequantize, a truncated file, a missing tensor) raises `GGUFImportError` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from model.config import DecoderConfig

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported; the message names the file and what is wrong."""


@dataclass
class GGUFModel:
    config: DecoderConfig
    state_dict: dict[str, torch.Tensor]  # our parameter names, fp32
    tokenizer: dict = field(default_factory=dict)  # tokens, token_type, merges, model, pre, special ids
    chat_template: str | None = None
    name: str = ""


def _open(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise GGUFImportError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on a cut-off header
        raise GGUFImportError(f"{path}: truncated or corrupt GGUF header ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        end = t.data_offset + int(t.n_bytes)
        if end > size:
            raise GGUFImportError(f"{path}: truncated: tensor {t.name} needs bytes up to {end}, file has {size}")
    return reader


def _meta(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_metadata(reader, path: Path) -> dict:
    """All scalar/array metadata as Python values."""
    return {k: _meta(reader, k) for k in reader.fields}


MAX_CONTEXT = 1 << 20


def config_from_metadata(meta: dict, path: Path) -> DecoderConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(f"{path}: unsupported architecture {arch!r}; supported: {list(SUPPORTED_ARCHITECTURES)}")

    def need(key):
        full = f"{arch}.{key}"
        if full not in meta:
            raise GGUFImportError(f"{path}: metadata key {full!r} missing")
        return meta[full]

    n_heads = int(need("attention.head_count"))
    d_model = int(need("embedding_length"))
    head_dim = int(meta.get(f"{arch}.rope.dimension_count", d_model // n_heads))
    if head_dim != d_model // n_heads:
        raise GGUFImportError(f"{path}: partial rotary (rope dims {head_dim} != head dim {d_model // n_heads}) "
                              "is not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    context = int(need("context_length"))
    if not 0 < context <= MAX_CONTEXT:  # the RoPE table is allocated for the whole context
        raise GGUFImportError(f"{path}: context_length {context} outside 1..{MAX_CONTEXT}")
    return DecoderConfig(
        vocab_size=int(vocab), d_model=d_model, n_layers=int(need("block_count")), n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        d_ff=int(need("feed_forward_length")), max_seq_len=context,
        norm="rmsnorm", norm_eps=float(need("attention.layer_norm_rms_epsilon")), positions="rope",
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)), mlp="swiglu",
        attn_bias=False, mlp_bias=False, norm_bias=False,
        tie_embeddings=True,  # corrected below when the file has its own output.weight
        bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows: (n_heads*D, d) in pairs-interleaved order -> rotate-half order."""
    out_dim = w.shape[0]
    half = out_dim // n_heads // 2
    # llama.cpp wrote rows as (head, half, 2); the original order is (head, 2, half)
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(t, path: Path) -> torch.Tensor:
    from gguf import quants

    qtype = t.tensor_type.name
    if qtype not in SUPPORTED_QUANT_TYPES:
        raise GGUFImportError(f"{path}: tensor {t.name} has quantization type {qtype}; "
                              f"supported: {list(SUPPORTED_QUANT_TYPES)}")
    arr = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims fastest-first; torch wants (out, in)
    return torch.from_numpy(arr.reshape(shape).copy())


def _tensors(reader, path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for t in reader.tensors:
        try:
            out[t.name] = _dequantize(t, path)
        except GGUFImportError:
            raise
        except Exception as e:
            raise GGUFImportError(f"{path}: cannot read tensor {t.name} ({type(e).__name__}: {e})") from None
    return out


def state_from_gguf_tensors(g: dict[str, torch.Tensor], cfg: DecoderConfig, path: Path) -> dict[str, torch.Tensor]:
    """llama.cpp tensor names -> our DecoderLM parameter names (fused qkv and gate_up)."""

    def take(name):
        if name not in g:
            raise GGUFImportError(f"{path}: tensor {name!r} missing")
        return g[name]

    sd = {"embed.weight": take("token_embd.weight"), "norm.weight": take("output_norm.weight")}
    if "output.weight" in g:
        sd["lm_head.weight"] = g["output.weight"]
    for i in range(cfg.n_layers):
        p, q = f"blk.{i}.", f"blocks.{i}."
        wq = unpermute_qk(take(p + "attn_q.weight"), cfg.n_heads)  # (H*D, d)
        wk = unpermute_qk(take(p + "attn_k.weight"), cfg.kv_heads)  # (Hkv*D, d)
        sd[q + "attn.qkv_proj.weight"] = torch.cat([wq, wk, take(p + "attn_v.weight")], 0)
        sd[q + "attn.o_proj.weight"] = take(p + "attn_output.weight")
        sd[q + "attn_norm.weight"] = take(p + "attn_norm.weight")
        sd[q + "mlp_norm.weight"] = take(p + "ffn_norm.weight")
        sd[q + "mlp.gate_up.weight"] = torch.cat([take(p + "ffn_gate.weight"), take(p + "ffn_up.weight")], 0)
        sd[q + "mlp.down.weight"] = take(p + "ffn_down.weight")
    return sd


def tokenizer_metadata(meta: dict) -> dict:
    keys = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
            "unknown_token_id", "padding_token_id", "add_bos_token", "add_eos_token")
    return {k: meta[f"tokenizer.ggml.{k}"] for k in keys if f"tokenizer.ggml.{k}" in meta}


def load_gguf(path: str | Path) -> GGUFModel:
    """Read and dequantize a GGUF file into our config + state dict (+ tokenizer metadata).
    Any malformed content (truncated, corrupt metadata, inconsistent shapes) raises GGUFImportError."""
    path = Path(path)
    try:
        return _load_gguf(path)
    except GGUFImportError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, ZeroDivisionError, OverflowError) as e:
        raise GGUFImportError(f"{path}: malformed GGUF ({type(e).__name__}: {e})") from None


def _expected_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of DecoderLM(cfg), computed on the meta device (nothing is allocated)."""
    from model.decoder import DecoderLM

    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in DecoderLM(cfg).state_dict().items()}


def _load_gguf(path: Path) -> GGUFModel:
    import dataclasses

    reader = _open(path)
    meta = read_metadata(reader, path)
    cfg = config_from_metadata(meta, path)
    g = _tensors(reader, path)
    if "output.weight" in g:
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    sd = state_from_gguf_tensors(g, cfg, path)
    for name, shape in _expected_shapes(cfg).items():
        if name in sd and tuple(sd[name].shape) != shape:
            raise GGUFImportError(f"{path}: {name} has shape {tuple(sd[name].shape)}, metadata implies {shape}")
    return GGUFModel(cfg, sd, tokenizer_metadata(meta), meta.get("tokenizer.chat_template"),
                     meta.get("general.name") or path.stem)


def gguf_to_decoder(path: str | Path):
    """(DecoderLM in fp32, GGUFModel) — the model with the file's weights loaded."""
    from model.decoder import DecoderLM

    gm = load_gguf(path)
    model = DecoderLM(gm.config)
    missing, unexpected = model.load_state_dict(gm.state_dict, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and gm.config.tie_embeddings)]
    if missing or unexpected:
        raise GGUFImportError(f"{path}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval(), gm
