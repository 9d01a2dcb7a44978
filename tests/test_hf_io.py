"""Hugging Face layout export/import for tiny random Llama- and GPT-2-style models.

transformers is the oracle: it must load our exported folders and compute the same logits.
"""

import dataclasses
import json

import pytest
import torch
import transformers

from model.bpe_tokenizer import bytes_to_unicode
from model.config import TINY_GPT2, TINY_LLAMA
from model.decoder import DecoderLM
from model.importers.hf import HFFormatError, export_hf, import_hf

LLAMA_BIAS = dataclasses.replace(TINY_LLAMA, attn_bias=True, mlp_bias=True, tie_embeddings=False)


def _random(cfg):
    torch.manual_seed(1)
    m = DecoderLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped tensor shows
        for name, p in m.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def _tokens(cfg, t=12):
    return torch.randint(0, cfg.vocab_size, (2, t))


def _max_diff(ours, theirs, x) -> float:
    with torch.no_grad():
        return (ours(x) - theirs(x).logits).abs().max().item()


@pytest.mark.parametrize("cfg", [TINY_LLAMA, LLAMA_BIAS, TINY_GPT2], ids=["llama", "llama-bias-untied", "gpt2"])
def test_export_loads_in_transformers_with_same_logits(tmp_path, cfg):
    ours = _random(cfg)
    export_hf(ours, tmp_path)
    kind = "gpt2" if cfg is TINY_GPT2 else "llama"
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == kind
    cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    theirs = cls.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert _max_diff(ours, theirs, _tokens(cfg)) < 1e-4


@pytest.mark.parametrize("cfg", [TINY_LLAMA, LLAMA_BIAS, TINY_GPT2], ids=["llama", "llama-bias", "gpt2"])
def test_import_round_trips_exactly(tmp_path, cfg):
    ours = _random(cfg)
    export_hf(ours, tmp_path)
    back = import_hf(tmp_path)
    assert back.cfg == ours.cfg
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("shard", [None, "8KB"], ids=["one-file", "sharded"])
def test_import_of_a_transformers_saved_model(tmp_path, shard):
    """A checkpoint 'trained elsewhere': built and saved by transformers itself, in one file or in shards
    (model.safetensors.index.json + its files), as larger checkpoints come."""
    hf_cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=5000.0, tie_word_embeddings=False)
    torch.manual_seed(2)
    theirs = transformers.LlamaForCausalLM(hf_cfg).eval()
    theirs.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    sharded = (tmp_path / "model.safetensors.index.json").is_file()
    assert sharded == bool(shard) and (tmp_path / "model.safetensors").exists() != sharded
    assert not shard or len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    ours = import_hf(tmp_path)
    assert ours.cfg.rope_theta == 5000.0 and ours.cfg.kv_heads == 2
    assert _max_diff(ours, theirs, torch.randint(0, 50, (2, 10))) < 1e-4


QWEN2 = dataclasses.replace(TINY_LLAMA, attn_bias=True, attn_out_bias=False)


def test_qwen2_style_exports_and_imports_with_transformers_logits(tmp_path):
    """Biased q/k/v with an unbiased output projection is Qwen2: exported as one, and a Qwen2 model saved by
    transformers imports with its logits."""
    ours = _random(QWEN2)
    assert ours.blocks[0].attn.o_proj.bias is None and ours.blocks[0].attn.qkv_proj.bias is not None
    export_hf(ours, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "qwen2"
    theirs = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert _max_diff(ours, theirs, _tokens(QWEN2)) < 1e-4
    hf_cfg = transformers.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=1e6, tie_word_embeddings=True)
    torch.manual_seed(5)
    theirs = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # transformers starts biases at zero: make them count
        for name, p in theirs.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p))
    theirs.save_pretrained(tmp_path / "theirs")
    back = import_hf(tmp_path / "theirs")
    assert back.cfg.attn_bias and back.cfg.attn_out_bias is False and back.cfg.tie_embeddings
    assert _max_diff(back, theirs, torch.randint(0, 50, (2, 10))) < 1e-4
    (tmp_path / "theirs" / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "theirs" / "config.json").read_text()), "use_sliding_window": True}))
    with pytest.raises(HFFormatError, match="sliding-window"):
        import_hf(tmp_path / "theirs")


