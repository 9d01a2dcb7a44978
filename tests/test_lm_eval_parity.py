"""lm-eval (PyPI) `local-completions` against the served app equals lm-eval scoring the same SmolLM2 weights
in-process (full forwards, no engine) on the shipped multiple-choice and generate-until tasks: every item
scored the same, so the accuracies agree well within 1 item in 500 (benchmarks/lm_eval_parity.py), with
one prompt a request and with batches of prompts.

Slow: the real SmolLM2 (converted checkpoint), the first items of each task only."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import lm_eval_parity

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("batch", [1, 4], ids=["one prompt a request", "batches of 4"])
def test_served_scores_equal_in_process_scores(monkeypatch, capsys, batch):
    monkeypatch.chdir(REPO)  # the task files name their data relative to the repository root
    code = lm_eval_parity.main(["--limit", "12", "--num-concurrent", "8", "--batch-size", str(batch)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "attnserve_mc: 0 of 12 items scored differently" in out
    assert "attnserve_gen: 0 of 12 items scored differently; 0 generated answers differ" in out
