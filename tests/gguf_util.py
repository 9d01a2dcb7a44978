"""Tiny llama.cpp-style GGUF files written from a `DecoderLM`, shared by the GGUF import tests."""

import gguf
import numpy as np
import torch

from model.decoder import DecoderLM

Q = gguf.GGMLQuantizationType


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permute (rotate-half order -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, model: DecoderLM, *, arch="llama", qtypes=None, skip=(), tokenizer=None, more=None):
    """Write `model` as a llama.cpp-style GGUF. qtypes: tensor name -> quantization type (default F32);
    tokenizer: byte-level BPE metadata (tokens, token_type, merges, eos_token_id), none by default;
    more: called with the GGUFWriter to add further metadata."""
    c = model.cfg
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.d_ff)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    if more:
        more(w)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokenizer["tokens"])
        w.add_token_types(tokenizer["token_type"])
        w.add_token_merges(tokenizer["merges"])
        w.add_eos_token_id(tokenizer["eos_token_id"])
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    q_dim, kv_dim = c.n_heads * c.dim_head, c.kv_heads * c.dim_head
    tensors = {"token_embd.weight": sd["embed.weight"], "output_norm.weight": sd["norm.weight"]}
    for i in range(c.n_layers):
        p = f"blocks.{i}."
        q, k, v = sd[p + "attn.qkv_proj.weight"].split([q_dim, kv_dim, kv_dim])
        gate, up = sd[p + "mlp.gate_up.weight"].split(c.d_ff)
        tensors |= {f"blk.{i}.attn_q.weight": permute(q, c.n_heads), f"blk.{i}.attn_k.weight": permute(k, c.kv_heads),
                    f"blk.{i}.attn_v.weight": v, f"blk.{i}.attn_output.weight": sd[p + "attn.o_proj.weight"],
                    f"blk.{i}.attn_norm.weight": sd[p + "attn_norm.weight"],
                    f"blk.{i}.ffn_norm.weight": sd[p + "mlp_norm.weight"], f"blk.{i}.ffn_gate.weight": gate,
                    f"blk.{i}.ffn_up.weight": up, f"blk.{i}.ffn_down.weight": sd[p + "mlp.down.weight"]}
    for name, t in tensors.items():
        if name in skip:
            continue
        arr = t.contiguous().numpy()
        qt = (qtypes or {}).get(name, Q.F32)
        if qt == Q.F32:
            w.add_tensor(name, arr)
        elif qt == Q.Q6_K:  # no quantizer in gguf-py: random bytes of the right size are enough here
            block, size = gguf.GGML_QUANT_SIZES[qt]
            raw = np.random.default_rng(0).integers(0, 255, (arr.shape[0], arr.shape[1] // block * size), np.uint8)
            w.add_tensor(name, raw, raw_dtype=qt)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
