"""Corrupted GGUF files: every truncation is rejected, and a bit flip in the header is either rejected with
GGUFImportError naming the file or harmless, i.e. the model gives exactly the good file's logits.

What is flipped: one seeded random bit in every byte before the tensor data — magic, version, counts,
metadata keys, type tags and values, tensor names, dimensions, types and offsets, alignment padding. That
is where a wrong load is the loader's fault. Two spans are left out: the 4-byte values of the float
hyperparameters (rope.freq_base, the RMSNorm epsilon). GGUF has no checksum, so a flip there is another
valid model, as undetectable as a flip in the tensor data; their keys and type tags are still flipped.
`test_the_logits_check_detects_a_loadable_corruption` shows the comparison catches such a file.
"""

import random
import struct
from collections import Counter

import pytest
import torch
from gguf import GGUFReader, GGUFValueType
from gguf_util import write_tiny_gguf

from model.config import TINY_LLAMA
from model.decoder import DecoderLM
from model.importers.gguf import GGUFImportError, gguf_to_decoder

X = torch.randint(0, TINY_LLAMA.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """A tiny model is built per fuzz case; see conftest's one_torch_thread for why one thread."""


def part_offset(field, index: int) -> int:
    """Byte offset in the file of `field.parts[index]`."""
    return field.offset + sum(int(p.nbytes) for p in field.parts[:index])


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    torch.manual_seed(0)
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", DecoderLM(TINY_LLAMA))
    model, _ = gguf_to_decoder(path)
    with torch.no_grad():
        logits = model(X)
    return path.read_bytes(), logits, GGUFReader(str(path))


def outcome(path, logits) -> str:
    """'rejected' (GGUFImportError naming the file), 'same' (loads, identical logits) or 'different'."""
    try:
        model, _ = gguf_to_decoder(path)
    except GGUFImportError as e:
        assert path.name in str(e), e
        return "rejected"
    with torch.no_grad():
        out = model(X)
    return "same" if out.shape == logits.shape and torch.equal(out, logits) else "different"


def flip(data: bytes, byte: int, bit: int) -> bytes:
    buf = bytearray(data)
    buf[byte] ^= 1 << bit
    return bytes(buf)


def test_truncations_are_all_rejected(good, tmp_path):
    data, logits, reader = good
    rng = random.Random(0)
    start = reader.data_offset
    cuts = {0, 1, 4, 8, 16, 24, start - 1, start, start + 1, len(data) - 1}
    cuts |= {rng.randrange(start) for _ in range(20)} | {rng.randrange(start, len(data)) for _ in range(20)}
    path = tmp_path / "cut.gguf"
    outcomes = Counter()
    for cut in sorted(cuts):
        path.write_bytes(data[:cut])
        outcomes[outcome(path, logits)] += 1
    assert outcomes == {"rejected": len(cuts)}, outcomes


def test_header_bit_flips_are_rejected_or_harmless(good, tmp_path):
    data, logits, reader = good
    floats = {part_offset(f, len(f.parts) - 1) + k for f in reader.fields.values()
              if f.types == [GGUFValueType.FLOAT32] for k in range(4)}
    assert len(floats) == 8  # rope.freq_base and the RMSNorm epsilon
    rng = random.Random(0)
    path = tmp_path / "flip.gguf"
    outcomes, wrong = Counter(), []
    for byte in range(reader.data_offset):
        if byte in floats:
            continue
        bit = rng.randrange(8)
        path.write_bytes(flip(data, byte, bit))
        result = outcome(path, logits)
        outcomes[result] += 1
        if result == "different":
            wrong.append((byte, bit))
    print(dict(outcomes))
    assert not wrong, f"loaded with different logits (byte, bit): {wrong}"
    assert outcomes["rejected"] > 0 and outcomes["same"] > 0, outcomes


def _set_u32(data: bytes, offset: int, value: int) -> bytes:
    buf = bytearray(data)
    struct.pack_into("<I", buf, offset, value)
    return bytes(buf)


# Header corruptions that once loaded wrong or ran out of memory, each now refused by name.
REGRESSIONS = {
    # general.architecture's type STRING -> ARRAY: the reader looped past the end of the file
    "array type tag": lambda d, r: flip(d, part_offset(r.fields["general.architecture"], 2), 0),
    # block_count 2 -> 0 or 1: the other layers' tensors were silently dropped
    "zero layers": lambda d, r: _set_u32(d, part_offset(r.fields["llama.block_count"], 3), 0),
    "one layer": lambda d, r: _set_u32(d, part_offset(r.fields["llama.block_count"], 3), 1),
    # FLOAT32 -> UINT32: the epsilon's bits read as a huge integer
    "float as int": lambda d, r: _set_u32(d, part_offset(r.fields["llama.attention.layer_norm_rms_epsilon"], 2),
                                          int(GGUFValueType.UINT32)),
    # the last tensor F32 -> F16: half its bytes read as fp16, the rest left over at the end of the file
    "last tensor type": lambda d, r: _set_u32(d, part_offset(r.tensors[-1].field, 4), 1),
    # a tensor's data offset moved by one alignment unit: it read part of its neighbour
    "shifted offset": lambda d, r: flip(d, part_offset(r.tensors[2].field, 5), 5),
}


@pytest.mark.parametrize("name", REGRESSIONS)
def test_header_corruptions_that_used_to_load_are_rejected(good, tmp_path, name):
    data, logits, reader = good
    path = tmp_path / "bad.gguf"
    path.write_bytes(REGRESSIONS[name](data, reader))
    assert outcome(path, logits) == "rejected"


def _change_a_weight(data: bytes, reader) -> bytes:
    norm = next(t for t in reader.tensors if t.name == "output_norm.weight")
    buf = bytearray(data)
    (w,) = struct.unpack_from("<f", buf, norm.data_offset)
    struct.pack_into("<f", buf, norm.data_offset, w + 0.5)
    return bytes(buf)


@pytest.mark.parametrize("mutation, expected", [("unchanged", "same"), ("weight changed", "different")])
def test_the_logits_check_detects_a_loadable_corruption(good, tmp_path, mutation, expected):
    """The comparison behind 'harmless' bites: one changed weight in the data loads and is reported."""
    data, logits, reader = good
    path = tmp_path / "m.gguf"
    path.write_bytes(data if mutation == "unchanged" else _change_a_weight(data, reader))
    assert outcome(path, logits) == expected


def test_a_big_endian_file_is_rejected_not_loaded_with_garbled_weights(good, tmp_path):
    """A big-endian GGUF has big-endian tensor bytes too, which the dequantizers would read as little-endian:
    refused, naming the file and the conversion."""
    import struct

    data, _, _ = good
    version = struct.unpack_from("<I", data, 4)[0]
    path = tmp_path / "big.gguf"
    path.write_bytes(data[:4] + struct.pack(">I", version) + data[8:])
    with pytest.raises(GGUFImportError, match="big-endian"):
        gguf_to_decoder(path)
