"""Randomized mixed load on both engines: requests arriving at random times into few slots (queueing,
compaction, prefix reuse, chunked prefill), with n > 1, stop strings, logprobs, cancellations and short
deadlines. Every request that runs to its end gives what it gives alone on a fresh engine, every request
ends, each is counted once, and the engine is idle afterwards.

Exact comparisons are greedy only: a sampled token whose uniform draw falls within float rounding of a CDF
boundary may flip under another batch's rounding (seen once in a few hundred random loads), which no
per-request seed can rule out. Sampled requests, n > 1 among them, run as company and must still end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch
from engine_util import CharTokenizer, tiny_llama, tiny_seq2seq

from model.translation import encode_source
from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.translation import TranslationEngine
from service.engine.types import GenerateRequest, SamplingParams, SourceBatch

torch.set_num_threads(1)
TOK = CharTokenizer()
LLAMA = tiny_llama()
SEQ2SEQ = tiny_seq2seq()
STOPS = [[], [], ["a"], ["xy", "b"], ["Q", "zz", "7"]]
WORDS = "the cat sat on a mat while dogs ran far away from home and back again".split()


def _settle(engine):
    """Wait (bounded) for the loop to free what the last clients left -> the engine's stats."""
    async def wait():
        for _ in range(200):
            st = engine.stats()
            if (st.running, st.slots_used, st.waiting) == (0, 0, 0):
                break
            await asyncio.sleep(0.005)
        return engine.stats()
    return wait()


# --- generation ---------------------------------------------------------------------------------
def _ids(rng, n):
    return [rng.randrange(5, TOK.vocab_size) for _ in range(n)]


def _gen_load(rng):
    bases = [_ids(rng, rng.randint(8, 40)) for _ in range(3)]  # shared "system turns"
    load = []
    for _ in range(rng.randint(6, 12)):
        if load and rng.random() < 0.2:
            prompt = list(rng.choice(load)["req"].prompt_ids)
        elif rng.random() < 0.6:
            base = rng.choice(bases)
            prompt = base[:rng.randint(8, len(base))] + _ids(rng, rng.randint(0, 10))
        else:
            prompt = _ids(rng, rng.randint(1, 50))
        greedy = rng.random() < 0.7
        params = SamplingParams(max_new_tokens=rng.randint(1, 25), temperature=0.0 if greedy else 0.8,
                                seed=rng.randint(0, 99), stop=rng.choice(STOPS), ignore_eos=rng.random() < 0.5,
                                repetition_penalty=rng.choice([1.0, 1.3]), logprobs=rng.choice([None, None, 2]))
        load.append(dict(req=GenerateRequest(prompt_ids=prompt, params=params, n=1 if greedy else rng.randint(1, 3)),
                         greedy=greedy, delay=rng.choice([0, 0, 0.002, 0.01]),
                         cancel_after=rng.choice([None] * 5 + [0, 2]), deadline=rng.choice([None] * 8 + [0.005])))
    return load


async def _read(stream, cancel_after=None):
    """-> (how it ended, per choice: (text, ids, finish_reason, completion tokens, logprob ids))."""
    text, ids, lps, fins, events = {}, {}, {}, {}, 0
    async for ev in stream:
        text[ev.index] = text.get(ev.index, "") + ev.text
        ids[ev.index] = ids.get(ev.index, []) + ev.token_ids
        lps[ev.index] = lps.get(ev.index, []) + [lp.token_id for lp in ev.logprobs or []]
        if ev.finish_reason:
            fins[ev.index] = (ev.finish_reason, ev.usage.completion_tokens)
        events += 1
        if cancel_after is not None and events > cancel_after and not ev.finished:
            await stream.aclose()
            return "cancelled", {}
        if ev.finished:
            break
    return "done", {i: (text[i], ids[i], *fins[i], lps[i]) for i in fins}


def _gen_engine(**cfg):
    return GenerationEngine(LLAMA, TOK, EngineConfig(**cfg), eos_ids={TOK.eos_id})


async def _gen_alone(req):
    engine = _gen_engine(max_slots=4, max_seq_len=128, prefix_reuse=False)
    await engine.start()
    try:
        return await _read(engine.submit(req))
    finally:
        await engine.stop()


