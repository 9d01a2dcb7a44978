"""ATTNSERVE_ISA=avx2 stands one host in for an AVX2-only one: flags, torch, oneDNN and inductor capped."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model.cpu_features import capped

ROOT = Path(__file__).resolve().parents[1]
FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni",
                   "avx_vnni", "amx_tile", "amx_bf16"})


def test_caps_drop_the_wider_instruction_sets():
    assert capped(FLAGS, "avx2") == {"sse4_2", "avx", "avx2", "fma", "f16c"}
    assert capped(FLAGS, "scalar") == {"sse4_2"}
    assert capped(FLAGS, None) == FLAGS and capped(FLAGS, "") == FLAGS


def _run(code: str, isa: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                            "TORCHINDUCTOR_CPP_MARCH")}
    env.update(ATTNSERVE_ISA=isa, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif("avx2" not in open("/proc/cpuinfo").read(), reason="needs an x86 CPU with AVX2")
def test_the_cap_reaches_torch_and_our_flags():
    code = ("from model.cpu_features import apply_isa_cap, cpu_flags; apply_isa_cap(); import torch, os; "
            "print(torch.backends.cpu.get_cpu_capability(), any(f.startswith('avx512') for f in cpu_flags()), "
            "os.environ['TORCHINDUCTOR_CPP_MARCH']); from model.cpu_features import cpu_label; print(cpu_label())")
    r = _run(code, "avx2")
    caps, label = r.stdout.splitlines()
    assert caps.split() == ["AVX2", "False", "x86-64-v3"], r.stderr
    # what benchmarks print beside their figures names the cap, not the instructions withheld
    assert label.endswith(": avx2 (ATTNSERVE_ISA=avx2)"), label


def test_an_unknown_cap_is_refused_by_the_command_line():
    r = _run("import sys; from service.cli import main; sys.exit(main(['data', '--help']))", "avx9")
    assert r.returncode == 2
    assert "ATTNSERVE_ISA='avx9'" in r.stderr and "avx2" in r.stderr
