"""Hostile request bodies against the real app and engines (tiny random models, no Ray): each one is a
clear 4xx JSON error naming the problem, never a 5xx, and the app keeps serving afterwards."""

from __future__ import annotations

import json

import torch
from api_util import backends, run

torch.set_num_threads(1)
MSG = [{"role": "user", "content": "hi"}]


def _raw(text: str) -> bytes:
    return text.encode()


# (path, body: dict/list/str = JSON-encoded, bytes = sent as is), status, param, words the message must contain
CASES = [
    ("/v1/generate", {"prompt": "a" * 1_000_000}, 413, "body", "exceeds"),
    ("/v1/generate", {"prompt": "a" * 900_000}, 400, "prompt", "900000 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 900_000}]}, 400, "messages", "limit"),
    ("/v1/translate", {"text": ["hi"] * 10_000}, 400, "text", "got 10000"),
    ("/v1/translate", {"text": "a" * 500_000}, 400, "text", "characters"),
    ("/v1/generate", b'{"prompt": "\xff\xfe abc"}', 400, "body", "UTF-8"),
    ("/v1/translate", b'{"text": "caf\xe9"}', 400, "body", "UTF-8"),
    ("/v1/generate", _raw('{"prompt": "\\ud800"}'), 400, "prompt", "surrogate"),
    ("/v1/generate", _raw('{"prompt": "a\\udc00b"}'), 400, "prompt", "surrogate"),
    ("/v1/translate", _raw('{"text": "\\ud800 hello"}'), 400, "text", "surrogate"),
    ("/v1/translate", _raw('{"text": ["ok", "x\\udfff"]}'), 400, "text.1", "surrogate"),
    ("/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": "\\ud83d"}]}'), 400,
     "messages.0.content", "surrogate"),
    ("/v1/completions", _raw('{"prompt": "a", "stop": "\\ud800"}'), 400, "stop", "surrogate"),
    ("/v1/generate", _raw('{"prompt": "a", "temperature": NaN}'), 400, "temperature", "finite"),
    ("/v1/generate", _raw('{"prompt": "a", "top_p": Infinity}'), 400, "top_p", "finite"),
    ("/v1/generate", _raw('{"prompt": "a", "repetition_penalty": -Infinity}'), 400, "repetition_penalty", "finite"),
    ("/v1/translate", _raw('{"text": "a", "length_penalty": NaN}'), 400, "length_penalty", "finite"),
    # inside a response_format schema too: json.loads reads them, and the grammar would take NaN as null
    ("/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
                                  '"json_schema", "json_schema": {"name": "x", "schema": {"enum": [NaN]}}}}'), 400,
     "response_format.json_schema", "NaN"),
    ("/v1/completions", _raw('{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": '
                             '"x", "schema": {"type": "number", "maximum": 1e400}}}}'), 400,
     "response_format.json_schema", "Infinity"),
    ("/v1/generate", {"prompt": "a", "temperature": -1}, 400, "temperature", "greater than"),
    ("/v1/generate", {"prompt": "a", "max_tokens": -5}, 400, "max_tokens", "greater than"),
    ("/v1/generate", {"prompt": "a", "max_tokens": 10**30}, 400, "max_tokens", "less than"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 8192}, 400, "max_tokens", "does not fit"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 2**31}, 400, "max_completion_tokens", ""),
    ("/v1/translate", {"text": "a", "max_length": 10**9}, 400, "max_length", "must be <="),
    ("/v1/translate", {"text": "a", "beam_size": -3}, 400, "beam_size", ""),
    ("/v1/generate", {"prompt": "a", "seed": 2**64}, 400, "seed", ""),
    ("/v1/generate", {"prompt": 5}, 400, "prompt", "string"),
    ("/v1/generate", {"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ("/v1/generate", {"prompt": "a", "max_tokens": 1.5}, 400, "max_tokens", "fractional"),
    ("/v1/generate", {"prompt": "a", "stream": [True]}, 400, "stream", "boolean"),
    # JSON's true is not a number (pydantic's lax mode read it as 1), as OpenAI's API says
    ("/v1/generate", {"prompt": "a", "max_tokens": True}, 400, "max_tokens", "not true"),
    ("/v1/generate", {"prompt": "a", "temperature": False}, 400, "temperature", "not false"),
    ("/v1/translate", {"text": "a", "beam_size": True}, 400, "beam_size", "not true"),
    ("/v1/completions", {"prompt": [True, 2]}, 400, "prompt.0", "not true"),
    ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"1": True}}, 400, "logit_bias.1", "not true"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]}, 400, "messages.0.content", ""),
    ("/v1/translate", {"text": 7}, 400, "text", ""),
    ("/v1/translate", {"text": [1, 2]}, 400, "text", ""),
    ("/v1/generate", [1, 2, 3], 400, "body", "dictionary"),
    ("/v1/generate", "just a string", 400, "body", "dictionary"),
    ("/v1/generate", None, 400, "body", ""),
    ("/v1/generate", b"[" * 100_000 + b"]" * 100_000, 400, "body", "nested too deeply"),
    ("/v1/translate", b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, "body", "nested too deeply"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [[[[["x"]]]]]}]}, 400, "messages.0.content",
     ""),
    ("/v1/generate", b"", 400, "body", ""),
    ("/v1/generate", b"\x00\x01\x02", 400, "body", "invalid JSON"),
    ("/v1/generate", b'{"prompt": "a"', 400, "body", "invalid JSON"),
    ("/v1/generate", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": [""]}, 400, "prompt", "empty"),
    ("/v1/translate", {"text": ""}, 400, "text", "empty"),
    ("/v1/translate", {"text": ["ok", " \t\n"]}, 400, "text", "text[1] is empty"),
    ("/v1/generate", {"prompt": "a", "stop": [""]}, 400, "stop", "1.."),
    ("/v1/generate", {"prompt": "a", "logit_bias": {"1": 5}}, 400, "logit_bias", "Extra inputs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400,
     "messages.0.tool_calls", "Extra inputs"),
    ("/v1/translate", {"text": "a", "__proto__": {}}, 400, "__proto__", "Extra inputs"),
    ("/v1/generate", {"prompt": "a", "model": "gpt-4"}, 404, "model", "not found"),
    ("/v1/completions", {"prompt": "a", "model": "../../etc/passwd"}, 404, "model", "not found"),
    ("/v1/translate", {"text": "a", "model": "x" * 1000}, 400, "model", "at most 128"),
]


