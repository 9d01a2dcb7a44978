"""Bit-flipped and truncated GGUF files are rejected with GGUFImportError, never another exception."""

import random

import pytest
from test_smollm2_gguf import write_tiny_gguf

from model.config import TINY_LLAMA
from model.decoder import DecoderLM
from model.importers.gguf import GGUFImportError, gguf_to_decoder


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, DecoderLM(TINY_LLAMA))
    return path.read_bytes()


def test_bit_flips_and_truncations_fail_cleanly(good, tmp_path):
    rng = random.Random(0)
    path = tmp_path / "bad.gguf"
    header = min(len(good), 4096)  # magic, version, counts, metadata, tensor infos live up front
    outcomes = {"rejected": 0, "loaded": 0}
    cases = [bytes(good[:rng.randrange(len(good))]) for _ in range(20)]
    for _ in range(80):
        buf = bytearray(good)
        i = rng.randrange(header)
        buf[i] ^= 1 << rng.randrange(8)
        cases.append(bytes(buf))
    for data in cases:
        path.write_bytes(data)
        try:
            gguf_to_decoder(path)  # a flip in a value that does not matter may still load
            outcomes["loaded"] += 1
        except GGUFImportError as e:
            assert "bad.gguf" in str(e)
            outcomes["rejected"] += 1
    assert outcomes["rejected"] >= 40, outcomes
