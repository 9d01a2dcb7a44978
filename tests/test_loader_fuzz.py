"""Malformed checkpoints (truncated, bit-flipped) are rejected with CheckpointError, never a crash."""

import random

import pytest

from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model.config import TINY_LLAMA
from model.decoder import DecoderLM


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = save_checkpoint(DecoderLM(TINY_LLAMA), tmp_path_factory.mktemp("ckpt") / "m")
    return d, (d / "model.safetensors").read_bytes(), (d / "config.json").read_bytes()


def _write(d, weights: bytes, config: bytes):
    (d / "model.safetensors").write_bytes(weights)
    (d / "config.json").write_bytes(config)


def test_truncations_are_rejected(good, tmp_path):
    d, weights, config = good
    d2 = tmp_path / "t"
    d2.mkdir()
    for cut in (0, 4, 8, 20, len(weights) // 3, len(weights) - 1):
        _write(d2, weights[:cut], config)
        with pytest.raises(CheckpointError):
            load_checkpoint(d2)


def test_header_bit_flips_are_rejected_or_harmless(good, tmp_path):
    d, weights, config = good
    header_len = 8 + int.from_bytes(weights[:8], "little")
    d2 = tmp_path / "f"
    d2.mkdir()
    rng = random.Random(0)
    rejected = 0
    for _ in range(60):
        buf = bytearray(weights)
        i = rng.randrange(header_len)
        buf[i] ^= 1 << rng.randrange(8)
        _write(d2, bytes(buf), config)
        try:
            load_checkpoint(d2)  # a flip inside e.g. a dtype-irrelevant spot may still load
        except CheckpointError as e:
            assert "model.safetensors" in str(e)
            rejected += 1
    assert rejected >= 30


def test_corrupt_config_json_is_rejected(good, tmp_path):
    d, weights, config = good
    d2 = tmp_path / "c"
    d2.mkdir()
    for bad in (b"", b"{", config[: len(config) // 2], b'{"architecture": "decoder", "config": {"d_model": "x"}}',
                b'{"architecture": "decoder", "config": {"bogus": 1}}', b"[]"):
        _write(d2, weights, bad)
        with pytest.raises(CheckpointError):
            load_checkpoint(d2)