def test_mistral_imports_with_its_window_as_the_context(tmp_path):
    """Mistral is Llama's computation while positions stay within its sliding window: the context is capped
    there."""
    hf_cfg = transformers.MistralConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=16, head_dim=8)
    torch.manual_seed(6)
    theirs = transformers.MistralForCausalLM(hf_cfg).eval()
    theirs.save_pretrained(tmp_path)
    ours = import_hf(tmp_path)
    assert ours.cfg.max_seq_len == 16 and ours.cfg.kv_heads == 2
    assert _max_diff(ours, theirs, torch.randint(0, 50, (2, 16))) < 1e-4


def test_unsupported_layouts_are_named(tmp_path):
    odd = dataclasses.replace(TINY_GPT2, n_kv_heads=2)  # GPT-2 has no grouped-query attention
    with pytest.raises(HFFormatError, match="no Hugging Face architecture"):
        export_hf(DecoderLM(odd), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(HFFormatError, match="mamba"):
        import_hf(tmp_path)
    from model.importers.hf import config_from_hf

    llama = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
             "num_attention_heads": 2, "intermediate_size": 16}
    config_from_hf(llama)  # silu by default
    # vocab_size "8" loaded, then building the model raised a TypeError the service does not catch;
    # rms_norm_eps "x" even loaded, and every forward pass raised one
    for bad in ({"num_attention_heads": 0}, {"hidden_size": "8"}, {"rope_scaling": "linear"}, {"vocab_size": "8"},
                {"intermediate_size": 16.0}, {"rms_norm_eps": "x"}, {"bos_token_id": "1"}):
        with pytest.raises(HFFormatError, match="bad config"):  # not a TypeError from deep inside
            config_from_hf({**llama, **bad})
    with pytest.raises(HFFormatError, match="activation 'gelu'"):
        config_from_hf({**llama, "hidden_act": "gelu"})
    gpt2 = {"model_type": "gpt2", "vocab_size": 8, "n_embd": 8, "n_layer": 1, "n_head": 2}
    config_from_hf(gpt2)
    for bad in ({"n_layer": "1"}, {"n_inner": 32.0}, {"layer_norm_epsilon": None}):
        with pytest.raises(HFFormatError, match="bad config"):
            config_from_hf({**gpt2, **bad})
    for odd in ({"scale_attn_weights": False}, {"scale_attn_by_inverse_layer_idx": True}):
        with pytest.raises(HFFormatError, match="attention scaling"):
            config_from_hf({**gpt2, **odd})
    export_hf(DecoderLM(TINY_LLAMA), tmp_path)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFFormatError, match="model.layers.1.mlp.up_proj.weight"):
        import_hf(tmp_path)


def test_tensors_the_config_has_no_place_for_are_refused(tmp_path):
    """A config with fewer layers than the weights (or any stray tensor) does not describe the file: refused,
    not loaded with the extra layers dropped; buffers exporters store (causal masks, RoPE frequencies) pass."""
    from safetensors.torch import load_file, save_file

    export_hf(DecoderLM(TINY_LLAMA), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(sd, str(tmp_path / "model.safetensors"))
    import_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] - 1}))
    with pytest.raises(HFFormatError, match="no place for"):
        import_hf(tmp_path)


