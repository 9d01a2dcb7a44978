"""Through Ray Serve (one shared instance): both models over HTTP and through the official `openai`
client, streaming, the @serve.batch mode, and Prometheus counters that move on GET /metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from api_util import metric

from service.config import GENERATOR_ID, TRANSLATOR_ID

pytestmark = pytest.mark.ray


def test_native_endpoints(serve_url):
    with httpx.Client(base_url=serve_url, timeout=60) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert sorted(c.get("/readyz").json()["models"]) == sorted([GENERATOR_ID, TRANSLATOR_ID])
        r = c.post("/v1/generate", json={"prompt": "hello world", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == len(out["token_ids"]) <= 8
        r = c.post("/v1/translate", json={"text": ["hello world", "你好世界"], "beam_size": 2, "max_length": 8})
        assert r.status_code == 200, r.text
        t = r.json()
        assert len(t["translations"]) == 2 and t["source_langs"] == ["en", "zh"] and t["target_langs"] == ["zh", "en"]
        r = c.post("/v1/generate", json={"prompt": "x", "temperature": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        with c.stream("POST", "/v1/generate", json={"prompt": "hi", "max_tokens": 6, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and '"usage"' in lines[-2]


def test_openai_client(serve_url):
    import openai

    client = openai.OpenAI(base_url=serve_url + "/v1", api_key="unused", max_retries=0)
    assert GENERATOR_ID in [m.id for m in client.models.list().data]
    comp = client.completions.create(model=GENERATOR_ID, prompt="the cat", max_tokens=5, temperature=0)
    assert comp.choices[0].finish_reason in ("length", "stop") and comp.usage.completion_tokens <= 5
    chat = client.chat.completions.create(model=GENERATOR_ID, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, temperature=0, seed=1)
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=GENERATOR_ID, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, temperature=0, seed=1, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=GENERATOR_ID, prompt="x", max_tokens=5, top_p=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=5)


def test_serve_batch_mode(serve_url):
    async def main():
        async with httpx.AsyncClient(base_url=serve_url + "/batched", timeout=60) as c:
            rs = await asyncio.gather(*(c.post("/v1/generate", json={"prompt": f"hello {i}", "max_tokens": 4 + i,
                                                                     "temperature": 0, "ignore_eos": True})
                                        for i in range(3)))
            return [r.json() for r in rs]
    outs = asyncio.run(main())
    assert [o["usage"]["completion_tokens"] for o in outs] == [4, 5, 6]


def _our_lines(c: httpx.Client) -> str:
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return "\n".join(ln for ln in r.text.splitlines() if ln.startswith("attnserve_") and 'route="/metrics"' not in ln)


def _settled(c: httpx.Client, timeout_s: float = 60.0) -> str:
    """GET /metrics once two reads a few Ray report intervals (2 s) apart agree: earlier requests are in."""
    deadline = time.monotonic() + timeout_s
    last = _our_lines(c)
    while time.monotonic() < deadline:
        time.sleep(5)
        now = _our_lines(c)
        if now == last:
            return now
        last = now
    raise AssertionError("GET /metrics kept changing with no traffic")


def test_metrics_on_http_port(serve_url):
    """Replicas record into ray.serve.metrics; GET /metrics combines Ray's export (it lags ~2 s)."""
    with httpx.Client(base_url=serve_url, timeout=60) as c:
        before = _settled(c)
        c.post("/v1/generate", json={"prompt": "hello", "max_tokens": 7, "ignore_eos": True})
        r = c.post("/v1/translate", json={"text": "hello", "beam_size": 1, "max_length": 5})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while (metric(_our_lines(c), "attnserve_request_success_total", model=TRANSLATOR_ID)
               == metric(before, "attnserve_request_success_total", model=TRANSLATOR_ID)
               and time.monotonic() < deadline):
            time.sleep(1)
        after = _settled(c)

    def moved(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("attnserve_generation_tokens_total", model=GENERATOR_ID) == 7
    assert moved("attnserve_request_success_total", model=TRANSLATOR_ID, finished_reason="stop") == 1
    assert moved("attnserve_http_requests_total", model=GENERATOR_ID, route="/v1/generate", status="200") == 1
    assert moved("attnserve_time_to_first_token_seconds_count", model=GENERATOR_ID) == 1
    # one series per label set: the replica-identifying labels Ray adds are combined away
    assert "WorkerId" not in after and "replica=" not in after
