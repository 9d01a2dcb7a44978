"""`make loadtest-compare`'s report: one line per stream count with both servers and their ratio; the
llama-server build is native to the host and reaches the sdist through pip, never a registry URL."""

from __future__ import annotations

from pathlib import Path

from loadtests.compare_llamacpp import format_ratios
from loadtests.summary import Summary

ROOT = Path(__file__).resolve().parent.parent


def _s(users: int, tok_s: float, ttft: float, itl: float) -> Summary:
    return Summary("chat-stream", users, 10, 0, 40.0, 1.0, tok_s, ttft_p50_s=ttft, ttft_p95_s=2 * ttft,
                   itl_p50_s=itl)


def test_ratio_table_pairs_each_stream_count():
    rows = [("attnserve", _s(1, 30.0, 0.2, 0.03)), ("llama-server", _s(1, 120.0, 0.07, 0.009)),
            ("llama-server", _s(4, 140.0, 0.16, 0.027)), ("attnserve", _s(4, 70.0, 0.5, 0.05)),
            ("llama-cpp-python", _s(16, 40.0, 6.0, 0.02))]
    lines = format_ratios(rows, "attnserve", "llama-server").splitlines()
    assert len(lines) == 4  # head, rule, streams 1 and 4 (16 has no pair)
    one, four = lines[2].split(), lines[3].split()
    assert one[:4] == ["1", "30.0", "120.0", "0.25"] and four[:4] == ["4", "70.0", "140.0", "0.50"]
    assert "200/400" in lines[2] and "70/140" in lines[2] and "30 | 9" in lines[2]


def test_build_is_native_and_names_no_registry_host():
    script = (ROOT / "benchmarks" / "build_llama_server.sh").read_text()
    assert "-DGGML_NATIVE=ON" in script and "GGML_AVX512=ON" not in script
    assert "pip download" in script and "http" not in script
