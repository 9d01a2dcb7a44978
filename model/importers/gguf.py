"""Import a Llama-architecture GGUF file (llama.cpp's format) into our `DecoderLM`.

Tensors are dequantized to fp32, and llama.cpp's Q/K row permutation (for its interleaved RoPE) is undone for
our "rotate half" RoPE. Anything we cannot represent faithfully, and any corrupt or truncated file, raises
`GGUFImportError` naming it rather than loading wrong weights.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
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


# GGUF metadata value types (gguf.GGUFValueType) and the bytes a scalar of each takes
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_FLOAT_TYPES = {6, 12}
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, type, one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # empty name, n_dims = 0, type, offset
GGML_MAX_DIMS = 4


class _HeaderWalk:
    """Bounds-checked walk over a GGUF header before gguf-py's reader sees the file: the reader trusts
    lengths, so one flipped bit in an array length grows a list until memory runs out."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def fail(self, what: str):
        raise GGUFImportError(f"{self.path}: truncated or corrupt GGUF header ({what} at byte {self.pos})")

    def take(self, n: int, what: str) -> int:
        if n > len(self.buf) - self.pos:
            self.fail(f"{what} needs {n} bytes, file has {len(self.buf) - self.pos} left")
        self.pos += n
        return self.pos - n

    def uint(self, size: int, what: str) -> int:
        return struct.unpack_from("<" + {4: "I", 8: "Q"}[size], self.buf, self.take(size, what))[0]

    def text(self, what: str) -> str:
        n = self.uint(8, f"{what} length")
        start = self.take(n, what)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")

    def skip_value(self, vtype: int, key: str) -> None:
        if vtype in _SCALAR_SIZES:
            self.take(_SCALAR_SIZES[vtype], key)
        elif vtype == _STRING:
            self.take(self.uint(8, f"{key} length"), key)
        elif vtype == _ARRAY:
            itype, count = self.uint(4, f"{key} item type"), self.uint(8, f"{key} count")
            if itype in _SCALAR_SIZES:
                self.take(count * _SCALAR_SIZES[itype], f"{key} ({count} items)")
                return
            if itype not in (_STRING, _ARRAY):
                self.fail(f"metadata key {key!r} has arrays of unknown type {itype}")
            if count * (8 if itype == _STRING else 12) > len(self.buf) - self.pos:  # each item's least size
                self.fail(f"metadata key {key!r} claims {count} items, more than the file holds")
            for _ in range(count):
                self.skip_value(itype, key)
        else:
            self.fail(f"metadata key {key!r} has unknown value type {vtype}")

    def walk(self) -> None:
        if self.buf[:4] != b"GGUF":
            self.fail("magic is not GGUF")
        self.pos = 4
        version = self.uint(4, "version")
        if version & 0xFFFF == 0:  # the tensors' bytes would be big-endian too, which the dequantizers do not read
            self.fail("the file is big-endian; convert it to little-endian (gguf-py's gguf_convert_endian) first")
        if version not in (2, 3):
            self.fail(f"GGUF version {version} is not supported")
        n_tensors, n_kv = self.uint(8, "tensor count"), self.uint(8, "metadata count")
        if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KV_BYTES > len(self.buf) - self.pos:
            self.fail(f"{n_tensors} tensors and {n_kv} metadata keys cannot fit in the file")
        for _ in range(n_kv):
            key = self.text("metadata key")
            self.skip_value(self.uint(4, f"{key} type"), key)
        for _ in range(n_tensors):
            name = self.text("tensor name")
            n_dims = self.uint(4, f"tensor {name} dimension count")
            if n_dims > GGML_MAX_DIMS:
                self.fail(f"tensor {name} has {n_dims} dimensions, at most {GGML_MAX_DIMS} allowed")
            self.take(8 * n_dims + 4 + 8, f"tensor {name} dimensions, type and offset")