def _byte_level_tokenizer(d, specials):
    """A tokenizer.json as transformers' byte-level BPE tokenizers save it: one token per byte, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(bytes_to_unicode().values())}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)  # ids 256, 257, ...
    tk.save(str(d / "tokenizer.json"))


def test_a_transformers_folder_is_served_as_a_checkpoint(tmp_path):
    """`generator.checkpoint` may name a Llama folder as transformers saves it (as vLLM serves them): its
    tokenizer.json, special tokens saved as AddedToken fields, chat_template.jinja; greedy output equals the
    argmax of transformers' own logits."""
    from service.commands.generate import stream_engine
    from service.config import ModelSpec
    from service.engine.types import SamplingParams
    from service.models import load_generator

    _byte_level_tokenizer(tmp_path, ["<|im_start|>", "<|im_end|>"])
    added = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", **added}, "eos_token": {"content": "<|im_end|>", **added},
        "additional_special_tokens": [{"content": "<|im_start|>", **added}, {"content": "<|im_end|>", **added}]}))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf_cfg = transformers.LlamaConfig(vocab_size=258, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    torch.manual_seed(3)
    theirs = transformers.LlamaForCausalLM(hf_cfg).eval()
    theirs.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 10]}))

    gen = load_generator(ModelSpec(checkpoint=str(tmp_path), name="tiny-llama", device="cpu", dtype="float32",
                                   quantization="none", engine={"max_slots": 2, "max_seq_len": 64}))
    assert gen.name == gen.engine.name == "tiny-llama"
    assert gen.chat_template is not None and gen.engine.eos_ids == {257, 10}  # the generation config's too
    prompt = gen.encode_chat([{"role": "user", "content": "hi"}])
    assert gen.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" and prompt[0] == 256
    stats: dict = {}
    "".join(stream_engine(gen.engine, prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
                          stats))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(theirs(torch.tensor([ids])).logits[0, -1].argmax()))
    assert stats["ids"] == ids[len(prompt):]


def test_a_sharded_transformers_folder_is_served_quantized(tmp_path, monkeypatch):
    """Shards (model.safetensors.index.json) and int8 linears: the calibration cache keys on the index."""
    from service.commands.generate import stream_engine
    from service.config import ModelSpec
    from service.engine.types import SamplingParams
    from service.models import load_generator

    monkeypatch.setenv("ATTNSERVE_HOME", str(tmp_path / "home"))
    _byte_level_tokenizer(tmp_path, ["<|endoftext|>"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    hf_cfg = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      eos_token_id=256)
    torch.manual_seed(4)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path, max_shard_size="64KB")
    assert not (tmp_path / "model.safetensors").exists()
    gen = load_generator(ModelSpec(checkpoint=str(tmp_path), device="cpu", dtype="float32", quantization="int8",
                                   engine={"max_slots": 2, "max_seq_len": 64}))
    from model.quantize import quantization_of

    assert quantization_of(gen.engine.model) == "int8"
    stats: dict = {}
    "".join(stream_engine(gen.engine, gen.encode_prompt("hello"), SamplingParams(max_new_tokens=4, temperature=0.0,
                                                                                ignore_eos=True), stats))
    assert len(stats["ids"]) == 4


