"""Both engines give byte-identical outputs for a fixed 50 + 50 request workload as recorded before the
engines' redesign (tests/engine_golden.py): the scheduler, slot table, runners and output processing may
change shape, not results."""

from __future__ import annotations

import json

import pytest
from engine_golden import GOLDEN, run_all

RECORDED = json.loads(GOLDEN.read_text())
# log-probabilities are recorded to 4 decimals: another CPU's float sums may round the last one the other way
LOGPROB_TOL = 1.5e-4


def same(got, want) -> bool:
    """Exactly equal, but for floats (log-probabilities), which may differ by LOGPROB_TOL."""
    if isinstance(want, float) or isinstance(got, float):
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (got, want))
        return numbers and abs(got - want) <= LOGPROB_TOL
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same, got, want))
    return got == want


@pytest.fixture(scope="module")
def now() -> dict:
    return run_all()


def test_generation_outputs_unchanged(now):
    got, want = now["generation"], RECORDED["generation"]
    assert len(got) == len(want) == 50
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert same(g, w), (f"generation request {i}", g, w)


def test_translation_outputs_unchanged(now):
    got, want = now["translation"], RECORDED["translation"]
    assert len(got) == len(want) == 50
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert same(g, w), (f"translation request {i}", g, w)


def test_the_comparison_is_exact_but_for_the_last_logprob_decimal():
    rec = RECORDED["generation"][17]
    assert same(rec, json.loads(json.dumps(rec)))
    changed = json.loads(json.dumps(rec))
    changed[0]["ids"][0] += 1
    assert not same(changed, rec)
    changed = json.loads(json.dumps(rec))
    changed[0]["text"] = changed[0]["text"] + "x"
    assert not same(changed, rec)
    changed = json.loads(json.dumps(rec))
    changed[0]["prompt_logprobs"][1][1] += 1e-4  # one in the last recorded decimal: kept
    assert same(changed, rec)
    changed[0]["prompt_logprobs"][1][1] += 1e-3
    assert not same(changed, rec)


def test_workload_exercises_what_it_names():
    gen = RECORDED["generation"]
    finishes = {c["finish"] for r in gen for c in r}
    assert {"stop", "length"} <= finishes
    assert any(len(r) == 3 for r in gen)  # n > 1
    assert any(c.get("prompt_logprobs") for r in gen for c in r)
    assert any(c["logprobs"] for r in gen for c in r)
    assert len({json.dumps(r["translations"]) for r in RECORDED["translation"]}) == 50
