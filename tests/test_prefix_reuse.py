"""Prompt prefixes already cached are copied, not prefilled (service/engine/prefix_reuse.py): the answers
are the ones a full prefill gives, sequential and concurrent, and the copies really happen."""

from __future__ import annotations

import asyncio
import random

import torch
from engine_util import CharTokenizer, run_engine, tiny_llama

from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.hooks import StepHooks
from service.engine.prefix_reuse import PrefixIndex, common_prefix
from service.engine.types import GenerateRequest, SamplingParams

torch.set_num_threads(1)
TOK = CharTokenizer()
MODEL = tiny_llama()


def test_common_prefix_and_longest_source():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    index = PrefixIndex(min_tokens=3)
    index.freed_slot(4, [1, 2, 3, 4, 5, 6])
    assert index.longest([1, 2, 3, 4, 9], [(0, [1, 2, 3])] + list(index.freed.items())) == (4, 4)
    # the prompt's last token is always prefilled, even when a source holds all of it
    assert index.longest([1, 2, 3, 4, 5], list(index.freed.items())) == (4, 4)
    assert index.longest([1, 2, 7], list(index.freed.items())) == (-1, 0)  # below min_tokens
    index.forget([4])
    assert index.freed == {}


def _engine(reuse: bool, **kw) -> GenerationEngine:
    cfg = dict(max_slots=8, max_seq_len=96, prefill_chunk=64, prefill_budget=256, prefix_reuse=reuse)
    cfg.update(kw)
    return GenerationEngine(MODEL, TOK, EngineConfig(**cfg), eos_ids={TOK.eos_id})


def _requests(seed: int) -> list[GenerateRequest]:
    rng = random.Random(seed)
    system = [rng.randrange(5, TOK.vocab_size) for _ in range(24)]  # a shared "system turn"
    prompts = [system + [rng.randrange(5, TOK.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    prompts.append(list(prompts[0]))  # the same prompt again
    prompts.append(prompts[1][:10])  # a prompt that is a prefix of another
    return [GenerateRequest(prompt_ids=p, params=SamplingParams(max_new_tokens=rng.randint(4, 20), temperature=0.0,
                                                                ignore_eos=True)) for p in prompts]


async def _answer(engine, req) -> list[int]:
    ids = []
    async for ev in engine.submit(req):
        ids += ev.token_ids
    return ids


class _CountCopies(StepHooks):
    def __init__(self):
        self.copies = 0

    def on_plan(self, plan):
        self.copies += len(plan.reuse)


def _run(reuse: bool, requests, concurrent: bool, hooks: StepHooks | None = None, **kw):
    engine = _engine(reuse, **kw)
    engine.hooks = hooks or StepHooks()

    async def go(engine):
        if concurrent:
            return await asyncio.gather(*[_answer(engine, r) for r in requests])
        return [await _answer(engine, r) for r in requests]

    return run_engine(engine, go), engine.prefix_tokens_reused


def test_one_request_after_another_reuses_the_freed_slot():
    requests = _requests(0)
    want, none = _run(False, requests, concurrent=False)
    got, reused = _run(True, requests, concurrent=False)
    assert got == want
    assert none == 0 and reused >= 24 * 7  # every prompt after the first starts with the shared turn


def test_concurrent_requests_reuse_running_and_freed_prefixes():
    for seed in (1, 2):
        requests = _requests(seed)
        want, _ = _run(False, requests, concurrent=True)
        hooks = _CountCopies()
        got, reused = _run(True, requests, concurrent=True, hooks=hooks)
        assert got == want
        assert reused > 0 and hooks.copies > 0  # copied from another slot, not only read in place


def test_reuse_under_compaction_and_few_slots():
    """More requests than slots: slots are freed, taken and compacted between the copies."""
    requests = _requests(3) * 2
    want, _ = _run(False, requests, concurrent=True, max_slots=3)
    got, reused = _run(True, requests, concurrent=True, max_slots=3)
    assert got == want
    assert reused > 0


def test_scoring_the_prompt_prefills_it_all():
    requests = _requests(4)[:3]
    scored = GenerateRequest(prompt_ids=requests[0].prompt_ids,
                             params=SamplingParams(max_new_tokens=2, temperature=0.0, prompt_logprobs=1))
    engine = _engine(True)

    async def go(engine):
        await _answer(engine, requests[0])
        before = engine.prefix_tokens_reused
        await _answer(engine, scored)
        return before

    before = run_engine(engine, go)
    assert engine.prefix_tokens_reused == before  # every position's logits are needed: nothing copied


def test_scored_prompt_choices_leave_no_prefix_they_never_wrote():
    """n choices scoring a prompt (max_new_tokens 0) share one prefill and copy no K/V: the other choices'
    slots must not be offered for reuse as if they held the prompt."""
    rng = random.Random(5)
    prompt = [rng.randrange(5, TOK.vocab_size) for _ in range(20)]
    other = [rng.randrange(5, TOK.vocab_size) for _ in range(12)]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    later = GenerateRequest(prompt_ids=prompt + [40, 41], params=greedy)
    (want,), _ = _run(False, [later], concurrent=False, max_slots=4)
    engine = _engine(True, max_slots=4)

    async def go(engine):
        await _answer(engine, GenerateRequest(prompt_ids=prompt, n=2,
                                              params=SamplingParams(max_new_tokens=0, prompt_logprobs=0)))
        # the unrelated prompt takes slot 0; `later` then takes the second choice's slot
        _, got = await asyncio.gather(_answer(engine, GenerateRequest(prompt_ids=other, params=greedy)),
                                      _answer(engine, later))
        return got

    assert run_engine(engine, go) == want


def test_a_restart_forgets_the_prefixes_its_warm_up_overwrote():
    """Slots freed before a stop held their prompts; the next start's warm-up writes over free slots, so a
    prompt after the restart must not reuse them (it would read the warm-up's K/V as its prefix)."""
    engine, req = _engine(True), _requests(11)[0]
    first = run_engine(engine, lambda e: _answer(e, req))
    assert engine.prefixes.freed  # the answer's slot and tokens, kept for reuse
    again = run_engine(engine, lambda e: _answer(e, req))
    assert again == first and engine.prefix_tokens_reused == 0
