"""Both engines give byte-identical outputs for a fixed 50 + 50 request workload as recorded before the
engines' redesign (tests/engine_golden.py): the scheduler, slot table, runners and output processing may
change shape, not results."""

from __future__ import annotations

import json

import pytest
from engine_golden import GOLDEN, run_all

RECORDED = json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def now() -> dict:
    return run_all()


def test_generation_outputs_unchanged(now):
    got, want = now["generation"], RECORDED["generation"]
    assert len(got) == len(want) == 50
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"generation request {i}"


def test_translation_outputs_unchanged(now):
    got, want = now["translation"], RECORDED["translation"]
    assert len(got) == len(want) == 50
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"translation request {i}"


def test_workload_exercises_what_it_names():
    gen = RECORDED["generation"]
    finishes = {c["finish"] for r in gen for c in r}
    assert {"stop", "length"} <= finishes
    assert any(len(r) == 3 for r in gen)  # n > 1
    assert any(c.get("prompt_logprobs") for r in gen for c in r)
    assert any(c["logprobs"] for r in gen for c in r)
    assert len({json.dumps(r["translations"]) for r in RECORDED["translation"]}) == 50
