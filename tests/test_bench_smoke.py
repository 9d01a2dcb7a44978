"""Smoke runs of the bench and profile tools in benchmarks/ with --tiny (random tiny models, a few
requests, one torch thread: the cores are shared), each in its own process as a user runs it. Each test
checks that the tool printed measured numbers in its table's shape, not only that it exited 0.

compare_llamacpp runs its whole sweep/report path with a stand-in for llama-server: a script that
serves the tiny attnserve app (plus llama-server's /health) on the port it is given, so no llama.cpp
build is needed. The ones that start Ray (bench_overhead) are in tests/test_reliability_smoke.py.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from live_service import live_service

from loadtests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parent.parent
NUM = r"(\d+(?:\.\d+)?)"
# held-out pairs where bench_translate, profile_translate and check_compiled_translator read them
TEST_TSV = ("The meeting is on Tuesday.\t会议在星期二举行。\nPrices rose in May.\t五月物价上涨。\n"
            "The cat sat on the mat.\t猫坐在垫子上。\nHello world.\t你好世界。\n")


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    h = tmp_path_factory.mktemp("bench-home")
    (h / "data" / "translate").mkdir(parents=True)
    (h / "data" / "translate" / "test.tsv").write_text(TEST_TSV, encoding="utf-8")
    return h


def tool(home: Path, module: str, *args: str, timeout: float = 600) -> str:
    """Run `python -m benchmarks.<module> args`; its stdout (fails with the output on a non-zero exit)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), ATTNSERVE_HOME=str(home), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{module} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def rows(out: str, first: str) -> list[list[str]]:
    """Cells of the markdown table rows whose first cell matches `first` (a regex)."""
    found = []
    for line in out.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if re.fullmatch(first, cells[0]):
                found.append(cells)
    return found


