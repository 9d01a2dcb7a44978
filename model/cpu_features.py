"""Whether bf16 is worth it on this CPU: decided by measuring, not by the name of the CPU.

The same avx512_bf16 flag means "several times faster than fp32" on one host and "slower" on another, so
"auto" times a decode-sized matmul in both dtypes once per process (docs/decisions.md).
"""

from __future__ import annotations

import contextlib
import os
import time
from functools import lru_cache

BF16_MIN_SPEEDUP = 1.25  # below this the rounding error of bf16 is not worth it
# ATTNSERVE_ISA=avx2 (or scalar) withholds wider instructions from our kernels, our flag checks and
# (apply_isa_cap) torch, oneDNN and inductor, so one host can stand in for an AVX2-only one.
ISA_ENV = "ATTNSERVE_ISA"
_WIDE = ("avx512", "amx", "avx_vnni")
_AVX = frozenset({"avx", "avx2", "fma", "f16c"})
_TORCH_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                        "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3"},
               "scalar": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                          "TORCHINDUCTOR_CPP_MARCH": "x86-64"}}


def capped(flags: frozenset[str], isa: str | None) -> frozenset[str]:
    """The flags an `isa` cap leaves: avx2 drops AVX-512, AMX and AVX-VNNI; scalar drops AVX too."""
    if isa not in _TORCH_CAPS:
        return flags
    kept = {f for f in flags if not f.startswith(_WIDE)}
    return frozenset(kept - _AVX if isa == "scalar" else kept)


def apply_isa_cap() -> None:
    """Under ATTNSERVE_ISA, set the variables that cap torch's kernels, oneDNN and inductor (unless set):
    call before torch is imported; Ray's worker processes inherit them."""
    isa = os.environ.get(ISA_ENV) or None
    if isa is not None and isa not in _TORCH_CAPS:
        raise ValueError(f"{ISA_ENV}={isa!r}: use one of {sorted(_TORCH_CAPS)}, or leave it unset")
    for k, v in _TORCH_CAPS.get(isa, {}).items():
        os.environ.setdefault(k, v)


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    info: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    return info


def cpu_flags() -> frozenset[str]:
    """The CPU's flags, less what ATTNSERVE_ISA withholds (read now: the cap may be set after import)."""
    return capped(frozenset(_cpuinfo().get("flags", "").split()), os.environ.get(ISA_ENV))


def cpu_label() -> str:
    """The CPU's model and the flags that change our kernels (as capped), for a benchmark's output."""
    info, flags = _cpuinfo(), cpu_flags()
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile") if f in flags]
    name = f"{info.get('model name', 'unknown CPU')} f{info.get('cpu family', '?')} m{info.get('model', '?')}"
    return f"{name}: {' '.join(shown) or 'no AVX2'}" + (f" ({ISA_ENV}={os.environ[ISA_ENV]})"
                                                        if os.environ.get(ISA_ENV) else "")


def has_amx_bf16(flags: frozenset[str]) -> bool:
    """True when the CPU has AMX tiles with bf16 (oneDNN then runs bf16 matmuls on AMX)."""
    return "amx_bf16" in flags and "amx_tile" in flags


def has_bf16_instructions(flags: frozenset[str]) -> bool:
    """The CPU multiplies bf16 natively (AVX512-BF16 or AMX); without either, bf16 is emulated and slow."""
    return has_amx_bf16(flags) or "avx512_bf16" in flags


def bf16_matmul_speedup(m: int = 64, k: int = 576, n: int = 1536, repeats: int = 7) -> float:
    """fp32 time / bf16 time of an (m, k) @ (k, n) product (a decode step's MLP at 64 rows), best of
    `repeats`, the dtypes interleaved so that a noisy neighbour hits both."""
    import torch

    x32 = torch.randn(m, k)
    w32 = torch.randn(n, k)
    x16, w16 = x32.bfloat16(), w32.bfloat16()
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    for _ in range(repeats):
        for x, w in ((x32, w32), (x16, w16)):
            t = time.perf_counter()
            for _ in range(5):
                torch.nn.functional.linear(x, w)  # (m, n)
            best[x.dtype] = min(best[x.dtype], time.perf_counter() - t)
    return best[torch.float32] / best[torch.bfloat16]


def decide_bf16(flags: frozenset[str], speedup: float | None) -> bool:
    """The rule: native bf16 instructions, and (when measured) at least BF16_MIN_SPEEDUP x fp32."""
    return has_bf16_instructions(flags) and (speedup is None or speedup >= BF16_MIN_SPEEDUP)


@lru_cache(maxsize=1)
def prefers_bf16() -> bool:
    """True when bf16 is the faster dtype on this CPU (measured once per process)."""
    flags = cpu_flags()  # the speed is measured only where the instructions exist
    return has_bf16_instructions(flags) and decide_bf16(flags, bf16_matmul_speedup())
