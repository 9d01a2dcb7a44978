"""vLLM's utility endpoints: POST /tokenize (prompt or chat messages), POST /detokenize, GET /version,
GET /health, in vLLM's request and response shapes; bad input is a 400 naming the field."""

from __future__ import annotations

import torch
from api_util import TEMPLATE, TOK, backends, run

from service.api.backends import Backends
from service.config import GENERATOR_ID

torch.set_num_threads(1)
MSGS = [{"role": "system", "content": "Brief."}, {"role": "user", "content": "Hi"}]


def test_tokenize_prompt_and_messages():
    from model.chat import render_chat

    async def main(c):
        r = await c.post("/tokenize", json={"model": GENERATOR_ID, "prompt": "Hello,world"})
        assert r.json() == {"count": 11, "max_model_len": 128, "tokens": TOK.encode("Hello,world"), "token_strs": None}
        r = await c.post("/tokenize", json={"prompt": "abc", "return_token_strs": True})
        assert r.json()["token_strs"] == ["a", "b", "c"]
        with_prompt = (await c.post("/tokenize", json={"messages": MSGS})).json()
        assert with_prompt["tokens"] == TOK.encode(render_chat(TEMPLATE, MSGS, True))
        without = (await c.post("/tokenize", json={"messages": MSGS, "add_generation_prompt": False})).json()
        assert without["tokens"] == TOK.encode(render_chat(TEMPLATE, MSGS, False))
        assert without["count"] < with_prompt["count"]
        # the same ids the completions route counts
        r = await c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == with_prompt["count"]
    run(main)


def test_continue_final_message_prefills_the_reply_as_vllm_does():
    from model.chat import render_chat

    prefill = [*MSGS, {"role": "assistant", "content": "Sure: "}]
    opts = {"add_generation_prompt": False, "continue_final_message": True}

    async def main(c):
        text = render_chat(TEMPLATE, prefill, False, True)
        assert text.endswith("| assistant: Sure: ")
        want = TOK.encode(text)
        assert (await c.post("/tokenize", json={"messages": prefill, **opts})).json()["tokens"] == want
        r = await c.post("/v1/chat/completions", json={"messages": prefill, "max_tokens": 1, **opts})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)
        for route, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 1})):
            r = await c.post(route, json={"messages": prefill, "continue_final_message": True, **extra})
            assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]
        # a raw prompt is not rendered: the chat options are ignored, as vLLM ignores them
        r = await c.post("/tokenize", json={"prompt": "Sure: ", "continue_final_message": True})
        assert r.status_code == 200 and r.json()["tokens"] == TOK.encode("Sure: ")
    run(main)


def test_a_messages_text_parts_join_with_line_breaks_as_in_vllm():
    from service.api.schemas import ChatMessage

    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    assert ChatMessage.model_validate({"role": "user", "content": parts}).text() == "Hi\nthere"


def test_detokenize_round_trips():
    async def main(c):
        ids = (await c.post("/tokenize", json={"prompt": "Round,trip!"})).json()["tokens"]
        r = await c.post("/detokenize", json={"model": GENERATOR_ID, "tokens": ids})
        assert r.status_code == 200 and r.json() == {"prompt": "Round,trip!"}
        assert (await c.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
    run(main)


def test_bad_bodies_name_the_field():
    cases = [("/tokenize", {}, "body", 400), ("/tokenize", {"prompt": "a", "messages": MSGS}, "body", 400),
             ("/tokenize", {"prompt": "a", "add_special_tokens": True}, "add_special_tokens", 400),
             ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model", 404),
             ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", 400),
             ("/detokenize", {"tokens": [5, 97]}, "tokens", 400), ("/detokenize", {"tokens": [-1]}, "tokens", 400),
             ("/detokenize", {"tokens": ["a"]}, "tokens.0", 400), ("/detokenize", {}, "tokens", 400)]

    async def main(c):
        bad = []
        for path, body, param, status in cases:
            r = await c.post(path, json=body)
            err = r.json().get("error", {})
            if r.status_code != status or err.get("param") != param or not err.get("message"):
                bad.append((path, body, r.status_code, err))
        assert not bad, bad
    run(main, backends(with_translator=False))


def test_version_and_health():
    async def main(c):
        r = await c.get("/version")
        assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]
        r = await c.get("/health")
        assert r.status_code == 200 and r.content == b""
    run(main, backends(with_translator=False))

    async def down(c):
        r = await c.get("/health")
        assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]
    run(down, Backends(unavailable={GENERATOR_ID: "failed to load"}))


def test_health_is_503_while_starting_and_version_answers():
    from service.startup import Startup

    starting = Startup()
    starting.set("loading weights")

    async def main(c):
        r = await c.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"]
        assert (await c.get("/version")).status_code == 200  # needs no model: a probe during start-up
        starting.done()
        assert (await c.get("/health")).status_code == 200
    run(main, backends(with_translator=False), startup=starting)


def test_health_and_version_need_no_api_key():
    async def main(c):
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/version")).status_code == 200
        assert (await c.post("/tokenize", json={"prompt": "a"})).status_code == 401
    run(main, backends(with_translator=False), api_keys=["k"])


def test_a_messages_name_reaches_the_chat_template():
    from service.api.generation import encode_messages
    from service.api.schemas import ChatMessage
    from service.config import ApiLimits
    from service.frontend.generator import GeneratorFrontend

    gen = GeneratorFrontend(None, TOK, chat_template="{% for m in messages %}{{ m.name }}:{% endfor %}")
    msgs = [ChatMessage(role="user", content="hi", name="bob"), ChatMessage(role="user", content="yo")]
    assert gen.decode(encode_messages(gen, msgs, ApiLimits())) == "bob::"
