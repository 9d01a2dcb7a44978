"""Checkpoints: a directory of config.json + model.safetensors + tokenizer files (ours, or a Hugging Face
Llama, Mistral, Qwen2 or GPT-2 folder).

Loading never unpickles. A missing file, a wrong tensor shape, or an unknown architecture raises
`CheckpointError` naming it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import threading
from pathlib import Path

import psutil
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from model.config import DecoderConfig, Seq2SeqConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURES = {"decoder": DecoderConfig, "seq2seq": Seq2SeqConfig}


class CheckpointError(ValueError):
    pass


def build_model(config: DecoderConfig | Seq2SeqConfig) -> nn.Module:
    if isinstance(config, DecoderConfig):
        from model.decoder import DecoderLM

        return DecoderLM(config)
    from model.seq2seq import EncoderDecoder

    return EncoderDecoder(config)


def _save_tensors(state: dict[str, torch.Tensor], path: Path) -> None:
    save_file(state, str(path), metadata={"format": "pt"})


def save_checkpoint(model: nn.Module, directory: str | Path, *, tokenizer=None,
                    dtype: torch.dtype | None = None, extra: dict | None = None) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    # written beside the folder, then moved in file by file, the config last: a kill mid-write (an export
    # over the served checkpoint) leaves the old files or the new ones, never a torn one; other files stay
    tmp = d.parent / f".{d.name}.{os.getpid()}.tmp"
    for old in d.parent.glob(f".{glob.escape(d.name)}.*.tmp"):  # a writer killed mid-save left its copy
        pid = old.name[len(d.name) + 2:-len(".tmp")]
        if pid.isdigit() and (int(pid) == os.getpid() or not psutil.pid_exists(int(pid))):
            shutil.rmtree(old, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = model.cfg
    arch = "decoder" if isinstance(cfg, DecoderConfig) else "seq2seq"
    meta = {"architecture": arch, "config": cfg.to_dict(), **(extra or {})}
    (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    state, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:  # tied weights are stored once
            seen.add(t.data_ptr())
            state[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous().cpu()
    try:
        _save_tensors(state, tmp / WEIGHTS_FILE)
        if tokenizer is not None:
            tokenizer.save(tmp)
        written = {f.name for f in tmp.iterdir()}
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == CONFIG_FILE):
            if f.name == CONFIG_FILE and tokenizer is not None:
                # a tokenizer of the other kind left by an earlier save would be the one load_tokenizer finds
                for name in {"tokenizer.model", "tokenizer.json"} - written:
                    (d / name).unlink(missing_ok=True)
            os.replace(f, d / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def read_config(directory: str | Path) -> tuple[DecoderConfig | Seq2SeqConfig, dict]:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint config missing: {path}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config", {}), dict):
        raise CheckpointError(f"{path}: expected an object with 'architecture' and 'config'")
    arch = meta.get("architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: unknown architecture {arch!r}; expected one of {sorted(ARCHITECTURES)}")
    try:
        cfg = ARCHITECTURES[arch].from_dict(meta.get("config", {}))
    except (TypeError, ValueError, ZeroDivisionError) as e:  # ZeroDivisionError: a size of 0 divides
        raise CheckpointError(f"{path}: bad config: {e}") from None
    return cfg, meta


def cast_refused(t: torch.Tensor, param: torch.Tensor) -> str | None:
    """Why `t` may not load into `param`: integers or bools for floats (or floats for integers), which
    load_state_dict would cast silently; None for floats of any width."""
    if t.is_floating_point() != param.is_floating_point():
        return f"is {t.dtype}, the model's is {param.dtype} (weights are cast between floating-point types only)"
    return None


def load_state(model: nn.Module, weights: str | Path) -> None:
    """Load safetensors into `model`, checking names and shapes; raise CheckpointError otherwise."""
    weights = Path(weights)
    if not weights.is_file():
        raise CheckpointError(f"weights file missing: {weights}")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{weights}: cannot read safetensors ({e})") from None
    expected = model.state_dict()
    shared: dict[int, list[str]] = {}  # names the config ties share one parameter, stored once
    for name, t in expected.items():
        shared.setdefault(t.data_ptr(), []).append(name)
    # a tied name may be left out when another name of its group is stored; a group with none is missing
    tied = {n for names in shared.values() if any(m in state for m in names) for n in names if n not in state}
    missing = sorted(set(expected) - set(state) - tied)
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{weights}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{weights}: tensor {name} has shape {tuple(t.shape)}, "
                                  f"config expects {tuple(expected[name].shape)}")
        if why := cast_refused(t, expected[name]):
            raise CheckpointError(f"{weights}: tensor {name} {why}")
    for names in shared.values():  # two different tensors for one tied parameter: the config is wrong
        given = [n for n in names if n in state]
        if any(not torch.equal(state[given[0]], state[n]) for n in given[1:]):
            raise CheckpointError(f"{weights}: the config ties {' and '.join(given)}, but the file holds different "
                                  "tensors for them (untied weights: set the config's tie option to false)")
    model.load_state_dict(state, strict=False)


_INIT_FUNCTIONS = ("normal_", "uniform_", "zeros_", "ones_", "constant_", "xavier_uniform_", "xavier_normal_",
                   "kaiming_uniform_", "kaiming_normal_", "trunc_normal_")
_init_lock = threading.Lock()


@contextlib.contextmanager
def _weights_left_uninitialised():
    """While a model is built only to be loaded, `nn.init` leaves tensors as allocated: load_state overwrites
    them all (it refuses a file missing one). Process-wide: a loader builds no other model meanwhile."""
    with _init_lock:
        saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


@contextlib.contextmanager
def _sizes_allocatable(d: Path):
    """The allocator's refusal of a config's sizes (a d_model typed with extra zeros) as a CheckpointError."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if isinstance(e, RuntimeError) and not re.search("allocate|overflow", str(e)):
            raise
        raise CheckpointError(f"{d / CONFIG_FILE}: the model it describes does not fit in memory ({e})") from None