def test_hostile_bodies_get_named_4xx_and_the_app_keeps_serving():
    async def main(c):
        bad = []
        for path, body, status, param, words in CASES:
            if isinstance(body, bytes):
                r = await c.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = await c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            err = r.json().get("error", {}) if r.headers["content-type"].startswith("application/json") else {}
            if r.status_code != status or err.get("param") != param or words not in err.get("message", ""):
                bad.append((path, str(body)[:60], r.status_code, err))
        assert not bad, bad
        r = await c.post("/v1/generate", json={"prompt": "still here", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = await c.post("/v1/translate", json={"text": "still here", "beam_size": 2, "max_length": 4})
        assert r.status_code == 200 and len(r.json()["translations"]) == 1
        stats = c.app.state.backends.generator.engine.stats()
        assert stats.running == 0 and stats.slots_used == 0
    run(main, backends())


def test_control_characters_and_odd_unicode_are_text():
    """Control characters, NUL, bidi overrides, emoji and CJK are valid text: served, and the answer is
    well-formed JSON (escaped), not an error."""
    odd = "tab\there\x00nul\x1b[31mansi\u202ertl\u200bzw \U0001f600 中文 \ufeff\x7f"

    async def main(c):
        r = await c.post("/v1/generate", json={"prompt": odd, "max_tokens": 4})
        assert r.status_code == 200 and isinstance(json.loads(r.text)["text"], str)
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": odd}],
                                                      "max_tokens": 2, "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        r = await c.post("/v1/translate", json={"text": [odd[:40], "\x00"], "beam_size": 1, "max_length": 4})
        assert r.status_code == 200 and len(r.json()["translations"]) == 2
    run(main, backends())


def test_wrong_method_content_type_and_path_are_4xx_json():
    async def main(c):
        for method, path, kw, status in [
            ("PUT", "/v1/generate", {"json": {}}, 405), ("GET", "/v1/translate", {}, 405),
            ("DELETE", "/v1/models", {}, 405), ("GET", "/v1/nope", {}, 404), ("GET", "/%00", {}, 404),
            # JSON is read only with its Content-Type (a browser's form post to a local server is no request)
            ("POST", "/v1/generate", {"content": b'{"prompt": "a"}', "headers": {"content-type": "text/plain"}}, 415),
            ("POST", "/v1/generate", {"content": b"prompt=a", "headers": {
                "content-type": "application/x-www-form-urlencoded"}}, 415),
            ("POST", "/v1/chat/completions", {"content": b'{"messages": []}'}, 415),
            # FastAPI reads application/json and application/*+json only: these too are unread, not malformed
            ("POST", "/v1/generate", {"content": b'{"prompt": "a"}', "headers": {"content-type": "text/json"}}, 415),
            ("POST", "/v1/generate", {"content": b'{"prompt": "a"}', "headers": {
                "content-type": "application/x-json"}}, 415),
            ("POST", "/v1/generate", {"content": b'{"prompt": "a", "max_tokens": 1}', "headers": {
                "content-type": "application/vnd.api+json; charset=utf-8"}}, 200),
        ]:
            r = await c.request(method, path, **kw)
            assert r.status_code == status, (method, path, r.status_code, r.text)
            assert status == 200 or r.json()["error"]["message"], r.text
            if status == 415:
                assert r.json()["error"]["param"] == "Content-Type" and "application/json" in r.text
    run(main, backends(with_translator=False))


def test_a_failing_transport_receive_is_a_disconnect_not_a_crash():
    """Under Ray Serve a dropped stream makes `receive` raise (TaskCancelledError) instead of returning
    `http.disconnect`: the app must treat it as a disconnect, cancel the request and raise nothing."""
    import asyncio

    async def main(c):
        body = json.dumps({"prompt": "x", "max_tokens": 100, "ignore_eos": True, "stream": True}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/generate", "raw_path": b"/v1/generate", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        calls, sent = [0], []

        async def receive():
            calls[0] += 1
            if calls[0] == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(0.05)
            raise RuntimeError("transport receive failed (as ray.exceptions.TaskCancelledError)")

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(c.app(scope, receive, send), timeout=30)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        engine = c.app.state.backends.generator.engine
        for _ in range(100):  # freed on the engine's next step
            if engine.stats().running == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.stats().running == 0 and engine.stats().slots_used == 0
    run(main, backends(with_translator=False))


def test_a_response_format_schema_nested_near_the_parser_limit_is_a_400():
    """A schema the body parser just takes (nested a little less than its recursion limit) is serialized
    again, deeper in the stack, to measure it: that must be a 400 naming the schema, not a RecursionError
    (a 500). Every depth around the limit, as the stack's depth where the request is read varies."""
    def body(depth: int) -> bytes:
        schema = b'{"items":' * depth + b"{}" + b"}" * depth
        return (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "response_format": '
                b'{"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + schema + b"}}}")

    async def main(c):
        got = {}
        for depth in range(700, 1000, 2):
            r = await c.post("/v1/chat/completions", content=body(depth), headers={"content-type": "application/json"})
            got.setdefault((r.status_code, r.json()["error"]["param"]), []).append(depth)
        return got

    got = run(main, backends(with_translator=False))
    assert {status for status, _ in got} == {400}, got
    assert {param for _, param in got} <= {"body", "response_format", "response_format.json_schema"}, got
