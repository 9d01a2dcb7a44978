"""Per-request deadlines (`EngineConfig.default_deadline_s`, set per model in the Serve config under
`engine:`): a generation that runs past it ends with finish_reason "timeout" (streamed or not), a
translation gets a 504 naming the deadline, and in both cases the request's KV slots are freed.

The models are slowed by a sleep per forward pass, so the request cannot finish inside its deadline
however fast the machine is; nothing here asserts on measured time."""

from __future__ import annotations

import time

import torch
from api_util import backends, metric, run, sse_events, translator
from engine_util import CharTokenizer, run_engine, tiny_llama

from service.config import ModelSpec
from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.types import GenerateRequest, SamplingParams
from service.models import engine_config

torch.set_num_threads(1)
DEADLINE_S = 1.0
STEP_SLEEP_S = 0.05  # >= 100 steps x 0.05 s = 5 s of work, far past the 1 s deadline


def _slow(module, method: str) -> None:
    fast = getattr(module, method)

    def slow(*args, **kw):
        time.sleep(STEP_SLEEP_S)
        return fast(*args, **kw)

    setattr(module, method, slow)


def test_deadline_comes_from_the_model_spec():
    spec = ModelSpec(device="cpu", dtype="float32", engine={"default_deadline_s": 30.0})
    assert engine_config(spec).default_deadline_s == 30.0


def test_generation_past_its_deadline_times_out_and_frees_its_slot():
    b = backends({"default_deadline_s": DEADLINE_S}, with_translator=False)
    engine = b.generator.engine
    _slow(engine.model, "forward")

    async def main(c):
        before = (await c.get("/metrics")).text
        body = {"prompt": "a long answer", "max_tokens": 100, "ignore_eos": True}
        r = await c.post("/v1/generate", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["finish_reason"] == "timeout" and out["usage"]["completion_tokens"] < 100
        r = await c.post("/v1/generate", json={**body, "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["finish_reason"] == "timeout"
        stats = engine.stats()
        assert stats.running == 0 and stats.waiting == 0 and stats.slots_used == 0
        after = (await c.get("/metrics")).text
        moved = (metric(after, "attnserve_request_success_total", finished_reason="timeout")
                 - metric(before, "attnserve_request_success_total", finished_reason="timeout"))
        assert moved == 2
        r = await c.post("/v1/generate", json={"prompt": "short", "max_tokens": 1})  # the engine still serves
        assert r.status_code == 200 and r.json()["finish_reason"] in ("length", "stop")
    run(main, b)


def test_a_generation_cut_by_its_deadline_keeps_the_text_it_held_back():
    """Every character is a stop string's prefix, so each is held back until the next token: the timeout
    still returns the last one, the text being exactly the decoded token ids."""
    tok = CharTokenizer(100)
    engine = GenerationEngine(tiny_llama(vocab_size=tok.vocab_size), tok, EngineConfig(max_slots=2, max_seq_len=128),
                              eos_ids={tok.eos_id})
    _slow(engine.model, "forward")
    stops = [c + "\u20ac" for c in tok.itos[5:]]  # never completed: the euro sign is not in the vocabulary

    async def main(e):
        req = GenerateRequest(prompt_ids=tok.encode("hello"), deadline_s=DEADLINE_S, params=SamplingParams(
            max_new_tokens=100, ignore_eos=True, temperature=0.0, stop=stops))
        return [ev async for ev in e.submit(req)]

    events = run_engine(engine, main)
    ids = [t for ev in events for t in ev.token_ids]
    assert events[-1].finish_reason == "timeout" and ids
    assert "".join(ev.text for ev in events) == tok.decode(ids)


def test_echoed_logprobs_of_a_prompt_cut_by_its_deadline_are_absent_not_a_500():
    """Completions with echo + logprobs: a request timed out while its prompt still prefilled has no prompt
    logprobs to echo; the choice says "timeout" with the prompt's text and no logprobs."""
    b = backends({"default_deadline_s": DEADLINE_S, "prefill_chunk": 8}, with_translator=False)
    engine = b.generator.engine
    fast = engine.model.forward

    def slow(*args, **kw):  # two 8-token chunks outlast the deadline: the prompt is never fully scored
        time.sleep(0.6)
        return fast(*args, **kw)

    engine.model.forward = slow

    async def main(c):
        prompt = "abcdefgh" * 5
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "echo": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "timeout" and choice["text"] == prompt
        assert engine.stats().slots_used == 0
    run(main, b)


def test_translation_past_its_deadline_is_a_504_and_frees_its_slots():
    b = backends(with_translator=False)
    b.translator = translator(default_deadline_s=DEADLINE_S)
    engine = b.translator.engine
    _slow(engine.model, "decode")

    async def main(c):
        r = await c.post("/v1/translate", json={"text": ["hello there", "你好"], "beam_size": 4, "max_length": 40})
        assert r.status_code == 504, r.text
        err = r.json()["error"]
        assert err["type"] == "timeout_error" and f"deadline of {DEADLINE_S} s" in err["message"]
        for _ in range(50):  # the engine frees the slots on its next step (bounded wait)
            stats = engine.stats()
            if stats.slots_used == 0:
                break
            await c.get("/healthz")
        assert stats.slots_used == 0 and stats.running == 0 and stats.waiting == 0
    run(main, b)