def is_hf_folder(directory: str | Path) -> bool:
    """A Hugging Face model folder: its config.json names a `model_type` (ours, an `architecture`)."""
    try:
        meta = json.loads((Path(directory) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # read_config says what is wrong with it
        return False
    return isinstance(meta, dict) and "architecture" not in meta and "model_type" in meta


def load_checkpoint(directory: str | Path, *, dtype: torch.dtype | None = None) -> nn.Module:
    """Our checkpoint folder, or a Llama, Mistral, Qwen2 or GPT-2 folder as transformers saves it
    (model/importers/hf.py)."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {d}")
    if is_hf_folder(d):
        from model.importers.hf import import_hf

        with _sizes_allocatable(d):
            model = import_hf(d)
        return (model if dtype is None else model.to(dtype)).eval()
    cfg, _ = read_config(d)
    previous = torch.get_default_dtype()
    if dtype is not None and dtype.is_floating_point:
        torch.set_default_dtype(dtype)  # build in the target dtype: no transient fp32 copy of the weights
    try:
        with _weights_left_uninitialised(), _sizes_allocatable(d):
            model = build_model(cfg)
    finally:
        torch.set_default_dtype(previous)
    load_state(model, d / WEIGHTS_FILE)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def load_tokenizer(directory: str | Path):
    """The tokenizer stored beside a checkpoint (SentencePiece or Hugging Face tokenizer.json)."""
    from model.tokenizer import SentencePieceTokenizer

    d = Path(directory)
    # a Hugging Face folder may hold the SentencePiece model its tokenizer.json was made from: the latter is used
    if (d / SentencePieceTokenizer.FILE).is_file() and not ((d / "tokenizer.json").is_file() and is_hf_folder(d)):
        path, load = d / SentencePieceTokenizer.FILE, SentencePieceTokenizer
    elif (d / "tokenizer.json").is_file():
        from model.bpe_tokenizer import BPETokenizer

        path, load = d / "tokenizer.json", lambda _: BPETokenizer.load(d)
    else:
        raise CheckpointError(f"no tokenizer in {d} (expected tokenizer.model or tokenizer.json)")
    try:
        return load(path)
    except Exception as e:  # a torn file: `tokenizers` raises a bare Exception, sentencepiece a RuntimeError
        raise CheckpointError(f"{path}: cannot read the tokenizer ({e})") from None
