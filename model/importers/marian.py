"""Our EncoderDecoder -> the Hugging Face Marian layout (config.json + model.safetensors, `MarianMTModel`).

The folder loads in `transformers` and converts to CTranslate2 with the very same weights. Our sinusoidal
table interleaves sin and cos, Marian's puts every sin first and computes it itself, so we permute the model
dimension of every weight by `PERM` instead: LayerNorm, attention and the FFN are equivariant to it and the
tied output projection contracts it away, so the logits are identical. Decoding starts from our bos token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from model.config import Seq2SeqConfig
from model.seq2seq import EncoderDecoder

VOCAB_FILE = "vocab.json"  # token -> id, for CTranslate2 (and MarianTokenizer)


class MarianExportError(ValueError):
    """This model cannot be expressed as a Hugging Face Marian model; the message says why."""


def interleave_to_halves(d_model: int) -> torch.Tensor:
    """PERM with h_marian = h_ours[..., PERM]: sin dims 0, 2, 4, ... first, then cos dims 1, 3, 5, ..."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def check_exportable(cfg: Seq2SeqConfig) -> None:
    if cfg.norm_first:
        raise MarianExportError("Marian layers are post-LN without final LayerNorms; norm_first=True cannot be "
                                "exported")
    if abs(cfg.norm_eps - 1e-5) > 1e-12:
        raise MarianExportError(f"Marian's LayerNorm eps is fixed at 1e-5; this model uses {cfg.norm_eps}")


