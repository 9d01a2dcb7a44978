"""A short headless Locust run (4 users, ~10 s) through `attnserve loadtest` against the live service
(the real FastAPI app and engines on tiny random models, in a uvicorn subprocess, no Ray): the summary is
non-empty, nothing failed, and TTFT/ITL are present for a streaming scenario. Locust runs in its own
process; this module imports neither Locust nor Ray."""

import csv
import json
import subprocess
import sys

import pytest
from live_service import ROOT, live_service

pytestmark = pytest.mark.timeout(240)


def _loadtest(url: str, results: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "service.cli", "loadtest", "--host", url, "--users", "4", "--duration", "10s",
           "--max-tokens", "32", "--results-dir", results, *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)


# The tiny test translator reads 62 characters at most (one token per character), so short sentences.
SHORT = [("en", "The meeting is on Tuesday."), ("en", "Prices rose in May."), ("zh", "会议在星期二举行。"),
         ("zh", "五月物价上涨。")] * 4


def test_short_headless_runs_report_ttft_and_no_failures(tmp_path):
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text("".join(json.dumps({"text": t, "source_lang": s, "target_lang": "zh" if s == "en" else "en"})
                              + "\n" for s, t in SHORT))
    with live_service(log_path=tmp_path / "service.log") as url:
        chat = _loadtest(url, str(tmp_path / "chat"), "--scenario", "chat-stream")
        translate = _loadtest(url, str(tmp_path / "tr"), "--scenario", "translate-batch", "--beam-size", "4",
                              "--duration", "5s", "--translate-file", str(inputs))
    assert chat.returncode == 0, chat.stderr + chat.stdout
    table = chat.stdout.splitlines()
    assert table[0].split()[:3] == ["target", "users", "req/s"] and len(table) == 3
    (run_dir,) = (tmp_path / "chat").iterdir()
    for name in ("locust_stats.csv", "report.html", "requests.jsonl", "summary.csv"):
        assert (run_dir / name).stat().st_size > 0, name
    (row,) = csv.DictReader(open(run_dir / "summary.csv"))
    assert int(row["requests"]) >= 4 and int(row["failures"]) == 0 and float(row["error_rate"]) == 0.0
    records = [json.loads(line) for line in open(run_dir / "requests.jsonl")]
    assert not any(r["cut"] and r["ok"] for r in records)
    assert float(row["ttft_p50_s"]) > 0 and float(row["ttft_p99_s"]) >= float(row["ttft_p50_s"])
    assert float(row["itl_p50_s"]) > 0 and float(row["output_tok_per_s"]) > 0
    # Locust's own stats carry the LLM metrics as METRIC events, as in fw-ai's llm_bench.
    names = {r["Name"] for r in csv.DictReader(open(run_dir / "locust_stats.csv"))}
    assert {"chat-stream", "time_to_first_token", "inter_token_latency", "tokens_per_s"} <= names

    assert translate.returncode == 0, translate.stderr + translate.stdout
    (run_dir,) = (tmp_path / "tr").iterdir()
    (row,) = csv.DictReader(open(run_dir / "summary.csv"))
    assert int(row["requests"]) >= 1 and int(row["failures"]) == 0 and row["ttft_p50_s"] == ""
    # Closed loop: the run's end finds users mid-request; those requests are kept, marked cut, not failed.
    # (Translating a batch takes long next to the few ms Locust takes to stop its users; 32-token chat
    # streams often all finish within them.)
    records = [json.loads(line) for line in open(run_dir / "requests.jsonl")]
    assert any(r["cut"] and not r["ok"] for r in records)
