"""What the CPU can do, from /proc/cpuinfo: decides whether bf16 is worth it on a CPU.

Measured with torch 2.13 on two hosts of this project (2 cores each, docs/benchmarks.md):
- with AMX (amx_bf16, amx_tile): bf16 GEMM 370-730 GFLOP/s vs fp32 ~200 -> bf16 decodes and trains faster;
- with AVX512-BF16 but no AMX: bf16 GEMM ~160 GFLOP/s vs fp32 ~220 -> fp32 is faster
  (translator training: 2,600 tok/s fp32 vs 1,550 with bf16 autocast).
So "auto" picks bf16 on a CPU only when it has AMX.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def has_amx_bf16(flags: frozenset[str] | None = None) -> bool:
    """True when the CPU has AMX tiles with bf16 (oneDNN then runs bf16 matmuls on AMX)."""
    flags = cpu_flags() if flags is None else flags
    return "amx_bf16" in flags and "amx_tile" in flags