def marian_config(cfg: Seq2SeqConfig, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of the equivalent MarianMTModel."""
    dt = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["MarianMTModel"], "model_type": "marian",
        "vocab_size": cfg.vocab_size, "decoder_vocab_size": cfg.vocab_size, "d_model": cfg.d_model,
        "encoder_layers": cfg.n_encoder_layers, "decoder_layers": cfg.n_decoder_layers,
        "encoder_attention_heads": cfg.n_heads, "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.d_ff, "decoder_ffn_dim": cfg.d_ff,
        # ours is nn.GELU(approximate="tanh"); CTranslate2 maps this name to GELUTanh
        "activation_function": "gelu_pytorch_tanh" if cfg.activation == "gelu" else "relu",
        "max_position_embeddings": max(cfg.max_src_len, cfg.max_tgt_len),
        "scale_embedding": cfg.scale_embeddings, "normalize_before": False, "normalize_embedding": False,
        "static_position_embeddings": True, "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
        "dropout": cfg.dropout, "attention_dropout": cfg.dropout, "activation_dropout": cfg.dropout,
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "is_encoder_decoder": True, "use_cache": True,
        "pad_token_id": cfg.pad_id, "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
        "decoder_start_token_id": cfg.bos_id,
        "forced_eos_token_id": None,  # Marian's default (0) would force our pad token at max_length
        "torch_dtype": dt, "dtype": dt,
    }


def generation_config(cfg: Seq2SeqConfig) -> dict:
    return {"decoder_start_token_id": cfg.bos_id, "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
            "pad_token_id": cfg.pad_id, "forced_eos_token_id": None, "num_beams": 1,
            "max_length": cfg.max_tgt_len}


def marian_state_dict(model: EncoderDecoder) -> dict[str, torch.Tensor]:
    """Our parameters renamed, split and permuted into MarianMTModel's names (embeddings stored once)."""
    cfg = model.cfg
    p = {k: v.detach() for k, v in model.state_dict().items()}
    perm = interleave_to_halves(cfg.d_model)
    d = cfg.d_model

    def reads(w):  # Linear reading the model dimension: permute input columns
        return w[:, perm]

    def writes(w):  # Linear weight (out, in) or bias (out,) writing the model dimension: permute rows
        return w[perm]

    out: dict[str, torch.Tensor] = {"model.shared.weight": reads(p["embed.weight"]),
                                    "final_logits_bias": torch.zeros(1, cfg.vocab_size)}

    def attn(dst: str, src: str, fused: list[str]) -> None:  # fused: our projections that stack q, k, v
        w_in = torch.cat([p[f"{src}.{f}.weight"] for f in fused])  # (3 d, d)
        b_in = torch.cat([p[f"{src}.{f}.bias"] for f in fused])
        for name, w, b in zip(("q_proj", "k_proj", "v_proj"), w_in.split(d, 0), b_in.split(d, 0)):
            out[f"{dst}.{name}.weight"], out[f"{dst}.{name}.bias"] = reads(w), b
        out[f"{dst}.out_proj.weight"] = writes(p[f"{src}.o_proj.weight"])
        out[f"{dst}.out_proj.bias"] = writes(p[f"{src}.o_proj.bias"])

    def norm(dst: str, src: str) -> None:
        out[f"{dst}.weight"], out[f"{dst}.bias"] = writes(p[f"{src}.weight"]), writes(p[f"{src}.bias"])

    def ffn(dst: str, src: str) -> None:
        out[f"{dst}.fc1.weight"], out[f"{dst}.fc1.bias"] = reads(p[f"{src}.fc.weight"]), p[f"{src}.fc.bias"]
        out[f"{dst}.fc2.weight"] = writes(p[f"{src}.proj.weight"])
        out[f"{dst}.fc2.bias"] = writes(p[f"{src}.proj.bias"])

    for i in range(cfg.n_encoder_layers):
        s, t = f"encoder.{i}", f"model.encoder.layers.{i}"
        attn(f"{t}.self_attn", f"{s}.self_attn", ["qkv_proj"])
        norm(f"{t}.self_attn_layer_norm", f"{s}.r1.norm")
        ffn(t, f"{s}.ff")
        norm(f"{t}.final_layer_norm", f"{s}.r2.norm")
    for i in range(cfg.n_decoder_layers):
        s, t = f"decoder.{i}", f"model.decoder.layers.{i}"
        attn(f"{t}.self_attn", f"{s}.self_attn", ["qkv_proj"])
        norm(f"{t}.self_attn_layer_norm", f"{s}.r1.norm")
        attn(f"{t}.encoder_attn", f"{s}.cross_attn", ["q_proj", "kv_proj"])
        norm(f"{t}.encoder_attn_layer_norm", f"{s}.r2.norm")
        ffn(t, f"{s}.ff")
        norm(f"{t}.final_layer_norm", f"{s}.r3.norm")
    return out


def vocabulary(tokenizer, cfg: Seq2SeqConfig) -> list[str]:
    """Token strings by id: the SentencePiece pieces, or (no tokenizer, e.g. a random test model)
    `<pad>`, `<s>`, `</s>` at our special ids and `tok<N>` elsewhere."""
    if tokenizer is not None and hasattr(tokenizer, "sp"):
        pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    elif tokenizer is not None:
        raise MarianExportError(f"cannot list the vocabulary of a {type(tokenizer).__name__}; "
                                "only SentencePiece tokenizers are supported")
    else:
        pieces = [f"tok{i}" for i in range(cfg.vocab_size)]
        for i, name in ((cfg.pad_id, "<pad>"), (cfg.bos_id, "<s>"), (cfg.eos_id, "</s>")):
            pieces[i] = name
    if len(pieces) != cfg.vocab_size:
        raise MarianExportError(f"tokenizer has {len(pieces)} tokens, the model {cfg.vocab_size}")
    if len(set(pieces)) != len(pieces):
        raise MarianExportError("the vocabulary has duplicate token strings")
    return pieces


def export_marian(model: EncoderDecoder, tokenizer, out_dir: str | Path, *,
                  dtype: torch.dtype | None = None) -> Path:
    """Write the Marian folder to `out_dir`; with a SentencePiece tokenizer also the files AutoTokenizer
    reads, so it encodes as ours plus eos (the caller puts the `<2en>`/`<2zh>` tag first)."""
    from safetensors.torch import save_file

    cfg = model.cfg
    check_exportable(cfg)
    dtype = dtype or model.embed.weight.dtype
    pieces = vocabulary(tokenizer, cfg)
    state = {k: v.to(dtype).contiguous().cpu() for k, v in marian_state_dict(model).items()}
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(marian_config(cfg, dtype), indent=2) + "\n")
    (d / "generation_config.json").write_text(json.dumps(generation_config(cfg), indent=2) + "\n")
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / VOCAB_FILE).write_text(json.dumps({t: i for i, t in enumerate(pieces)}, ensure_ascii=False, indent=0) + "\n")
    if tokenizer is not None and hasattr(tokenizer, "path"):  # MarianTokenizer (AutoTokenizer) files
        for name in ("source.spm", "target.spm"):
            (d / name).write_bytes(Path(tokenizer.path).read_bytes())
        unk = tokenizer.sp.unk_id()
        tok_cfg = {"tokenizer_class": "MarianTokenizer", "eos_token": pieces[cfg.eos_id],
                   "pad_token": pieces[cfg.pad_id], "unk_token": pieces[unk] if unk >= 0 else pieces[cfg.eos_id],
                   "model_max_length": cfg.max_src_len}
        (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    return d
