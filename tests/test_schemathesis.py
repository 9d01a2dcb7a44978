"""Schema-driven fuzz: Schemathesis generates requests from the app's own /openapi.json, valid ones
(positive) and ones that break the schema (negative), for every operation, and sends them over real
HTTP to the app with its engines on tiny random models. No answer may be a 5xx, every error must be
the JSON error shape, and no request may hang (each has a 10 s client timeout).

Hypothesis runs derandomized (a fixed sequence of cases), so a failure reproduces on every run."""

from __future__ import annotations

import collections

import pytest
import schemathesis
import torch
from api_util import backends
from hypothesis import HealthCheck, Phase, given, settings
from live_app import serve_in_thread
from schemathesis import GenerationMode

from service.api.app import create_app
from service.config import ApiLimits

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(600)
LIMITS = ApiLimits(max_body_bytes=200_000, max_prompt_chars=400, max_texts=4, max_text_chars=60,
                   max_beam_size=4, max_translate_length=24)
CASES_PER_OPERATION = 60  # per generation mode: ~480 requests in all
CLIENT_TIMEOUT_S = 10.0


def _fuzz(op, mode: GenerationMode, url: str, seen: collections.Counter, failures: list) -> None:
    @settings(max_examples=CASES_PER_OPERATION, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def one(case):
        response = case.call(base_url=url, timeout=CLIENT_TIMEOUT_S)  # a hang raises ReadTimeout
        seen[(op.label, mode.value, response.status_code)] += 1
        if response.status_code >= 500:
            failures.append((op.label, mode.value, response.status_code, case.body, response.text[:300]))
        elif response.status_code >= 400:
            err = response.json().get("error", {})
            if not err.get("message"):
                failures.append((op.label, mode.value, response.status_code, case.body, response.text[:300]))

    one()


def test_schema_fuzz_no_5xx_no_hang():
    app = create_app(backends({"max_slots": 4, "max_seq_len": 96}), LIMITS, manage_engines=True)
    schema = schemathesis.openapi.from_dict(app.openapi())
    seen: collections.Counter = collections.Counter()
    failures: list = []
    with serve_in_thread(app) as url:
        ops = [result.ok() for result in schema.get_all_operations()]
        assert {"POST /v1/generate", "POST /v1/translate", "POST /v1/completions",
                "POST /v1/chat/completions", "GET /v1/models"} <= {op.label for op in ops}
        for op in ops:
            modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.body else [])
            for mode in modes:
                _fuzz(op, mode, url, seen, failures)
        import httpx

        alive = httpx.post(url + "/v1/generate", json={"prompt": "after the fuzz", "max_tokens": 2}, timeout=30)
    total = sum(seen.values())
    by_status = collections.Counter()
    for (_, _, status), n in seen.items():
        by_status[status] += n
    print("\n" + "\n".join(f"  {k}: {v}" for k, v in sorted(seen.items())))
    print(f"\nschema fuzz: {total} requests over {len(ops)} operations; statuses {dict(sorted(by_status.items()))}")
    assert not failures, failures[:5]
    assert total >= 400, seen
    assert alive.status_code == 200
    # both valid and invalid requests were exercised
    assert by_status[200] > 0 and sum(n for s, n in by_status.items() if 400 <= s < 500) > 0
