"""The HTTP API without Ray: every endpoint, streaming, model selection, 503/429 mapping, metrics."""

from __future__ import annotations

import asyncio

import pytest
import torch
from api_util import TOK, backends, metric, run, sse_events, translator

from service.config import GENERATOR_ID, TRANSLATOR_ID
from service.engine.types import GenerateRequest, SamplingParams
from service.startup import RETRY_AFTER_S

torch.set_num_threads(1)
GREEDY = {"temperature": 0.0, "max_tokens": 12}


def test_health_ready_models():
    async def main(c):
        assert (await c.get("/healthz")).json() == {"status": "ok"}
        r = await c.get("/readyz")
        assert r.status_code == 200 and GENERATOR_ID in r.json()["models"]
        ids = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
        assert ids[0] == GENERATOR_ID
        # the openai SDK's models.retrieve: each listed model, and a 404 naming the field for others
        assert (await c.get(f"/v1/models/{GENERATOR_ID}")).json() == (await c.get("/v1/models")).json()["data"][0]
        r = await c.get("/v1/models/nope")
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert (await c.get("/docs")).status_code == 200
        assert "/v1/chat/completions" in (await c.get("/openapi.json")).json()["paths"]
    run(main)


def test_readyz_503_without_generator():
    from service.api.backends import Backends

    async def main(c):
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["unavailable"] == {GENERATOR_ID: "failed to load"}
        assert r.json()["phase"].startswith("loaded, but not serving")  # start-up is over: not "ready"
        r = await c.post("/v1/generate", json={"prompt": "hi"})
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == str(RETRY_AFTER_S)  # another replica may have loaded it
    run(main, Backends(unavailable={GENERATOR_ID: "failed to load"}))


def test_readyz_200_for_a_translator_only_config():
    from service.api.backends import DISABLED, Backends

    async def main(c):
        r = await c.get("/readyz")
        assert r.status_code == 200 and r.json()["unavailable"] == {GENERATOR_ID: DISABLED}, r.text
        r = await c.post("/v1/generate", json={"prompt": "hi"})
        assert r.status_code == 503 and "disabled" in r.json()["error"]["message"]
        assert "retry-after" not in r.headers  # no retry serves it
    run(main, Backends(translator=translator(), unavailable={GENERATOR_ID: DISABLED}))

    async def nothing(c):  # the translator failed too: nothing serves
        assert (await c.get("/readyz")).status_code == 503
    run(nothing, Backends(unavailable={GENERATOR_ID: DISABLED, TRANSLATOR_ID: "failed to load"}))


USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens differ on a repeat