async def _gen_together(load, cfg):
    engine = _gen_engine(**cfg)
    await engine.start()
    try:
        async def client(item):
            await asyncio.sleep(item["delay"])
            req = dataclasses.replace(item["req"], deadline_s=item["deadline"])
            return await _read(engine.submit(req), item["cancel_after"])
        got = await asyncio.wait_for(asyncio.gather(*(client(item) for item in load)), 60)
        return got, await _settle(engine), engine.prefix_tokens_reused
    finally:
        await engine.stop()


@pytest.mark.parametrize("seed", range(4))
def test_generation_under_mixed_load_equals_each_request_alone(seed):
    rng = random.Random(seed)
    load = _gen_load(rng)
    cfg = dict(max_slots=rng.choice([2, 3, 4]), max_seq_len=128, prefill_chunk=rng.choice([3, 8]),
               prefill_budget=rng.choice([5, 16]), max_waiting=1000)
    alone = [asyncio.run(_gen_alone(item["req"])) if item["greedy"] else None for item in load]
    got, st, reused = asyncio.run(_gen_together(load, cfg))
    compared = 0
    for item, want, (how, choices) in zip(load, alone, got, strict=True):
        if how == "cancelled":
            continue
        assert sorted(choices) == list(range(item["req"].n))  # every choice ended
        for i, (text, ids, reason, completion, lps) in choices.items():
            assert reason in ("stop", "length", "timeout") and completion >= len(ids)
            if want is None:
                continue
            w_text, w_ids, w_reason, w_completion, w_lps = want[1][i]
            if reason == "timeout":  # cut short: what it gave is the start of its answer
                assert ids == w_ids[:len(ids)]
            else:
                assert (text, ids, reason, completion, lps) == (w_text, w_ids, w_reason, w_completion, w_lps)
                compared += 1
    assert compared > 0 and reused > 0
    assert (st.running, st.slots_used, st.waiting) == (0, 0, 0)
    assert st.requests_finished == len(load)


# --- translation ----------------------------------------------------------------------------------
def _tr_load(rng, max_slots):
    load = []
    for _ in range(rng.randint(4, 8)):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 3))]
        batch = SourceBatch(sources=[encode_source(TOK, s, rng.choice(["zh", "en"])) for s in sentences],
                            beam_size=rng.randint(1, min(4, max_slots)), length_penalty=rng.choice([1.0, 0.6]),
                            no_repeat_ngram=rng.choice([0, 3]), max_length=rng.choice([None, 4]))
        load.append(dict(batch=batch, delay=rng.choice([0, 0.002, 0.01]),
                         cancel=rng.choice([None] * 4 + [0.0, 0.005]), deadline=rng.choice([None] * 6 + [0.005])))
    return load


async def _tr_alone(batch):
    engine = TranslationEngine(SEQ2SEQ, EngineConfig(max_slots=8, max_seq_len=64))
    await engine.start()
    try:
        return await engine.run(batch)
    finally:
        await engine.stop()


async def _tr_together(load, cfg):
    engine = TranslationEngine(SEQ2SEQ, EngineConfig(**cfg))
    await engine.start()
    try:
        async def client(item):
            await asyncio.sleep(item["delay"])
            task = asyncio.ensure_future(engine.run(dataclasses.replace(item["batch"], deadline_s=item["deadline"])))
            if item["cancel"] is not None:
                await asyncio.sleep(item["cancel"])
                task.cancel()
            try:
                return await task
            except (asyncio.CancelledError, TimeoutError) as e:
                return type(e).__name__
        got = await asyncio.wait_for(asyncio.gather(*(client(item) for item in load)), 60)
        return got, await _settle(engine)
    finally:
        await engine.stop()


@pytest.mark.parametrize("seed", range(4))
def test_translation_under_mixed_load_equals_each_request_alone(seed):
    rng = random.Random(seed)
    cfg = dict(max_slots=rng.choice([3, 4, 6]), max_seq_len=64, max_waiting=1000)
    load = _tr_load(rng, cfg["max_slots"])
    alone = [asyncio.run(_tr_alone(item["batch"])) for item in load]
    got, st = asyncio.run(_tr_together(load, cfg))
    finished = [g for g in got if not isinstance(g, str)]
    assert finished and all(g == want for g, want in zip(got, alone, strict=True) if not isinstance(g, str))
    assert (st.running, st.slots_used, st.waiting) == (0, 0, 0)
    assert st.requests_finished == len(load)
