"""C++ kernels compiled on this machine at first use, with torch's extension builder.

The CPU kernels of the `attnserve::` ops (model/csrc/*.cpp), instruction set picked at run time: a Python
kernel takes the GIL on each of a step's calls, which a Serve replica's event loop holds while it streams.
Built once per torch version and source under `$TORCH_EXTENSIONS_DIR`; `python -m model.native_ops` builds
it ahead. Without a compiler the Python kernels serve, with a warning; `ATTNSERVE_NATIVE=0` turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
import sys
from functools import lru_cache
from pathlib import Path

import torch

from model.file_lock import file_lock

SOURCES = tuple(Path(__file__).parent / "csrc" / f for f in ("int8_linear.cpp", "int4_linear.cpp",
                                                                    "prefix_attention.cpp", "dropout.cpp"))
# at::parallel_for is OpenMP code in ATen's headers: without -fopenmp it runs serially. The library then
# needs libgomp.so.1, which resolves to the one torch already loaded (one thread pool).
CFLAGS = ("-O2", "-fopenmp")

log = logging.getLogger(__name__)


def build_dir() -> Path:
    h = hashlib.blake2b(digest_size=6)
    for src in SOURCES:
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return root / f"attnserve_native-torch{torch.__version__}-{h.hexdigest()}"


def _whole_library(so: Path) -> bool:
    """Whether the shared library `so` is as long as its ELF header says (the section headers come last)."""
    with open(so, "rb") as f:
        head = f.read(64)
    if head[:6] != b"\x7fELF\x02\x01":  # not a 64-bit little-endian ELF file (a cut one too): dlopen judges it
        return True
    if len(head) < 64:
        return False
    (shoff,) = struct.unpack_from("<Q", head, 0x28)  # where the section headers start
    shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
    return so.stat().st_size >= shoff + shentsize * shnum


@lru_cache(maxsize=1)
def load() -> bool:
    """Load (building it first where needed) the native library -> whether its kernels are registered."""
    if os.environ.get("ATTNSERVE_NATIVE", "1") == "0":
        return False
    d = build_dir()
    so = d / "attnserve_native.so"
    try:
        # a process starting beside another's build waits for the whole library, not a half-linked file
        with file_lock(d / "load.lock"):
            if so.exists():
                try:
                    if not _whole_library(so):  # dlopen would map it past its end: SIGBUS, not an error
                        raise OSError("the file is shorter than its ELF header says")
                    torch.ops.load_library(str(so))
                    return True
                except OSError as e:  # a build killed while linking leaves a file that is not a library
                    log.warning("attnserve's native kernels in %s do not load (%s); building them again", so, e)
                    so.unlink()
            from torch.utils.cpp_extension import load as build

            if shutil.which("ninja") is None:  # the `ninja` wheel installs it beside this interpreter
                os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
            log.info("building attnserve's native kernels in %s", d)
            build("attnserve_native", [str(s) for s in SOURCES], build_directory=str(d), extra_cflags=list(CFLAGS),
                  extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
            return True
    except Exception as e:  # no compiler, no ninja, a broken toolchain: the Python kernels still work
        log.warning("attnserve's native kernels are unavailable, Python kernels serve instead: %s", e)
        return False


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import model.attention  # noqa: F401  (these define the ops the library implements)
    import model.dropout  # noqa: F401
    import model.quantize  # noqa: F401

    ok = load()
    print(f"native kernels: {'loaded from ' + str(build_dir()) if ok else 'unavailable (Python kernels serve)'}")
    sys.exit(0 if ok else 1)