def test_sentencepiece_style_pieces_give_their_bytes(tmp_path):
    """Llama 2 / Mistral tokenizer.json (Metaspace, byte fallback): "▁" is a space and "<0xNN>" one byte in the
    vocabulary bytes the grammars and logprobs read, while byte-level vocabularies keep GPT-2's byte map."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    from model.bpe_tokenizer import BPETokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "\u2581": 259,
             "\u2581Hello": 260, "é": 261}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = BPETokenizer.load(tmp_path)
    table = tok.token_bytes()
    assert table[3 + 0x0A] == b"\n" and table[259] == b" " and table[260] == b" Hello" and table[261] == "é".encode()
    ids = tok.encode("Hello é\n")
    assert b"".join(table[i] for i in ids) == b" Hello \xc3\xa9\n" and tok.decode(ids) == "Hello é\n"
    _byte_level_tokenizer(tmp_path, ["<|endoftext|>"])
    table = BPETokenizer.load(tmp_path).token_bytes()
    assert table[:256] == [bytes([b]) for b in bytes_to_unicode()] and table[256] == b"<|endoftext|>"


def test_generation_config_stop_ids(tmp_path):
    from model.importers.hf import generation_stop_ids

    assert generation_stop_ids(tmp_path) == set()
    for eos, ids in ((2, {2}), ([128001, 128009], {128001, 128009}), (None, set())):
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        assert generation_stop_ids(tmp_path) == ids
    for bad in ('{"eos_token_id": "</s>"}', '{"eos_token_id": [-1]}', '{"eos_token_id": true}', "[1, 2]", "not json"):
        (tmp_path / "generation_config.json").write_text(bad)
        with pytest.raises(HFFormatError, match="generation_config.json"):
            generation_stop_ids(tmp_path)


def test_weights_of_a_non_float_dtype_are_refused(tmp_path):
    """Integer tensors in a transformers folder are not weights load_state_dict may cast; bf16 ones are."""
    from safetensors.torch import load_file, save_file

    export_hf(DecoderLM(TINY_LLAMA), tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    save_file({n: t.to(torch.int32) for n, t in sd.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFFormatError, match="is torch.int32, the model's is torch.float32"):
        import_hf(tmp_path)
    save_file({n: t.to(torch.bfloat16) for n, t in sd.items()}, str(tmp_path / "model.safetensors"))
    import_hf(tmp_path)


@pytest.mark.parametrize("cfg, name, change", [
    (TINY_LLAMA, "model.layers.0.self_attn.k_proj.weight", lambda t: t[:, :-1]),  # torch.cat refused them
    (TINY_LLAMA, "model.layers.0.self_attn.k_proj.weight", lambda t: t.to(torch.int32)),  # cat made it float
    (TINY_LLAMA, "model.layers.0.mlp.up_proj.weight", lambda t: t[0, 0]),
    (TINY_GPT2, "transformer.h.0.attn.c_attn.weight", lambda t: t[None]),  # .t() refused it
], ids=["columns", "int-piece", "scalar-piece", "3d-conv1d"])
def test_pieces_that_do_not_join_are_a_format_error(tmp_path, cfg, name, change):
    """q/k/v (gate/up) tensors that cannot be joined, or a Conv1D weight that is not a matrix, are an
    HFFormatError naming them, not torch's RuntimeError; an integer piece is not promoted to float."""
    from safetensors.torch import load_file, save_file

    export_hf(DecoderLM(cfg), tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd[name] = change(sd[name]).contiguous()
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFFormatError, match="do not make blocks.0"):
        import_hf(tmp_path)


def test_torn_weights_or_index_are_a_format_error(tmp_path):
    """A truncated model.safetensors, an index without its weight map or naming a missing shard is an
    HFFormatError (a ValueError, which the service and the CLI report), not safetensors' own error, an
    OSError or a KeyError escaping them."""
    export_hf(DecoderLM(TINY_LLAMA), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(HFFormatError, match="cannot read the weights"):
        import_hf(tmp_path)
    weights.unlink()
    index = tmp_path / "model.safetensors.index.json"
    for bad in ("{}", "[1]", '{"weight_map": [1]}', "{", '{"weight_map": {"a": "missing.safetensors"}}'):
        index.write_text(bad)
        with pytest.raises(HFFormatError, match="cannot read the weights"):
            import_hf(tmp_path)


def test_a_folder_whose_post_processor_adds_bos_encodes_prompts_with_it(tmp_path):
    """Llama 3's tokenizer_config has no add_bos_token: its tokenizer.json's post-processor adds BOS, and
    transformers encodes a prompt with it; so do we (once, where a chat template writes it too)."""
    from tokenizers import Tokenizer, processors

    from model.bpe_tokenizer import BPETokenizer

    _byte_level_tokenizer(tmp_path, ["<|begin_of_text|>", "<|eot_id|>"])
    tk = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tk.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                      special_tokens=[("<|begin_of_text|>", 256)])
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
    theirs, ours = transformers.AutoTokenizer.from_pretrained(tmp_path), BPETokenizer.load(tmp_path)
    ids = ours.encode("Hi there")
    assert ids == theirs("Hi there")["input_ids"] and ids[0] == 256 and len(ids) == 9
    assert ours.encode("<|begin_of_text|>Hi there") == ids