def floats(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", cell)]


def test_bench_cache(home):
    out = tool(home, "bench_cache", "--tiny", "--threads", "1")
    assert "TINY random Llama" in out
    (row,) = rows(out, "float32")
    assert row[1] == "1"
    cached, recompute, speedup = float(row[2]), float(row[3]), float(row[4].rstrip("x"))
    assert cached > 0 and recompute > 0 and speedup == pytest.approx(cached / recompute, rel=0.05, abs=0.06)


def test_bench_decode_attention(home):
    out = tool(home, "bench_decode_attention", "--tiny", "--threads", "1")
    table = rows(out, r"engine \(decode_attention\)|k @ q\^T|contiguous K/V first")
    assert len(table) == 3
    for _, ms, gbs in table:
        assert float(ms) >= 0 and float(gbs) >= 0
    assert any(float(ms) > 0 for _, ms, _ in table)


def test_bench_slot_copies(home):
    out = tool(home, "bench_slot_copies", "--tiny", "--threads", "1")
    table = rows(out, r"\d+")
    assert [(r[0], r[1]) for r in table] == [("2", "6"), ("4", "6")]  # copies x mean positions of --tiny
    for r in table:
        ms = floats(r[2]) + floats(r[3])
        assert len(ms) == 4 and all(x > 0 for x in ms)


def test_bench_smollm2_ours_and_transformers(home):
    out = tool(home, "bench_smollm2", "--tiny", "--threads", "1")
    found = re.findall(rf"^(attnserve|transformers)\s+(float32|bfloat16)\s+{NUM}\s+{NUM}$", out, re.M)
    assert sorted((e, d) for e, d, _, _ in found) == [("attnserve", "bfloat16"), ("attnserve", "float32"),
                                                     ("transformers", "bfloat16"), ("transformers", "float32")]
    assert all(float(p) > 0 and float(d) > 0 for _, _, p, d in found)


def test_bench_engine_with_peers(home):
    out = tool(home, "bench_engine", "--tiny", "--threads", "1", "--clients", "2", "--requests", "4",
               "--prompt", "4", "8", "--output", "4", "8", "--modes", "continuous",
               "--peers", "hf:float32", "ct2:float32")
    table = rows(out, r"attnserve continuous|transformers generate \(static\)|CTranslate2 generate_batch \(static\)")
    assert len(table) == 3
    for r in table:
        assert r[1] == "float32"
        tok_s, req_s = float(r[2]), float(r[3])
        ttft, itl = floats(r[4]), floats(r[5])
        assert tok_s > 0 and req_s > 0 and len(ttft) == 2 and len(itl) == 2 and ttft[1] >= ttft[0] >= 0
        assert float(r[6]) > 0  # peak RSS (MB)
    assert "How measured" in out


def test_bench_translate_with_a_peer(home):
    # beam 2 (greedy runs in the profile and compile checks below); one peer; our cache in two dtypes
    out = tool(home, "bench_translate", "--tiny", "--threads", "1", "--clients", "2", "--requests", "4",
               "--beams", "2", "--peers", "ct2:float32", "--kv-dtype", "auto", "bfloat16")
    table = rows(out, r"attnserve continuous|CTranslate2 translate_batch \(static\)")
    assert sorted((r[0].split()[0], r[1], r[2]) for r in table) == [
        ("CTranslate2", "2", "float32"), ("attnserve", "2", "float32"), ("attnserve", "2", "float32, kv bfloat16")]
    for r in table:
        assert float(r[3]) > 0 and float(r[4]) > 0 and len(floats(r[5])) == 2  # sentences/s, tok/s, latency
    by = {(r[0].split()[0], r[2]): float(r[3]) for r in table}
    for kv, dtype in (("auto", "float32"), ("bfloat16", "float32, kv bfloat16")):
        (ratio,) = re.findall(rf"beam 2: ours:continuous:float32:eager:{kv} / ct2:float32 = {NUM}x", out)
        assert float(ratio) == pytest.approx(by["attnserve", dtype] / by["CTranslate2", "float32"], rel=0.05, abs=0.02)


def test_bench_translate_ct2_inter_layout(home):
    # --threads 2, --clients 2: two batches of one sentence in flight, one thread each
    out = tool(home, "bench_translate", "--tiny", "--threads", "2", "--clients", "2", "--requests", "4",
               "--beams", "1", "--modes", "--peers", "ct2:float32", "ct2:float32:inter")
    table = rows(out, r"CTranslate2 translate_batch \(static.*")
    assert sorted(r[0] for r in table) == ["CTranslate2 translate_batch (static)",
                                           "CTranslate2 translate_batch (static, 2 batches of 1 in flight)"]
    for r in table:
        assert r[1] == "1" and float(r[3]) > 0 and float(r[4]) > 0 and len(floats(r[5])) == 2


def test_bench_translate_replicas(home):
    # the served layout: two engine processes of one thread and one client each, timed together
    out = tool(home, "bench_translate", "--tiny", "--threads", "2", "--clients", "2", "--requests", "6",
               "--beams", "1", "--peers", "--replicas", "1", "2")
    table = rows(out, r"attnserve continuous.*")
    assert sorted(r[0] for r in table) == ["attnserve continuous", "attnserve continuous, 2 processes"]
    for r in table:
        assert r[1] == "1" and float(r[3]) > 0 and float(r[4]) > 0 and len(floats(r[5])) == 2
    with pytest.raises(AssertionError, match="must divide --threads and --clients"):
        tool(home, "bench_translate", "--tiny", "--threads", "2", "--clients", "3", "--peers", "--replicas", "2")


@pytest.mark.parametrize("spec", ["ct2", "ct2:float32:intr", "hf:float32:inter", "ort:float32", "ct2:float32:inter:x",
                                  "ct2::inter"])
def test_bench_translate_rejects_a_mistyped_peer(spec):
    from benchmarks.bench_translate import parse_peer

    with pytest.raises(SystemExit, match="unknown peer"):
        parse_peer(spec)
    assert parse_peer("ct2:int8:inter") == ("ct2", "int8", "inter")
    assert parse_peer("hf:bfloat16") == ("hf", "bfloat16", "intra")


def _profile_table(out: str, parts: list[str]) -> None:
    table = {r[0]: r[1:] for r in rows(out, ".+") if len(r) == 5}
    for part in parts:
        total_s, pct, calls, ms = table[part]
        assert float(total_s) >= 0 and float(pct) >= 0 and int(calls) >= 0 and float(ms) >= 0, part
    assert sum(int(table[p][2]) for p in parts) > 0
    assert "top operators by self CPU" in out and "Self CPU time total" in out


def test_profile_engine(home):
    out = tool(home, "profile_engine", "--tiny", "--dtype", "float32", "--threads", "1", "--clients", "2",
               "--requests", "4", "--prompt", "4", "8", "--output", "4", "8", "--profile-from", "2",
               "--profile-steps", "3", "--top", "5")
    m = re.search(rf"4 requests, (\d+) output tokens in {NUM} s = {NUM} tok/s", out)
    assert m and 16 <= int(m[1]) <= 32 and float(m[3]) > 0  # 4 requests of 4-8 tokens
    assert re.search(rf"(\d+) steps, mean batch {NUM}, {NUM} ms/step", out)
    _profile_table(out, ["prefill forward", "decode forward", "sampling", "slot copies"])


def test_profile_translate(home):
    out = tool(home, "profile_translate", "--tiny", "--threads", "1", "--clients", "2", "--requests", "4",
               "--profile-from", "2", "--profile-steps", "3", "--top", "5")
    m = re.search(rf"4 sentences, (\d+) output tokens in {NUM} s = {NUM} tok/s", out)
    assert m and int(m[1]) > 0
    assert re.search(rf"(\d+) steps, mean rows {NUM}, {NUM} ms/step", out)
    _profile_table(out, ["encoder", "decoder forward", "advance", "slot copies"])


def test_check_compiled_translator(home):
    out = tool(home, "check_compiled_translator", "--tiny", "--threads", "1", "--sentences", "4", "--clients", "3",
               "--dtype", "float32")
    m = re.search(r"identical outputs eager vs compiled: (\d+) / (\d+)", out)
    assert m and int(m[2]) == 4 and 0 <= int(m[1]) <= 4
    table = rows(out, "eager|compiled")
    assert [r[0] for r in table] == ["eager", "compiled"]
    for r in table:
        assert all(0 <= float(x) <= 100 for x in r[1:3]) and float(r[3]) > 0  # BLEU zh->en, en->zh; wall


# --- compare_llamacpp ------------------------------------------------------------------------------

FAKE_LLAMA_SERVER = """#!{python}
# stands in for llama.cpp's llama-server: the tiny attnserve app (with a /health) on the --port it is given
import argparse, json, sys
sys.path[:0] = [{root!r}, {tests!r}]
with open({argv_log!r}, "w") as f:
    json.dump(sys.argv[1:], f)
p = argparse.ArgumentParser()
p.add_argument("--host")
p.add_argument("--port", type=int)
args, _ = p.parse_known_args()
import torch, uvicorn
from api_util import backends
from service.api.app import create_app
torch.set_num_threads(1)
app = create_app(backends(), manage_engines=True)
if not any(getattr(r, "path", None) == "/health" for r in app.routes):  # llama-server's health check
    app.get("/health")(lambda: {{"status": "ok"}})
uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
"""


def compare(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), ATTNSERVE_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "loadtests.compare_llamacpp", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_compare_llamacpp_refuses_bad_arguments_before_starting_anything(tmp_path, capsys):
    from loadtests import compare_llamacpp

    results = tmp_path / "results"
    base = ["--results-dir", str(results), "--llama-server", str(tmp_path / "none")]
    for args, says in ((["--users", "four"], "bad --users"),
                       (["--attnserve", "http://192.168.1.20:8000"], "refusing"),
                       (["--duration", "soon"], "bad duration"),
                       ([], "missing (or not a file); build it")):
        assert compare_llamacpp.main([*base, *args]) == 2
        assert says in capsys.readouterr().err, args
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert compare_llamacpp.main(["--results-dir", str(results), "--llama-server", str(fake), "--py-users", "4",
                                  "--llama-cpp-python", str(tmp_path / "none")]) == 2
    assert "setup_llama_cpp_python.sh" in capsys.readouterr().err
    free = f"http://127.0.0.1:{free_port()}"  # no attnserve there: refused before llama-server starts
    assert compare_llamacpp.main(["--results-dir", str(results), "--llama-server", str(fake), "--py-users", "",
                                  "--attnserve", free]) == 2
    assert "nothing answers" in capsys.readouterr().err
    assert not results.exists()


def test_compare_llamacpp_sweeps_both_targets_into_one_table_csv_and_plots(tmp_path):
    home = tmp_path / "home"
    gguf = home / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # what `weights fetch smollm2` leaves
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, root=str(ROOT), tests=str(ROOT / "tests"),
                                             argv_log=str(tmp_path / "argv.json")))
    fake.chmod(0o755)
    results = tmp_path / "results"
    with live_service(log_path=tmp_path / "service.log") as url:
        r = compare(home, "--attnserve", url, "--users", "1", "--py-users", "", "--duration", "2s",
                    "--max-tokens", "8", "--parallel", "4", "--llama-server", str(fake),
                    "--results-dir", str(results))
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    host, runs, ratios = r.stdout.strip().split("\n\n")  # each table: header, rule, one line per row
    assert host.startswith("host: ") and " f" in host  # CPU model, family and flags beside the figures
    table = [line.split() for line in runs.splitlines()[2:]]
    assert [(t[0], t[1]) for t in table] == [("attnserve", "1"), ("llama-server", "1")]
    assert all(float(t[2]) > 0 and float(t[3]) > 0 for t in table)  # req/s, output tok/s
    (streams, ours, peer, ratio, *_), = [line.split() for line in ratios.splitlines()[2:]]
    assert (streams, ours, peer) == ("1", table[0][3], table[1][3])
    assert float(ratio) == pytest.approx(float(ours) / float(peer), abs=0.01 + 0.01 * float(ratio))
    (out,) = results.iterdir()
    sweep = list(csv.DictReader(open(out / "sweep.csv")))
    assert [(s["target"], int(s["users"])) for s in sweep] == [("attnserve", 1), ("llama-server", 1)]
    assert all(int(s["requests"]) >= 1 and int(s["failures"]) == 0 for s in sweep)
    assert any(p.suffix == ".png" and p.stat().st_size > 0 for p in out.iterdir())
    import json

    argv = json.loads((tmp_path / "argv.json").read_text())  # how compare started llama-server
    assert argv[:2] == ["-m", str(gguf)] and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("-np") + 1] == "4" and argv[argv.index("-c") + 1] == str(256 * 4)
    assert "--cont-batching" in argv