def _check_header(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise GGUFImportError(f"{path}: truncated or corrupt GGUF header (empty file)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _HeaderWalk(buf, path).walk()
    except OSError as e:
        raise GGUFImportError(f"{path}: cannot read ({e})") from None


def _check_tensor_layout(reader, path: Path, size: int) -> None:
    """Tensors must be packed in file order at aligned ends, as llama.cpp requires, up to the file's end: so
    a corrupted offset, shape or type cannot silently read another tensor's bytes."""
    from gguf import GGML_QUANT_SIZES

    align = int(reader.alignment)
    expected = 0
    for t in reader.tensors:
        block, _ = GGML_QUANT_SIZES[t.tensor_type]
        if len(t.shape) and int(t.shape[0]) % block:
            raise GGUFImportError(f"{path}: tensor {t.name} rows of {int(t.shape[0])} are not a whole number "
                                  f"of {t.tensor_type.name} blocks ({block})")
        offset = t.data_offset - reader.data_offset
        if offset != expected:
            raise GGUFImportError(f"{path}: tensor {t.name} data at offset {offset}, expected {expected} "
                                  "(after the previous tensor)")
        end = t.data_offset + int(t.n_bytes)
        if end > size:
            raise GGUFImportError(f"{path}: truncated: tensor {t.name} needs bytes up to {end}, file has {size}")
        expected = -(-(offset + int(t.n_bytes)) // align) * align
    if reader.tensors and size > reader.data_offset + expected:
        raise GGUFImportError(f"{path}: {size - end} bytes after the last tensor's data; "
                              "a tensor's shape or type does not match the file")


def _open(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise GGUFImportError(f"GGUF file not found: {path}")
    _check_header(path)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on a cut-off header
        raise GGUFImportError(f"{path}: truncated or corrupt GGUF header ({type(e).__name__}: {e})") from None
    _check_tensor_layout(reader, path, path.stat().st_size)
    return reader


# the keys we read, by the kind of value they must hold; llama.cpp refuses a key of another type too
_INT_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "rope.dimension_count", "vocab_size")
_FLOAT_KEYS = ("rope.freq_base", "attention.layer_norm_rms_epsilon")
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
# the tokenizer's keys by the type tags they must have (an array's: ARRAY, then its items' unless empty);
# read as they are, a string "false" would add BOS and a string of tokens would be split into characters
_BOOL = 7
_TOKENIZER_KEYS = {
    **{f"tokenizer.ggml.{k}": ("a string", {(_STRING,)}) for k in ("model", "pre")},
    "tokenizer.chat_template": ("a string", {(_STRING,)}),
    **{f"tokenizer.ggml.{k}": ("a boolean", {(_BOOL,)}) for k in ("add_bos_token", "add_eos_token")},
    **{f"tokenizer.ggml.{k}": ("an array of strings", {(_ARRAY,), (_ARRAY, _STRING)}) for k in ("tokens", "merges")},
    "tokenizer.ggml.token_type": ("an array of integers", {(_ARRAY,), *((_ARRAY, t) for t in _INT_TYPES)}),
}


def check_metadata_types(reader, path: Path) -> None:
    """Refuse a key we use whose type is of the wrong kind: a flipped type tag decodes a float as a
    plausible-looking integer (or the reverse)."""
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    wanted = {**{f"{arch}.{k}": ("an integer", {(t,) for t in _INT_TYPES}) for k in _INT_KEYS},
              **{f"{arch}.{k}": ("a float", {(t,) for t in _FLOAT_TYPES}) for k in _FLOAT_KEYS},
              **{f"tokenizer.ggml.{k}": ("an integer", {(t,) for t in _INT_TYPES}) for k in _TOKEN_ID_KEYS},
              **_TOKENIZER_KEYS}
    for key, (kind, types) in wanted.items():
        f = reader.fields.get(key)
        if f is not None and tuple(int(t) for t in f.types) not in types:
            raise GGUFImportError(f"{path}: metadata key {key!r} has type "
                                  f"{'/'.join(t.name for t in f.types)}, expected {kind}")


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

    sizes = {key: int(need(key)) for key in
             ("attention.head_count", "embedding_length", "block_count", "feed_forward_length")}
    # no vocab_size key: the tokenizer's token list gives it, if the file has one
    sizes["vocab_size"] = int(meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []))
    for key, value in sizes.items():
        if value <= 0:
            raise GGUFImportError(f"{path}: {arch}.{key} is {value}, expected a positive size")
    n_heads, d_model = sizes["attention.head_count"], sizes["embedding_length"]
    head_dim = int(meta.get(f"{arch}.rope.dimension_count", d_model // n_heads))
    if head_dim != d_model // n_heads:
        raise GGUFImportError(f"{path}: partial rotary (rope dims {head_dim} != head dim {d_model // n_heads}) "
                              "is not supported")
    context = int(need("context_length"))
    if not 0 < context <= MAX_CONTEXT:  # the RoPE table is allocated for the whole context
        raise GGUFImportError(f"{path}: context_length {context} outside 1..{MAX_CONTEXT}")
    # llama.cpp scales positions by this factor (linear unless the type says otherwise, "none": not at all); our
    # RoPE does not, so such a model would import with every position but the first rotated wrongly
    factor = float(meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear") or 0.0)
    scaling = meta.get(f"{arch}.rope.scaling.type", "linear")
    if scaling != "none" and factor not in (0.0, 1.0):
        raise GGUFImportError(f"{path}: RoPE scaling {scaling!r} (factor {factor}) is not supported")
    eps = float(need("attention.layer_norm_rms_epsilon"))
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    for key, value in (("attention.layer_norm_rms_epsilon", eps), ("rope.freq_base", theta)):
        if not (math.isfinite(value) and value > 0):
            raise GGUFImportError(f"{path}: {arch}.{key} is {value}, expected a positive finite number")
    return DecoderConfig(
        vocab_size=sizes["vocab_size"], d_model=d_model, n_layers=sizes["block_count"], n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        d_ff=sizes["feed_forward_length"], max_seq_len=context,
        norm="rmsnorm", norm_eps=eps, positions="rope", rope_theta=theta, mlp="swiglu",
        attn_bias=False, mlp_bias=False, norm_bias=False,
        tie_embeddings=True,  # corrected below when the file has its own output.weight
        bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_id=meta.get("tokenizer.ggml.eos_token_id"),
    )


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows: (n_heads*D, d) in pairs-interleaved order -> rotate-half order."""
    half = w.shape[0] // n_heads // 2
    # llama.cpp wrote rows as (head, half, 2); the original order is (head, 2, half)
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _tensors(reader, path: Path, show_progress: bool = False) -> dict[str, torch.Tensor]:
    from gguf import quants

    from model.progress import progress

    out = {}
    for t in progress(reader.tensors, desc=f"dequantizing {path.name}", unit="tensor", disable=not show_progress):
        if t.tensor_type.name not in SUPPORTED_QUANT_TYPES:
            raise GGUFImportError(f"{path}: tensor {t.name} has quantization type {t.tensor_type.name}; "
                                  f"supported: {list(SUPPORTED_QUANT_TYPES)}")
        try:
            arr = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims fastest-first; torch wants (out, in)
            out[t.name] = torch.from_numpy(arr.reshape(shape).copy())
        except Exception as e:
            raise GGUFImportError(f"{path}: cannot read tensor {t.name} ({type(e).__name__}: {e})") from None
    return out


def state_from_gguf_tensors(g: dict[str, torch.Tensor], cfg: DecoderConfig, path: Path) -> dict[str, torch.Tensor]:
    """llama.cpp tensor names -> our DecoderLM parameter names (fused qkv and gate_up)."""
    used = set()

    def take(name):
        if name not in g:
            raise GGUFImportError(f"{path}: tensor {name!r} missing")
        used.add(name)
        return g[name]

    sd = {"embed.weight": take("token_embd.weight"), "norm.weight": take("output_norm.weight")}
    if "output.weight" in g:
        sd["lm_head.weight"] = take("output.weight")
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
    # e.g. a corrupted block_count, or rope_freqs.weight, which this model cannot apply
    if unused := sorted(set(g) - used):
        raise GGUFImportError(f"{path}: tensors {unused[:5]} (of {len(unused)}) are not used by a "
                              f"{cfg.n_layers}-layer llama model")
    return sd


def tokenizer_metadata(meta: dict) -> dict:
    keys = ("model", "pre", "tokens", "token_type", "merges", *_TOKEN_ID_KEYS, "add_bos_token", "add_eos_token")
    return {k: meta[f"tokenizer.ggml.{k}"] for k in keys if f"tokenizer.ggml.{k}" in meta}


def gguf_to_decoder(path: str | Path, show_progress: bool = False):
    """(DecoderLM in fp32, GGUFModel): the file read and dequantized into our config + state dict (+ tokenizer
    metadata), the model with its weights loaded; malformed content raises GGUFImportError. `show_progress`: a
    bar over the tensors."""
    import dataclasses

    from model.decoder import DecoderLM

    path = Path(path)
    try:
        reader = _open(path)
        check_metadata_types(reader, path)
        meta = {k: f.contents() for k, f in reader.fields.items()}
        cfg = config_from_metadata(meta, path)
        g = _tensors(reader, path, show_progress)
        if "output.weight" in g:
            cfg = dataclasses.replace(cfg, tie_embeddings=False)
        sd = state_from_gguf_tensors(g, cfg, path)
        with torch.device("meta"):  # DecoderLM(cfg)'s parameter shapes, nothing allocated
            expected = {k: tuple(v.shape) for k, v in DecoderLM(cfg).state_dict().items()}
        for name, shape in expected.items():
            if name in sd and tuple(sd[name].shape) != shape:
                raise GGUFImportError(f"{path}: {name} has shape {tuple(sd[name].shape)}, metadata implies {shape}")
    except GGUFImportError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError, ZeroDivisionError, OverflowError) as e:
        raise GGUFImportError(f"{path}: malformed GGUF ({type(e).__name__}: {e})") from None
    model = DecoderLM(cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_embeddings)]
    if missing or unexpected:
        raise GGUFImportError(f"{path}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval(), GGUFModel(cfg, sd, tokenizer_metadata(meta), meta.get("tokenizer.chat_template"))
