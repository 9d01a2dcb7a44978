"""Every bounded field: out-of-range values are a 400 whose error names the field; never a 500."""

from __future__ import annotations

import pytest
import torch
from api_util import backends, run

from service.config import ApiLimits

torch.set_num_threads(1)
LIMITS = ApiLimits(max_body_bytes=20_000, max_prompt_chars=200, max_messages=3, max_texts=2, max_text_chars=50,
                   max_stop=2, max_stop_chars=5, max_beam_size=4, max_translate_length=32, max_sentences=3,
                   max_prompts=2)
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (path, body, status, param)
    ("/v1/generate", {"prompt": "a", "temperature": 2.5}, 400, "temperature"),
    ("/v1/generate", {"prompt": "a", "temperature": -0.1}, 400, "temperature"),
    ("/v1/generate", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("/v1/generate", {"prompt": "a", "top_p": 1.01}, 400, "top_p"),
    ("/v1/generate", {"prompt": "a", "top_k": -2}, 400, "top_k"),  # -1 = off, as vLLM
    ("/v1/generate", {"prompt": "a", "min_p": 1.5}, 400, "min_p"),
    ("/v1/chat/completions", {"messages": MSG, "min_p": -0.1}, 400, "min_p"),
    ("/v1/completions", {"prompt": "a", "top_k": 2000}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 3}, 400, "repetition_penalty"),
    ("/v1/generate", {"prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/generate", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/generate", {"prompt": "a", "max_tokens": 128}, 400, "max_tokens"),  # 1 + 128 > context 128
    ("/v1/generate", {"prompt": "a", "seed": -1}, 400, "seed"),
    ("/v1/generate", {"prompt": "a", "stop": ["a", "b", "c"]}, 400, "stop"),
    ("/v1/generate", {"prompt": "a", "stop": "toolong"}, 400, "stop"),
    ("/v1/generate", {"prompt": "a" * 201}, 400, "prompt"),
    ("/v1/generate", {"prompt": "a" * 150}, 400, "prompt"),  # 150 tokens > the 128-token context
    ("/v1/generate", {"prompt": ""}, 400, "prompt"),
    ("/v1/generate", {"messages": MSG * 4}, 400, "messages"),
    ("/v1/generate", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/generate", {"messages": []}, 400, "messages"),
    ("/v1/generate", {"prompt": "a", "messages": MSG}, 400, "body"),
    ("/v1/generate", {}, 400, "body"),
    ("/v1/generate", {"prompt": "a", "bogus": 1}, 400, "bogus"),
    ("/v1/generate", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/v1/generate", {"prompt": "a", "model": "attnserve-zh-en"}, 400, "model"),
    ("/v1/generate", {"prompt": "a", "stream": "yes please"}, 400, "stream"),
    ("/v1/completions", {"prompt": "a", "n": 9}, 400, "n"),  # beyond ApiLimits.max_n
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, 400, "prompt"),  # beyond ApiLimits.max_prompts
    ("/v1/completions", {"prompt": ["a", "b" * 201]}, 400, "prompt.1"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": "x"}}, 400,
     "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": MSG, "stream": False, "stream_options": {}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10_000}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 500}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": 3}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 201}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MSG, "user": "u" * 300}, 400, "user"),
    ("/v1/translate", {"text": ["a", "b", "c"]}, 400, "text"),
    ("/v1/translate", {"text": "x" * 51}, 400, "text"),
    ("/v1/translate", {"text": "  "}, 400, "text"),
    ("/v1/translate", {"text": []}, 400, "text"),
    ("/v1/translate", {"text": "hi", "beam_size": 5}, 400, "beam_size"),
    ("/v1/translate", {"text": "hi", "beam_size": 0}, 400, "beam_size"),
    ("/v1/translate", {"text": "hi", "max_length": 33}, 400, "max_length"),
    ("/v1/translate", {"text": "hi", "source_lang": "fr"}, 400, "source_lang"),
    ("/v1/translate", {"text": "hi", "options[beam]": 2}, 400, "options[beam]"),  # an unknown key, as sent
    ("/v1/completions", {"prompt": "hi", "stop[]": "x"}, 400, "stop[]"),
    ("/v1/translate", {"text": "hi", "target_lang": "de"}, 400, "target_lang"),
    ("/v1/translate", {"text": "hi", "source_lang": "en", "target_lang": "en"}, 400, "target_lang"),
    ("/v1/translate", {"text": "hi", "length_penalty": 3}, 400, "length_penalty"),
    ("/v1/translate", {"text": "hi", "min_length_ratio": 1.5}, 400, "min_length_ratio"),
    ("/v1/translate", {"text": "hi", "min_length_ratio": -0.1}, 400, "min_length_ratio"),
    ("/v1/translate", {"text": "hi", "model": "smollm2-135m-instruct"}, 400, "model"),
]


def test_each_bounded_field_names_itself():
    async def main(c):
        bad = []
        for path, body, status, param in CASES:
            r = await c.post(path, json=body)
            err = r.json().get("error", {}) if r.headers["content-type"].startswith("application/json") else {}
            if r.status_code != status or err.get("param") != param or not err.get("message"):
                bad.append((path, body if len(str(body)) < 80 else "...", r.status_code, err))
        assert not bad, bad
    run(main, backends(), LIMITS)


@pytest.mark.parametrize("path", ["/v1/generate", "/v1/chat/completions", "/v1/translate"])
def test_invalid_json_and_body_limit(path):
    async def main(c):
        r = await c.post(path, content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        r = await c.post(path, json={"prompt": "a" * 30_000})
        assert r.status_code == 413 and "20000 bytes" in r.json()["error"]["message"]

        async def chunks():  # no Content-Length: the limit applies while reading
            for _ in range(30):
                yield b"x" * 1000
        r = await c.post(path, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
    run(main, backends(with_translator=False), LIMITS)


def test_limits_reload_live():
    async def main(c):
        assert (await c.post("/v1/generate", json={"prompt": "a" * 201, "max_tokens": 1})).status_code == 400
        c.app.state.limits = ApiLimits(max_prompt_chars=1000)
        assert (await c.post("/v1/generate", json={"prompt": "a" * 100, "max_tokens": 1})).status_code == 200
    run(main, backends(with_translator=False), LIMITS)


def test_beam_and_length_limits_are_the_lower_of_api_limits_and_the_translator():
    """One bound per field, named with both of its sources: ApiLimits (the operator's) and the translator's
    slots / target positions (8 slots, 63 positions here); within both, the request runs."""
    async def main(c):
        got = {}
        for body in ({"beam_size": 9}, {"beam_size": 8}, {"max_length": 64}, {"max_length": 63}):
            r = await c.post("/v1/translate", json={"text": "hi", **body})
            got[next(iter(body.items()))] = (r.status_code, r.json().get("error", {}))
        assert got["beam_size", 9][0] == 400 and got["beam_size", 9][1]["param"] == "beam_size"
        assert "must be <= 8" in got["beam_size", 9][1]["message"] and "8 slots" in got["beam_size", 9][1]["message"]
        assert got["max_length", 64][0] == 400 and got["max_length", 64][1]["param"] == "max_length"
        assert "must be <= 63" in got["max_length", 64][1]["message"]
        assert got["beam_size", 8][0] == 200 and got["max_length", 63][0] == 200
    run(main, backends(), ApiLimits(max_beam_size=64, max_translate_length=4096))


def test_sentences_to_translate_are_bounded_per_request():
    """Each sentence costs a beam search: ApiLimits.max_sentences bounds a request's, counted after the split
    (a text of many short sentences costs more than its characters say)."""
    async def main(c):
        r = await c.post("/v1/translate", json={"text": ["Go now. We ran.", "He sat. She ate."]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text"
        assert "4 sentences" in r.json()["error"]["message"] and "limit is 3" in r.json()["error"]["message"]
        r = await c.post("/v1/translate", json={"text": ["Go now. We ran.", "He sat."]})
        assert r.status_code == 200 and len(r.json()["translations"]) == 2
    run(main, backends(), LIMITS)


def test_http_counter_records_500s_and_413s(monkeypatch):
    """`attnserve_http_requests_total` by status: an unhandled error is a 500 (not a client gone, 499), and
    bodies refused for their size are counted as the 413 the client got."""
    import asyncio

    import httpx
    from api_util import metric

    from service.api.app import create_app
    from service.frontend.generator import GeneratorFrontend

    def boom(self, text):
        raise RuntimeError("a bug")

    async def main():
        b = backends(with_translator=False)
        app = create_app(b, LIMITS)
        await b.start()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                before = (await c.get("/metrics")).text

                async def chunks():
                    for _ in range(30):
                        yield b"x" * 1000
                assert (await c.post("/v1/generate", json={"prompt": "a" * 30_000})).status_code == 413
                r = await c.post("/v1/generate", content=chunks(), headers={"content-type": "application/json"})
                assert r.status_code == 413
                monkeypatch.setattr(GeneratorFrontend, "encode_prompt", boom)
                assert (await c.post("/v1/generate", json={"prompt": "hi"})).status_code == 500
                after = (await c.get("/metrics")).text
        finally:
            await b.stop()
        name = "attnserve_http_requests_total"
        return {s: metric(after, name, status=s) - metric(before, name, status=s) for s in ("500", "413", "400", "499")}

    assert asyncio.run(main()) == {"500": 1, "413": 2, "400": 0, "499": 0}


def test_http_counter_names_the_route_of_a_middlewares_answer():
    """A 413, 401 or start-up 503 is answered before routing: it was counted as route "unmatched", as if the
    path were unknown (a 404), not under the route it was sent to."""
    import asyncio

    import httpx
    from api_util import metric
    from prometheus_client.parser import text_string_to_metric_families

    from service.api.app import create_app
    from service.api.backends import Backends
    from service.startup import Startup

    async def count(app, method, path, root="", **kw):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False, root_path=root)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            before = (await c.get(root + "/metrics")).text
            status = (await c.request(method, root + path, **kw)).status_code
            after = (await c.get(root + "/metrics")).text
        name = "attnserve_http_requests_total"
        routes = {s.labels["route"] for fam in text_string_to_metric_families(after) for s in fam.samples
                  if s.name == name and s.labels["route"] != "/metrics"
                  and metric(after, name, **s.labels) != metric(before, name, **s.labels)}
        return status, routes

    loading = create_app(Backends(), LIMITS, startup=Startup(), api_keys=[])
    locked = create_app(Backends(), LIMITS, api_keys=["sk-test"])
    assert asyncio.run(count(loading, "POST", "/v1/generate", json={"prompt": "a" * 30_000})) == (413, {"/v1/generate"})
    assert asyncio.run(count(loading, "POST", "/v1/chat/completions", json={})) == (503, {"/v1/chat/completions"})
    assert asyncio.run(count(loading, "GET", "/v1/generate")) == (503, {"/v1/generate"})  # the route's 405, later
    assert asyncio.run(count(loading, "POST", "/v1/translate", root="/pre", json={})) == (503, {"/v1/translate"})
    assert asyncio.run(count(locked, "POST", "/v1/translate", json={})) == (401, {"/v1/translate"})
    assert asyncio.run(count(locked, "GET", "/no/such/route")) == (401, {"unmatched"})


def test_null_optional_fields_mean_not_given():
    """The openai SDK sends `temperature=None` etc. as null: OpenAI and vLLM read it as the default. Required
    fields stay required."""
    nulls = {k: None for k in ("temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream",
                               "logprobs", "top_logprobs", "stop", "seed", "stream_options", "response_format",
                               "logit_bias", "user")}
    chat = {"messages": [{"role": "user", "content": "hi", "name": None}], "max_tokens": 5, "temperature": 0.0}

    async def main(c):
        plain = await c.post("/v1/chat/completions", json=chat)
        nulled = await c.post("/v1/chat/completions", json={**chat, **{k: v for k, v in nulls.items()
                                                                        if k != "temperature"}})
        comp = {"prompt": "hi", "max_tokens": 4, "temperature": 0.0}
        comp_plain = await c.post("/v1/completions", json=comp)
        comp_null = await c.post("/v1/completions", json={**comp, "echo": None, "logprobs": None, "best_of": None})
        translate = await c.post("/v1/translate", json={"text": "hello", "beam_size": None, "target_lang": None})
        required = await c.post("/v1/chat/completions", json={"messages": None})
        return plain, nulled, comp_plain, comp_null, translate, required

    plain, nulled, comp_plain, comp_null, translate, required = run(main, backends(), LIMITS)
    schema_null = run(lambda c: c.post("/v1/chat/completions", json={
        **chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": None}}}),
        backends(), LIMITS)
    assert schema_null.status_code == 200, schema_null.text  # by its alias too: `schema` is the field `schema_`
    assert plain.status_code == nulled.status_code == 200, nulled.text
    assert nulled.json()["choices"] == plain.json()["choices"]
    assert comp_null.status_code == 200 and comp_null.json()["choices"] == comp_plain.json()["choices"]
    assert translate.status_code == 200, translate.text
    assert required.status_code == 400 and required.json()["error"]["param"] == "messages"


def test_developer_role_is_the_system_turn():
    """OpenAI's `developer` role (current SDKs send it) is the system turn: the same prompt as `system`."""
    def chat(role):
        return {"messages": [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}],
                "max_tokens": 4, "temperature": 0.0, "logprobs": True}

    async def main(c):
        return [await c.post("/v1/chat/completions", json=chat(role)) for role in ("developer", "system")]

    developer, system = run(main, backends(), LIMITS)
    assert developer.status_code == 200, developer.text
    assert developer.json()["usage"]["prompt_tokens"] == system.json()["usage"]["prompt_tokens"]
    assert developer.json()["choices"] == system.json()["choices"]


def test_a_number_too_long_to_read_names_the_problem():
    async def main(c):
        return await c.post("/v1/completions", content=b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
                            headers={"content-type": "application/json"})

    r = run(main, backends(), LIMITS)
    assert r.status_code == 400 and "number is too long" in r.json()["error"]["message"], r.text
