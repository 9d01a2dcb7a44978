"""GenerationEngine with n choices: one prefill forked into n slots, choice i seeded with seed + i,
all-or-none admission, cancellation of every choice, limits."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from engine_util import CharTokenizer, run_engine, tiny_llama

from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.hooks import StepHooks
from service.engine.types import GenerateRequest, RequestRejected, SamplingParams

torch.set_num_threads(1)
TOK = CharTokenizer()
_RNG = random.Random(2)
PROMPT = [_RNG.randrange(5, TOK.vocab_size) for _ in range(19)]


class CountingModel:
    """Wraps the engine's model to count the prompt tokens it prefills (forwards of more than one position
    or with an output index)."""

    def __init__(self, model):
        self.model, self.prefilled = model, 0

    def __call__(self, tokens, positions, cache, slots, **kw):
        if tokens.shape[1] > 1 or kw.get("output_index") is not None:
            self.prefilled += sum(1 for row in positions.tolist() for p in row if p < len(PROMPT))
        return self.model(tokens, positions, cache, slots, **kw)


def make_engine(**kw) -> GenerationEngine:
    cfg = dict(max_slots=6, max_seq_len=96, prefill_chunk=8, prefill_budget=24)
    cfg.update(kw)
    return GenerationEngine(tiny_llama(), TOK, EngineConfig(**cfg), eos_ids={TOK.eos_id})


def run(coro_fn, **kw):
    return run_engine(make_engine(**kw), coro_fn)


async def by_choice(engine, req) -> dict[int, dict]:
    out: dict[int, dict] = {}
    async for ev in engine.submit(req):
        c = out.setdefault(ev.index, {"text": "", "ids": [], "final": None})
        c["text"] += ev.text
        c["ids"] += ev.token_ids
        if ev.choice_finished:
            assert c["final"] is None
            c["final"] = ev
    return out


def sampled(n: int = 1, seed: int | None = 11, **kw) -> GenerateRequest:
    return GenerateRequest(prompt_ids=PROMPT, n=n, params=SamplingParams(
        max_new_tokens=kw.pop("max_new_tokens", 20), temperature=1.0, seed=seed, ignore_eos=True, **kw))


def test_choices_equal_single_requests_seeded_seed_plus_index_with_one_prefill():
    async def main(engine):
        counter = CountingModel(engine.model)
        engine.runner.model = counter
        many = await by_choice(engine, sampled(n=4))
        prefilled = counter.prefilled
        singles = [(await by_choice(engine, sampled(seed=11 + i)))[0] for i in range(4)]
        return many, prefilled, singles

    many, prefilled, singles = run(main)
    assert prefilled == len(PROMPT)  # one prefill for the four choices
    assert sorted(many) == [0, 1, 2, 3]
    for i, single in enumerate(singles):
        assert many[i]["ids"] == single["ids"] and many[i]["text"] == single["text"]
        assert many[i]["final"].usage.completion_tokens == 20
        assert many[i]["final"].usage.prompt_tokens == len(PROMPT)
    assert len({tuple(c["ids"]) for c in many.values()}) > 1  # different seeds, different samples
    finals = [c["final"] for c in many.values()]
    assert sum(not f.more for f in finals) == 1  # exactly one event ends the stream


class AdmissionRecorder(StepHooks):
    """Per request (its group of choices): the step it first ran in and how many choices held slots then."""

    def __init__(self):
        self.steps, self.first = 0, {}

    def on_plan(self, plan) -> None:
        for seq in [s for s, _ in plan.prefill] + plan.decode:
            key = id(seq.group[0])
            if key not in self.first:
                self.first[key] = (self.steps, sum(bool(x.slots) for x in seq.group), len(seq.group))
        self.steps += 1


def test_choices_queue_for_all_their_slots_and_free_them():
    rec = AdmissionRecorder()

    async def main(engine):
        engine.hooks = rec
        a, b, c = await asyncio.gather(by_choice(engine, sampled(n=4, max_new_tokens=12)),
                                       by_choice(engine, sampled(n=4, max_new_tokens=5, seed=1)),
                                       by_choice(engine, sampled(n=1, max_new_tokens=7, seed=2)))
        await asyncio.sleep(0.05)
        return a, b, c, engine.stats().slots_used, engine.stats().running

    a, b, c, used, running = run(main)
    assert [len(x) for x in (a, b, c)] == [4, 4, 1]
    assert all(len(ch["ids"]) == 12 for ch in a.values()) and all(len(ch["ids"]) == 5 for ch in b.values())
    assert used == 0 and running == 0
    assert sorted(n for _, _, n in rec.first.values()) == [1, 4, 4]
    assert all(held == n for _, held, n in rec.first.values()), rec.first  # all of a request's choices at once
    assert len({step for step, _, _ in rec.first.values()}) > 1, rec.first  # 9 choices, 6 slots: one waited


def test_closing_the_stream_cancels_every_choice():
    async def main(engine):
        stream = engine.submit(sampled(n=3, max_new_tokens=70))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(100):
            if engine.stats().slots_used == 0:
                break
            await asyncio.sleep(0.01)
        return engine.stats().slots_used, engine.stats().running

    assert run(main) == (0, 0)


def test_n_beyond_the_slots_is_rejected():
    async def main(engine):
        with pytest.raises(RequestRejected, match="n=7"):
            engine.submit(sampled(n=7))
    run(main)


def test_greedy_choices_agree_and_scoring_forks_without_kv():
    async def main(engine):
        greedy = GenerateRequest(prompt_ids=PROMPT, n=3, params=SamplingParams(max_new_tokens=6, temperature=0.0))
        scoring = GenerateRequest(prompt_ids=PROMPT, n=2, params=SamplingParams(max_new_tokens=0, prompt_logprobs=1))
        return await by_choice(engine, greedy), await by_choice(engine, scoring)

    greedy, scoring = run(main)
    assert len({tuple(c["ids"]) for c in greedy.values()}) == 1
    assert sorted(scoring) == [0, 1]
    assert all(c["final"].finish_reason == "length" and c["ids"] == [] for c in scoring.values())