def test_generate_prompt_and_stream_agree():
    async def main(c):
        body = {"prompt": "hello world", **GREEDY}
        r = await c.post("/v1/generate", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["model"] == GENERATOR_ID and out["finish_reason"] in ("length", "stop")
        assert out["usage"]["prompt_tokens"] == len(TOK.encode("hello world"))
        assert out["usage"]["completion_tokens"] == len(out["token_ids"]) <= 12
        assert out["text"] == TOK.decode(out["token_ids"])
        r = await c.post("/v1/generate", json={**body, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert "".join(e["text"] for e in events[:-1]) == out["text"]
        assert events[-2]["finish_reason"] == out["finish_reason"]
        first, again = out["usage"], events[-2]["usage"]
        assert {k: again[k] for k in USAGE_COUNTS} == {k: first[k] for k in USAGE_COUNTS}
        # the same prompt again: all but its last token come from the cache (the freed slot still holds them)
        assert again["prompt_tokens_details"]["cached_tokens"] == again["prompt_tokens"] - 1
        # the unversioned names TGI and vLLM's first server used: the same endpoints
        alias = await c.post("/generate", json=body)
        assert alias.status_code == 200 and alias.json()["text"] == out["text"]
        translated = await c.post("/translate", json={"text": "hello", "beam_size": 1})
        assert translated.status_code == 200 and len(translated.json()["translations"]) == 1
        assert "/generate" not in (await c.get("/openapi.json")).json()["paths"]
    run(main)


def test_generate_messages_uses_chat_template():
    async def main(c):
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        out = (await c.post("/v1/generate", json={"messages": msgs, **GREEDY})).json()
        rendered = "system: be brief | user: hi | assistant: "
        assert out["usage"]["prompt_tokens"] == len(TOK.encode(rendered))
    run(main)


def test_completions_stream_include_usage():
    async def main(c):
        body = {"model": GENERATOR_ID, "prompt": "abc", **GREEDY}
        full = (await c.post("/v1/completions", json=body)).json()
        assert full["object"] == "text_completion" and full["choices"][0]["index"] == 0
        r = await c.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        usage_chunk = events[-2]
        assert usage_chunk["choices"] == []
        assert {k: usage_chunk["usage"][k] for k in USAGE_COUNTS} == {k: full["usage"][k] for k in USAGE_COUNTS}
        assert all(e["usage"] is None for e in events[:-2])
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == full["choices"][0]["text"]
        assert events[-3]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
        r = await c.post("/v1/completions", json={**body, "stream": True})
        assert all("usage" not in e for e in sse_events(r.text)[:-1])
    run(main)


def test_chat_completions_and_stream():
    async def main(c):
        body = {"messages": [{"role": "user", "content": "hi"}], **GREEDY}
        full = (await c.post("/v1/chat/completions", json=body)).json()
        assert full["object"] == "chat.completion"
        msg = full["choices"][0]["message"]
        assert msg["role"] == "assistant"
        events = sse_events((await c.post("/v1/chat/completions", json={**body, "stream": True})).text)[:-1]
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        assert text == msg["content"]
        assert events[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
        # max_completion_tokens wins over max_tokens
        r = await c.post("/v1/chat/completions", json={**body, "max_completion_tokens": 3, "max_tokens": 50})
        assert r.json()["usage"]["completion_tokens"] <= 3
    run(main)


def test_every_chunk_of_a_stream_carries_one_created(monkeypatch):
    import itertools
    import types

    from service.api import openai_routes

    clock = itertools.count(1_800_000_000)  # a clock that moves on every reading
    monkeypatch.setattr(openai_routes, "time", types.SimpleNamespace(time=lambda: next(clock)))

    async def main(c):
        body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2,
                "stream_options": {"include_usage": True}, **GREEDY}
        events = sse_events((await c.post("/v1/chat/completions", json=body)).text)[:-1]
        assert len(events) > 3 and len({e["created"] for e in events}) == 1
    run(main)


def test_vllm_sampling_extensions_on_the_openai_routes():
    """top_k, min_p, repetition_penalty and ignore_eos, as vLLM takes them: top_k 1 or min_p 1 sample the
    greedy token whatever the temperature; top_k -1 is off."""
    async def main(c):
        msgs = [{"role": "user", "content": "hi"}]
        greedy = (await c.post("/v1/chat/completions", json={"messages": msgs, **GREEDY})).json()
        want = greedy["choices"][0]["message"]["content"]
        for extra in ({"top_k": 1}, {"min_p": 1.0}, {"top_k": 1, "min_p": 0.5, "repetition_penalty": 1.0}):
            r = await c.post("/v1/chat/completions", json={"messages": msgs, **GREEDY, "temperature": 1.5,
                                                           "seed": 7, **extra})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want, extra
        r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 4, "top_k": -1, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    run(main)


def test_seed_reproducible_and_stop_string():
    async def main(c):
        body = {"prompt": "xyz", "temperature": 1.0, "seed": 7, "max_tokens": 20, "ignore_eos": True}
        a = (await c.post("/v1/generate", json=body)).json()
        b = (await c.post("/v1/generate", json=body)).json()
        assert a["text"] == b["text"] and len(a["token_ids"]) == 20
        stop = a["text"][5:7]
        s = (await c.post("/v1/generate", json={**body, "stop": [stop]})).json()
        assert s["finish_reason"] == "stop" and stop not in s["text"] and a["text"].startswith(s["text"])
    run(main)


def test_translator_missing_is_503_with_reason():
    async def main(c):
        r = await c.post("/v1/translate", json={"text": "hello"})
        assert r.status_code == 503
        assert "no translator checkpoint" in r.json()["error"]["message"]
        assert TRANSLATOR_ID not in [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
    run(main, backends(with_translator=False))


def test_an_idle_engine_takes_a_translation_larger_than_its_slots_even_without_a_queue():
    """5 sentences, 4 slots, max_waiting 0: run in turns, not a 429 that every retry would get too."""
    b = backends(with_translator=False)
    b.translator = translator(max_slots=4, max_waiting=0)
    b.unavailable.clear()

    async def main(c):
        text = "Hello there. How are you? Fine thanks. Good day. See you soon."
        r = await c.post("/v1/translate", json={"text": text, "beam_size": 1, "max_length": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 0
    run(main, b)


def test_a_given_source_lang_is_translated_from_not_detected_again():
    """Detected, this sentence is Chinese (7 CJK characters, 3 Latin words) and would pass through as
    already in the target language; the client said it is English."""
    async def main(c):
        text = "I visited 故宫博物院 in 北京."
        r = await c.post("/v1/translate", json={"text": text, "source_lang": "en", "max_length": 4})
        out = r.json()
        assert r.status_code == 200 and out["source_langs"] == ["en"] and out["target_langs"] == ["zh"]
        assert out["usage"]["prompt_tokens"] > 0
        r = await c.post("/v1/translate", json={"text": text, "target_lang": "zh", "max_length": 4})
        assert r.json()["source_langs"] == ["zh"] and r.json()["usage"]["prompt_tokens"] == 0  # detected
    run(main, backends(with_translator=True))


def test_overload_is_429_with_retry_after():
    async def main(c):
        # no queue beyond the slots (max_waiting 0), and requests in all 4 slots: the next one would wait
        engine = c.app.state.backends.generator.engine
        held = [engine.submit(GenerateRequest(prompt_ids=[7] * 4, params=SamplingParams(max_new_tokens=100)))
                for _ in range(4)]
        r = await c.post("/v1/generate", json={"prompt": "hi"})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "stream": True})
        assert r.status_code == 429
        for stream in held:
            await stream.aclose()
    run(main, backends({"max_waiting": 0}, with_translator=False))


def test_a_batch_refused_is_429_and_runs_none_of_it():
    """One slot, held, and no queue: a batch of prompts has no room. The whole request is a 429, and none
    of its prompts is queued, run or counted."""
    async def main(c):
        engine = c.app.state.backends.generator.engine
        held = engine.submit(GenerateRequest(prompt_ids=[7] * 4, params=SamplingParams(max_new_tokens=100)))
        before = (await c.get("/metrics")).text
        r = await c.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 20, "ignore_eos": True})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert engine.stats().waiting + engine.stats().running <= 1  # the held request only
        after = (await c.get("/metrics")).text
        for name, labels in (("attnserve_request_success_total", {"finished_reason": "cancelled"}),
                             ("attnserve_request_success_total", {"finished_reason": "length"}),
                             ("attnserve_generation_tokens_total", {})):
            got = metric(after, name, model=GENERATOR_ID, **labels) - metric(before, name, model=GENERATOR_ID, **labels)
            assert got == 0, (name, labels)
        await held.aclose()
    run(main, backends({"max_waiting": 0, "max_slots": 1}, with_translator=False))


def test_an_idle_engine_takes_a_batch_of_more_prompts_than_its_slots_even_without_a_queue():
    """3 prompts, 1 slot, max_waiting 0: they run in turns, as a translation's sentences do, not a 429 that
    every retry would get too."""
    async def main(c):
        body = {"prompt": ["a", "b", "c"], "max_tokens": 3}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert [ch["index"] for ch in r.json()["choices"]] == [0, 1, 2]
        r = await c.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 200, r.text
        ends = [ch["index"] for ev in sse_events(r.text)[:-1] for ch in ev["choices"] if ch["finish_reason"]]
        assert sorted(ends) == [0, 1, 2]
    run(main, backends({"max_waiting": 0, "max_slots": 1}, with_translator=False))


def test_stopped_engine_is_503():
    async def main(c):
        await c.app.state.backends.generator.stop()
        r = await c.post("/v1/generate", json={"prompt": "hi"})
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == str(RETRY_AFTER_S)  # as the start-up gate's 503s: clients back off
    run(main)


@pytest.mark.parametrize("path, body", [("/v1/generate", {"prompt": "hi"}),
                                        ("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_a_stream_failing_before_its_first_event_has_the_error_status(path, body):
    """A streamed request queued behind a busy slot when the engine stops fails before its first event: the
    status line is still to be sent, so it is the 503 (with Retry-After) a non-streamed request gets, not a
    200 whose one event is the error."""
    async def main(c):
        engine = c.app.state.backends.generator.engine
        held = engine.submit(GenerateRequest(prompt_ids=[7] * 4, params=SamplingParams(max_new_tokens=100)))
        post = asyncio.ensure_future(c.post(path, json={**body, "stream": True, "max_tokens": 8}))
        while (engine.stats().running, engine.stats().waiting) != (1, 1):  # the held one runs, the post waits
            await asyncio.sleep(0.01)
        await c.app.state.backends.generator.stop()
        r = await post
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable" and r.headers["retry-after"] == str(RETRY_AFTER_S)
        await held.aclose()
    run(main, backends({"max_slots": 1}, with_translator=False))


def test_metrics_move_after_requests():
    def value(text: str, name: str) -> float:
        prefix = f'{name}{{model="{GENERATOR_ID}"}} '
        return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))

    async def main(c):
        before = (await c.get("/metrics")).text
        await c.post("/v1/generate", json={"prompt": "hello", "max_tokens": 7, "ignore_eos": True})
        after = (await c.get("/metrics")).text
        # one token per character: a 5-token prompt and 7 generated tokens, so swapped counters fail
        for name, n in (("attnserve_prompt_tokens_total", 5), ("attnserve_generation_tokens_total", 7)):
            assert value(after, name) - value(before, name) == n, name
        for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                     "request_queue_time_seconds", "iteration_batch_size"):
            assert value(after, f"attnserve_{name}_count") > value(before, f"attnserve_{name}_count"), name
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio"):
            assert f'attnserve_{name}{{model="{GENERATOR_ID}"}}' in after
        for name, labels in (("attnserve_request_success_total", {"finished_reason": "length"}),
                             ("attnserve_http_requests_total", {"route": "/v1/generate", "status": "200"})):
            moved = metric(after, name, model=GENERATOR_ID, **labels) - metric(before, name, model=GENERATOR_ID,
                                                                                 **labels)
            assert moved == 1, name
    run(main)


def test_playground_served_when_present(tmp_path):
    (tmp_path / "index.html").write_text("<html>playground</html>")

    async def main(c):
        r = await c.get("/")
        assert r.status_code == 200 and "playground" in r.text
    run(main, backends(with_translator=False), static_dir=tmp_path)


@pytest.mark.parametrize("path", ["/v1/nope", "/nope"])
def test_unknown_route_is_json_404(path):
    async def main(c):
        r = await c.get(path)
        assert r.status_code == 404 and "error" in r.json()
    run(main, backends(with_translator=False))
