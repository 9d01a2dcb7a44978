"""SentencePiece round-trip, incremental detokenization, checkpoint save/load and its errors."""

import json

import pytest
import torch

from model.checkpoint import CheckpointError, load_checkpoint, load_tokenizer, save_checkpoint
from model.config import TINY_LLAMA, TINY_SEQ2SEQ
from model.decoder import DecoderLM
from model.seq2seq import EncoderDecoder
from model.tokenizer import IncrementalDetokenizer, SentencePieceTokenizer

MIXED = [
    "The Fund may also invest in money market instruments.",
    "本基金亦可投资于货币市场工具和持有现金。",
    "Mixed 中英文 text with emoji 🚀🎉 and numbers 12,345.67!",
    "第 1 款 (a) 段 — “quotes” and 'apostrophes'",
]


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    d = tmp_path_factory.mktemp("spm")
    corpus = MIXED * 50 + [f"sentence number {i} 第{i}句" for i in range(300)]
    return SentencePieceTokenizer.train(corpus, d / "spm", 600, user_symbols=["<2en>", "<2zh>"], num_threads=1)


def test_sentencepiece_round_trip_mixed_text(sp):
    for text in MIXED:
        assert sp.decode(sp.encode(text)) == text
    tag = sp.token_to_id("<2en>")
    assert tag is not None and tag in sp.encode("<2en> hello")  # a single piece
    assert (sp.pad_id, sp.bos_id, sp.eos_id) == (0, 1, 2)


def test_incremental_detokenizer_never_splits_utf8(sp):
    text = "emoji 🚀🎉 中文 done"
    ids = sp.encode(text)
    detok = IncrementalDetokenizer(sp)
    deltas = [detok.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text


def test_checkpoint_round_trip(tmp_path, sp):
    for model in (DecoderLM(TINY_LLAMA).eval(), EncoderDecoder(TINY_SEQ2SEQ).eval()):
        d = save_checkpoint(model, tmp_path / type(model).__name__, tokenizer=sp)
        loaded = load_checkpoint(d)
        want, got = model.state_dict(), loaded.state_dict()
        assert want.keys() == got.keys()
        for n, a in want.items():
            assert torch.equal(a, got[n]), n
        assert load_tokenizer(d).encode(MIXED[1]) == sp.encode(MIXED[1])


def test_truncated_weights_give_clear_error(tmp_path):
    d = save_checkpoint(DecoderLM(TINY_LLAMA), tmp_path / "m")
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(d)


def test_wrong_shape_and_unknown_architecture_and_missing_file(tmp_path):
    d = save_checkpoint(DecoderLM(TINY_LLAMA), tmp_path / "m")
    meta = json.loads((d / "config.json").read_text())
    meta["config"]["d_model"] = 64
    (d / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"shape"):
        load_checkpoint(d)
    meta["architecture"] = "mamba"
    (d / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="unknown architecture 'mamba'"):
        load_checkpoint(d)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(d)


def test_a_save_with_another_kind_of_tokenizer_replaces_the_old_one(sp, tmp_path):
    """A folder that held a SentencePiece checkpoint, saved over with a BPE tokenizer: load_tokenizer (which
    prefers tokenizer.model) must find the new tokenizer, not the stale one."""
    from model.bpe_tokenizer import BPETokenizer

    d = save_checkpoint(DecoderLM(TINY_LLAMA), tmp_path / "m", tokenizer=sp)
    assert isinstance(load_tokenizer(d), SentencePieceTokenizer)
    tokens = [chr(b) for b in range(32, 127)]
    bpe = BPETokenizer.from_gguf_metadata({"model": "gpt2", "tokens": tokens, "merges": [],
                                           "token_type": [1] * len(tokens)}, chat_template=None)
    save_checkpoint(DecoderLM(TINY_LLAMA), d, tokenizer=bpe)
    assert isinstance(load_tokenizer(d), BPETokenizer) and not (d / "tokenizer.model").exists()
    save_checkpoint(DecoderLM(TINY_LLAMA), d)  # weights only: the tokenizer stays
    assert isinstance(load_tokenizer(d), BPETokenizer)


@pytest.mark.parametrize("name, data", [("tokenizer.json", b"{"), ("tokenizer.json", b"[1]"),
                                        ("tokenizer.model", b"garbage"), ("tokenizer.model", b"")])
def test_a_torn_tokenizer_file_is_a_checkpoint_error(tmp_path, name, data):
    """A torn tokenizer.json raised `tokenizers`' bare Exception (a traceback from `attnserve generate
    --model`), a torn tokenizer.model sentencepiece's RuntimeError: both are a CheckpointError naming it."""
    (tmp_path / name).write_bytes(data)
    with pytest.raises(CheckpointError, match=f"{name}: cannot read the tokenizer"):
        load_tokenizer(tmp_path)


def test_a_save_clears_the_copy_a_killed_save_left(tmp_path):
    import os

    killed = tmp_path / ".m.999999999.tmp"  # no live process has this pid
    running = tmp_path / f".m.{os.getppid()}.tmp"  # a save still going on in a live process
    other = tmp_path / ".mm.999999999.tmp"  # another checkpoint's
    for d in (killed, running, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x")
    save_checkpoint(DecoderLM(TINY_LLAMA), tmp_path / "m")
    assert not killed.exists() and running.exists() and other.exists()
