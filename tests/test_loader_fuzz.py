"""Malformed checkpoints (truncated, bit-flipped, bad config) are rejected with CheckpointError, never a crash,
and a bit flip that still loads is harmless: the model gives exactly the good checkpoint's logits.

What is flipped: one seeded random bit in every byte of model.safetensors' header — the 8-byte length
prefix and the JSON (tensor names, dtypes, shapes, data offsets, __metadata__, padding). That is where a
wrong load is the loader's fault. The tensor data is left alone: safetensors has no checksum, so a flip
there is another valid model; `test_the_logits_check_detects_a_loadable_corruption` shows the comparison
catches such a file.
"""

import json
import random
import struct
from collections import Counter

import pytest
import torch

from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model.config import TINY_LLAMA, TINY_SEQ2SEQ
from model.decoder import DecoderLM

X = torch.randint(0, TINY_LLAMA.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """A tiny model is built per fuzz case; see conftest's one_torch_thread for why one thread."""


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    torch.manual_seed(0)
    d = save_checkpoint(DecoderLM(TINY_LLAMA), tmp_path_factory.mktemp("ckpt") / "m")
    with torch.no_grad():
        logits = load_checkpoint(d)(X)
    return d, (d / "model.safetensors").read_bytes(), (d / "config.json").read_bytes(), logits


def _write(d, weights: bytes, config: bytes):
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(weights)
    (d / "config.json").write_bytes(config)


def outcome(d, logits) -> str:
    """'rejected' (CheckpointError naming the weights file), 'same' (loads, identical logits) or 'different'."""
    try:
        model = load_checkpoint(d)
    except CheckpointError as e:
        assert "model.safetensors" in str(e), e
        return "rejected"
    with torch.no_grad():
        out = model(X)
    return "same" if out.shape == logits.shape and torch.equal(out, logits) else "different"


def test_truncations_are_rejected(good, tmp_path):
    d, weights, config, logits = good
    cuts = (0, 4, 8, 20, len(weights) // 3, len(weights) - 1)
    outcomes = Counter()
    for cut in cuts:
        _write(tmp_path / "t", weights[:cut], config)
        outcomes[outcome(tmp_path / "t", logits)] += 1
    assert outcomes == {"rejected": len(cuts)}, outcomes


def test_header_bit_flips_are_rejected_or_harmless(good, tmp_path):
    d, weights, config, logits = good
    header_len = 8 + int.from_bytes(weights[:8], "little")
    rng = random.Random(0)
    outcomes, wrong = Counter(), []
    for i in range(header_len):
        bit = rng.randrange(8)
        buf = bytearray(weights)
        buf[i] ^= 1 << bit
        _write(tmp_path / "f", bytes(buf), config)
        result = outcome(tmp_path / "f", logits)
        outcomes[result] += 1
        if result == "different":
            wrong.append((i, bit))
    print(dict(outcomes))
    assert not wrong, f"loaded with different logits (byte, bit): {wrong}"
    assert outcomes["rejected"] > 0 and outcomes["same"] > 0, outcomes  # __metadata__ flips load


@pytest.mark.parametrize("mutation, expected", [("unchanged", "same"), ("weight changed", "different")])
def test_the_logits_check_detects_a_loadable_corruption(good, tmp_path, mutation, expected):
    """The comparison behind 'harmless' bites: one changed weight in the data loads and is reported."""
    d, weights, config, logits = good
    buf = bytearray(weights)
    if mutation == "weight changed":
        header_len = 8 + int.from_bytes(weights[:8], "little")
        start, _ = json.loads(weights[8:header_len])["norm.weight"]["data_offsets"]
        (w,) = struct.unpack_from("<f", buf, header_len + start)
        struct.pack_into("<f", buf, header_len + start, w + 0.5)
    _write(tmp_path / "m", bytes(buf), config)
    assert outcome(tmp_path / "m", logits) == expected


def test_corrupt_config_json_is_rejected(good, tmp_path):
    d, weights, config, _ = good
    d2 = tmp_path / "c"
    for bad in (b"", b"{", config[: len(config) // 2], b'{"architecture": "decoder", "config": {"d_model": "x"}}',
                b'{"architecture": "decoder", "config": {"bogus": 1}}', b"[]"):
        _write(d2, weights, bad)
        with pytest.raises(CheckpointError):
            load_checkpoint(d2)


def test_a_zero_size_in_the_config_is_a_checkpoint_error(good, tmp_path):
    d, weights, config, _ = good
    meta = json.loads(config)
    meta["config"]["n_heads"] = 0
    _write(tmp_path / "z", weights, json.dumps(meta).encode())
    with pytest.raises(CheckpointError, match="bad config"):
        load_checkpoint(tmp_path / "z")


@pytest.mark.parametrize("arch, cfg", [("seq2seq", {**TINY_SEQ2SEQ.to_dict(), "d_model": 33, "n_heads": 3}),
                                       ("decoder", {**TINY_LLAMA.to_dict(), "d_model": 36})])
def test_an_odd_sinusoidal_or_rope_dimension_is_a_checkpoint_error(tmp_path, arch, cfg):
    """An odd d_model (sinusoidal positions) or RoPE head dimension built a model that failed with torch's
    RuntimeError: the seq2seq one while loading, the decoder at its first forward."""
    tmp_path.joinpath("config.json").write_text(json.dumps({"architecture": arch, "config": cfg}))
    with pytest.raises(CheckpointError, match="bad config: (sinusoidal positions|RoPE) need"):
        load_checkpoint(tmp_path)


def test_untied_weights_under_a_tying_config_are_refused(tmp_path):
    """A file with its own lm_head.weight under a config that ties it to the embedding: loading both into the
    one shared parameter would silently replace the embedding with the head."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    d = save_checkpoint(DecoderLM(TINY_LLAMA), tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    emb = next(n for n in state if "emb" in n)
    state["lm_head.weight"] = torch.randn_like(state[emb])
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="ties"):
        load_checkpoint(d)
    state["lm_head.weight"] = state[emb].clone()  # the same values: a file that stored the tie twice
    save_file(state, str(d / "model.safetensors"))
    load_checkpoint(d)


def test_a_tied_weight_missing_under_every_name_is_refused(tmp_path):
    """Leaving out one name of a tied pair is how the tie is stored; leaving out all of them would leave the
    shared parameter as uninitialised memory."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    d = save_checkpoint(DecoderLM(TINY_LLAMA), tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    emb = next(n for n in state if "emb" in n)
    del state[emb]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors"):
        load_checkpoint(d)


def test_weights_of_a_non_float_dtype_are_refused(tmp_path):
    """load_state_dict casts what it is given: int8 codes or booleans would load as weights of those values;
    a float file of another width (bf16) is a cast the loader means to make."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    d = save_checkpoint(DecoderLM(TINY_LLAMA), tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    for dtype in (torch.int8, torch.bool):
        save_file({n: t.to(dtype) for n, t in state.items()}, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError, match=f"is {dtype}, the model's is torch.float32"):
            load_checkpoint(d)
    save_file({n: t.to(torch.bfloat16) for n, t in state.items()}, str(d / "model.safetensors"))
    load_checkpoint(d)


def test_a_special_token_beyond_the_vocabulary_is_a_checkpoint_error(tmp_path):
    """A translator config whose pad, bos or eos id is no row of the embedding: an AssertionError from
    nn.Embedding (pad_id) or an IndexError in every decode (bos_id, eos_id) before; now named on load."""
    from model.config import TINY_SEQ2SEQ
    from model.seq2seq import EncoderDecoder

    d = save_checkpoint(EncoderDecoder(TINY_SEQ2SEQ), tmp_path / "t")
    meta = json.loads((d / "config.json").read_text())
    for name in ("pad_id", "bos_id", "eos_id"):
        bad = {**meta, "config": {**meta["config"], name: TINY_SEQ2SEQ.vocab_size}}
        (d / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=f"{name}=97 must be below vocab_size=97"):
            load_checkpoint(d)


def test_a_nan_or_negative_float_in_the_config_is_a_checkpoint_error(good, tmp_path):
    """JSON's NaN loads, and a NaN (or negative) norm_eps or rope_theta made every logit NaN: the checkpoint
    loaded and served garbage without a word."""
    d, weights, config, _ = good
    meta = json.loads(config)
    for field, value in (("norm_eps", float("nan")), ("rope_theta", float("inf")), ("norm_eps", -1e-5),
                         ("dropout", float("nan"))):
        _write(tmp_path / "n", weights, json.dumps({**meta, "config": {**meta["config"], field: value}}).encode())
        with pytest.raises(CheckpointError, match=f"{field} must be a finite non-negative number"):
            load_checkpoint(tmp_path / "n")


def test_sizes_too_large_to_allocate_are_a_checkpoint_error(good, tmp_path):
    """A d_model with extra zeros failed in torch's allocator with a traceback, before the weights were read."""
    d, weights, config, _ = good
    meta = json.loads(config)
    meta["config"]["d_model"] *= 2**30
    _write(tmp_path / "big", weights, json.dumps(meta).encode())
    with pytest.raises(CheckpointError, match="config.json: the model it describes does not fit in memory"):
        load_checkpoint(tmp_path / "big")
    from model.importers.hf import export_hf  # a Hugging Face folder: imported, not built from our config

    export_hf(DecoderLM(TINY_LLAMA), tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf["intermediate_size"] *= 2**30
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="config.json: the model it describes does not fit in memory"):
        load_checkpoint(tmp_path / "hf")
