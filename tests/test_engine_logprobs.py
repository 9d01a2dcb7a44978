"""GenerationEngine log-probabilities: sampled and prompt tokens agree with a full forward of the model
(fp32, 1e-4), whatever the batch company and prefill chunking; only the rows that ask compute them."""

from __future__ import annotations

import asyncio
import random

import torch
from engine_util import CharTokenizer, run_engine, tiny_llama

from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.types import GenerateRequest, SamplingParams

torch.set_num_threads(1)
TOK = CharTokenizer()
TOL = 1e-4


def make_engine(**kw) -> GenerationEngine:
    cfg = dict(max_slots=8, max_seq_len=128, prefill_chunk=8, prefill_budget=24)
    cfg.update(kw)
    return GenerationEngine(tiny_llama(), TOK, EngineConfig(**cfg), eos_ids={TOK.eos_id})


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, TOK.vocab_size) for _ in range(n)]


async def events(engine, req) -> list:
    return [ev async for ev in engine.submit(req)]


def run(coro_fn, **kw):
    return run_engine(make_engine(**kw), coro_fn)


def reference(ids: list[int]) -> torch.Tensor:
    """Log-probabilities at every position of `ids` from one cache-free forward: (T, V)."""
    with torch.no_grad():
        return torch.log_softmax(tiny_llama()(torch.tensor([ids])).float()[0], -1)


def check(entry, ref_row: torch.Tensor, k: int) -> None:
    assert abs(entry.logprob - ref_row[entry.token_id].item()) < TOL
    assert len(entry.top) == k
    want = ref_row.topk(k)
    for (tid, lp), v in zip(entry.top, want.values.tolist(), strict=True):
        assert abs(lp - v) < TOL and abs(ref_row[tid].item() - v) < TOL


def test_sampled_logprobs_match_a_full_forward_in_any_company():
    rng = random.Random(3)
    target_prompt = prompt(rng, 21)
    # sampled with temperature and penalties: the logprobs are still the model's own distribution
    asks = [SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3),
            SamplingParams(max_new_tokens=12, temperature=1.3, seed=4, ignore_eos=True, logprobs=5,
                           presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2,
                           logit_bias={7: 5.0})]
    company = [GenerateRequest(prompt_ids=prompt(rng, rng.randint(3, 30)),
                               params=SamplingParams(max_new_tokens=rng.randint(2, 15), temperature=1.0,
                                                     seed=i, ignore_eos=True))
               for i in range(5)]

    async def main(engine):
        tasks = [asyncio.create_task(events(engine, r)) for r in company]
        outs = await asyncio.gather(*[events(engine, GenerateRequest(prompt_ids=target_prompt, params=p))
                                      for p in asks])
        for evs in await asyncio.gather(*tasks):
            assert all(e.logprobs is None and e.cumulative_logprob is None for e in evs)
        return outs

    for p, evs in zip(asks, run(main), strict=True):
        ids = [t for e in evs for t in e.token_ids]
        entries = [lp for e in evs for lp in (e.logprobs or [])]
        assert len(ids) == len(entries) == 12 and [e.token_id for e in entries] == ids
        ref = reference(target_prompt + ids)
        n = len(target_prompt)
        for j, entry in enumerate(entries):
            check(entry, ref[n - 1 + j], p.logprobs)
        assert abs(evs[-1].cumulative_logprob - sum(e.logprob for e in entries)) < TOL


def test_prompt_logprobs_chunked_and_scoring_only():
    p_ids = prompt(random.Random(5), 30)  # prefilled in chunks of 8

    async def main(engine):
        scored = await events(engine, GenerateRequest(
            prompt_ids=p_ids, params=SamplingParams(max_new_tokens=0, prompt_logprobs=2)))
        both = await events(engine, GenerateRequest(
            prompt_ids=p_ids, params=SamplingParams(max_new_tokens=3, temperature=0.0, prompt_logprobs=0,
                                                    logprobs=1, ignore_eos=True)))
        return scored, both

    scored, both = run(main)
    ref = reference(p_ids)
    first = scored[0]
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(p_ids)
    for j, entry in enumerate(first.prompt_logprobs[1:], start=1):
        assert entry.token_id == p_ids[j]
        check(entry, ref[j - 1], 2)
    last = scored[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 0 and not last.token_ids
    assert [e.token_id for e in both[0].prompt_logprobs[1:]] == p_ids[1:]
    assert all(e.top == [] for e in both[0].prompt_logprobs[1:])
    assert [t for e in both for t in e.token_ids] == [lp.token_id for e in both for lp in (e.logprobs or [])]


def test_a_prompt_that_fills_the_context_can_be_scored():
    """Scoring writes no token: a prompt of the whole context (a perplexity window) was refused as if it
    had to leave room for one."""
    p_ids = prompt(random.Random(6), 64)

    async def main(engine):
        return await events(engine, GenerateRequest(
            prompt_ids=p_ids, params=SamplingParams(max_new_tokens=0, prompt_logprobs=0)))

    evs = run(main, max_seq_len=64)
    ref = reference(p_ids)
    assert len(evs[0].prompt_logprobs) == 64 and evs[-1].usage.completion_tokens == 0
    for j, entry in enumerate(evs[0].prompt_logprobs[1:], start=1):
        check(entry, ref[j - 1], 0)


def test_only_rows_that_ask_pay_for_log_softmax(monkeypatch):
    rows_seen = []
    real = torch.log_softmax

    def spy(x, *a, **kw):
        rows_seen.append(x.shape[0])
        return real(x, *a, **kw)

    monkeypatch.setattr(torch, "log_softmax", spy)
    rng = random.Random(9)

    async def main(engine):
        reqs = [GenerateRequest(prompt_ids=prompt(rng, 6), params=SamplingParams(
            max_new_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2 if i == 0 else None)) for i in range(4)]
        return await asyncio.gather(*[events(engine, r) for r in reqs])

    outs = run(main)
    assert rows_seen and max(rows_seen) == 1  # one row asked; the three others never entered a log_softmax
    assert all(e.logprobs for e in outs[0] if e.token_ids)
