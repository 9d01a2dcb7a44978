"""The compile-friendly steps (model/seq2seq_step.py, model/decoder_step.py) equal the general paths,
and the engines with `compile=True` (service/engine/compiled.py) answer exactly as eagerly, without
recompiling as batches change shape."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from engine_util import CharTokenizer, tiny_llama, tiny_seq2seq

from model.decoder_step import decoder_step
from model.generate import beam_search, greedy
from model.seq2seq_step import decode_step, encode_cross
from model.translation import encode_source
from service.engine.compiled import CompiledTranslator
from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.translation import TranslationEngine
from service.engine.types import GenerateRequest, SamplingParams, TranslateRequest
from service.frontend.translator import TranslationFrontend

torch.set_num_threads(1)
TOK = CharTokenizer()
MODEL = tiny_seq2seq()


def translate(engine, req):
    """Through the translator's frontend, as a replica and the CLI build it."""
    return TranslationFrontend(engine, TOK).translate(req)


def _sources(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 12, (n,), generator=g)
    src = torch.randint(4, MODEL.cfg.vocab_size, (n, int(lengths.max())), generator=g)
    mask = torch.arange(src.shape[1])[None, :] < lengths[:, None]
    return src.masked_fill(~mask, MODEL.cfg.pad_id), mask


@torch.inference_mode()
def test_decode_step_equals_decode_over_ragged_rows():
    src, mask = _sources(5, 0)
    general, stepped = MODEL.new_cache(8, 32), MODEL.new_cache(8, 32)
    memory = MODEL.encode(src, mask)
    for cache in (general, stepped):
        MODEL.set_cross(memory, mask, cache, list(range(5)))
    start = torch.tensor([0, 4, 1, 0, 7])  # rows at different positions, as in a continuous batch
    tokens = torch.randint(4, MODEL.cfg.vocab_size, (5,), generator=torch.Generator().manual_seed(1))
    for t in range(9):
        positions = start + t
        ref = MODEL.decode(tokens[:, None], positions[:, None], general, list(range(5)))[:, -1]  # (R, V)
        k, v, ck, cv, src_len = stepped.prefix_views(5, int(positions.max()) + 3, src.shape[1])  # extra keys masked
        logits, new_k, new_v = decode_step(MODEL, tokens, positions, k, v, ck, cv, src_len)
        stepped.write_step(new_k, new_v, positions)
        # the step's attention kernel (C++) sums in another order than the general path's matmuls
        torch.testing.assert_close(logits, ref, atol=5e-5, rtol=5e-5)
        tokens = ref.argmax(-1)
    for row, pos in enumerate((start + 8).tolist()):  # the cache holds the same keys at every written position
        torch.testing.assert_close(stepped.k[:, row, :, :pos + 1], general.k[:, row, :, :pos + 1],
                                   atol=5e-5, rtol=5e-5)


@torch.inference_mode()
def test_encode_cross_equals_encoder_and_cross_projection():
    src, mask = _sources(3, 2)
    ck, cv = encode_cross(MODEL, src, mask)  # (NL, N, H, S, D)
    memory = MODEL.encode(src, mask)
    for i, layer in enumerate(MODEL.decoder):
        k, v = layer.cross_attn.project_kv(memory)
        torch.testing.assert_close(ck[i], k)
        torch.testing.assert_close(cv[i], v)
    cache = MODEL.new_cache(6, 8)
    cache.set_cross_all(torch.tensor([4, 1, 2]), ck, cv, mask.sum(-1))
    assert cache.src_len.tolist() == [0, mask[1].sum().item(), mask[2].sum().item(), 0, mask[0].sum().item(), 0]
    torch.testing.assert_close(cache.cross_k[:, 4, :, :src.shape[1]], ck[:, 0])


WORDS = "the cat sat on a mat while dogs ran far away from home and back again".split()
TEXTS = ["the cat sat on a mat", "dogs ran far", "home", "and back again while the cat ran away"]


def offline(texts, beam):
    """Plain argmax / beam rules (no_repeat_ngram 0): with it, a banned token's runner-up can be a near tie
    that compiled and eager kernels round differently, which is not what this file tests."""
    srcs = [encode_source(TOK, t, "zh") for t in texts]
    if beam == 1:
        return [TOK.decode(h) for h in greedy(MODEL, srcs, no_repeat_ngram=0)]
    return [TOK.decode(h[0].tokens) for h in beam_search(MODEL, srcs, beam_size=beam, no_repeat_ngram=0)]


def test_compiled_engine_translates_as_offline_without_recompiling():
    from torch._dynamo.utils import counters

    rng = random.Random(3)
    company = [[" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 3))]
               for _ in range(12)]
    beams = [rng.choice([1, 2, 4]) for _ in company]
    expected = {b: offline(TEXTS, b) for b in (1, 4)}
    expected_company = [offline(t, b) for t, b in zip(company, beams, strict=True)]

    async def main():
        engine = TranslationEngine(MODEL, EngineConfig(max_slots=24, max_waiting=256, compile=True))
        await engine.start()
        try:
            assert engine.compiled is not None, "compilation failed (see the warning in the log)"
            graphs = counters["stats"]["unique_graphs"]
            alone = [await translate(engine, TranslateRequest(TEXTS, target_lang="zh", beam_size=b, no_repeat_ngram=0))
                     for b in (1, 4)]
            # one row, one source
            single = await translate(engine, TranslateRequest(["cat"], target_lang="zh", no_repeat_ngram=0))
            mixed = await asyncio.gather(
                translate(engine, TranslateRequest(TEXTS, target_lang="zh", beam_size=4, no_repeat_ngram=0)),
                *(translate(engine, TranslateRequest(t, target_lang="zh", beam_size=b, no_repeat_ngram=0))
                  for t, b in zip(company, beams, strict=True)))
            return alone, single, mixed, counters["stats"]["unique_graphs"] - graphs, engine.stats().slots_used
        finally:
            await engine.stop()

    alone, single, mixed, new_graphs, used = asyncio.run(main())
    assert [r.translations for r in alone] == [expected[1], expected[4]]
    assert single.translations == offline(["cat"], 1)
    assert mixed[0].translations == expected[4]
    assert [r.translations for r in mixed[1:]] == expected_company
    assert new_graphs == 0, "a batch shape recompiled the graphs while serving"
    assert used == 0


@torch.inference_mode()
def test_decoder_step_equals_forward_over_ragged_rows():
    lm = tiny_llama()
    general, stepped = lm.new_cache(8, 64), lm.new_cache(8, 64)
    g = torch.Generator().manual_seed(4)
    start = torch.tensor([3, 9, 1, 6, 12])  # prompts of different lengths, prefilled by the general path
    for cache in (general, stepped):
        for slot, n in enumerate(start.tolist()):
            lm(torch.randint(4, lm.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(slot)),
               torch.arange(n)[None], cache, [slot])
    tokens = torch.randint(4, lm.cfg.vocab_size, (5,), generator=g)
    for t in range(7):
        positions = start + t
        ref = lm(tokens[:, None], positions[:, None], general, list(range(5)))[:, -1]  # (R, V)
        k, v = stepped.prefix_views(5, int(positions.max()) + 2)  # extra keys are masked
        logits, new_k, new_v = decoder_step(lm, tokens, positions, k, v)
        # the step's view is longer (masked keys past each row's last): its sums run in another order
        torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-5)
        stepped.write_step(new_k, new_v, positions, rows=torch.tensor([0, 1, 2, 3, 4]))
        tokens = ref.argmax(-1)
    for row, pos in enumerate((start + 6).tolist()):
        torch.testing.assert_close(stepped.v[:, row, :, :pos + 1], general.v[:, row, :, :pos + 1])


def test_compiled_generation_engine_matches_eager_alone_and_in_company():
    from torch._dynamo.utils import counters

    rng = random.Random(11)
    reqs = [GenerateRequest(prompt_ids=[rng.randrange(5, TOK.vocab_size) for _ in range(rng.randint(1, 30))],
                            params=SamplingParams(max_new_tokens=rng.randint(1, 25), temperature=rng.choice([0, 1]),
                                                  seed=rng.randint(0, 99), ignore_eos=True))
            for _ in range(12)]

    async def collect(engine, req):
        ids = []
        async for ev in engine.submit(req):
            ids += ev.token_ids
        return ids

    def serve(compile_: bool):
        async def main():
            engine = GenerationEngine(tiny_llama(), TOK, EngineConfig(max_slots=8, max_seq_len=128, prefill_chunk=8,
                                                                      prefill_budget=24, compile=compile_),
                                      eos_ids={TOK.eos_id})
            await engine.start()
            try:
                assert (engine.compiled is not None) == compile_, "compilation failed (see the log)"
                graphs = counters["stats"]["unique_graphs"]
                alone = [await collect(engine, r) for r in reqs[:2]]  # one row: a pad row joins it
                together = await asyncio.gather(*(collect(engine, r) for r in reqs))  # queued, prefilling
                return alone, together, counters["stats"]["unique_graphs"] - graphs, engine.stats().slots_used
            finally:
                await engine.stop()
        return asyncio.run(main())

    eager, compiled = serve(False), serve(True)
    assert compiled[0] == eager[0] and compiled[1] == eager[1]
    assert sum(len(ids) for ids in eager[1]) > 60
    assert compiled[2] == 0, "a batch shape recompiled the graph while serving"
    assert compiled[3] == 0


@pytest.mark.parametrize("engine_type", ["translation", "generation"])
def test_a_compiled_engine_of_one_slot(engine_type):
    """The steps are exported at sizes below the cache's and >= 2, so a cache needs 3 slots: an engine of one
    gets spare ones it never hands out, compiles, and answers queued requests one at a time as eagerly."""
    with pytest.raises(ValueError, match="slots"):
        CompiledTranslator(MODEL, MODEL.new_cache(2, max_len=32, cross_len=16))

    async def run(engine):
        await engine.start()
        try:
            if engine_type == "translation":
                req = TranslateRequest(TEXTS, target_lang="zh", beam_size=1, no_repeat_ngram=0)
                return engine.compiled, (await translate(engine, req)).translations, engine.runner.cache.n_slots
            reqs = [GenerateRequest(prompt_ids=[5 + i, 9, 7], params=SamplingParams(max_new_tokens=6, ignore_eos=True))
                    for i in range(3)]
            outs = await asyncio.gather(*(_ids(engine, r) for r in reqs))
            return engine.compiled, outs, engine.runner.cache.n_slots
        finally:
            await engine.stop()

    def serve(compile_: bool):
        cfg = EngineConfig(max_slots=1, max_seq_len=64, compile=compile_)
        engine = (TranslationEngine(MODEL, cfg) if engine_type == "translation"
                  else GenerationEngine(tiny_llama(), TOK, cfg, eos_ids={TOK.eos_id}))
        return asyncio.run(run(engine))

    compiled, answers, cache_slots = serve(True)
    assert compiled is not None, "compilation failed (see the warning in the log)"
    assert cache_slots == 3
    eager, eager_answers, eager_slots = serve(False)
    assert eager is None and eager_slots == 1 and answers == eager_answers
    if engine_type == "translation":
        assert answers == offline(TEXTS, 1)


async def _ids(engine, req) -> list[int]:
    ids = []
    async for ev in engine.submit(req):
        ids += ev.token_ids
    return ids


def test_a_failed_compile_falls_back_to_eager(monkeypatch, caplog):
    def broken(self):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(CompiledTranslator, "warm_up", broken)

    async def main():
        engine = TranslationEngine(MODEL, EngineConfig(max_slots=4, compile=True))
        await engine.start()
        try:
            req = TranslateRequest(TEXTS[:2], target_lang="zh", beam_size=1, no_repeat_ngram=0)
            return engine.compiled, await translate(engine, req)
        finally:
            await engine.stop()

    compiled, result = asyncio.run(main())
    assert compiled is None and result.translations == offline(TEXTS[:2], 1)
    assert "compiling its steps failed; running eagerly" in caplog.text


@torch.inference_mode()
@pytest.mark.parametrize("which", ["decoder", "seq2seq"])
def test_steps_with_a_wider_cache_than_the_weights(which):
    """kv_dtype float32 under bf16 weights: the steps attend in the cache's dtype, as the general path."""
    model = (tiny_llama() if which == "decoder" else tiny_seq2seq()).to(torch.bfloat16)
    general, stepped = model.new_cache(4, 32, dtype=torch.float32), model.new_cache(4, 32, dtype=torch.float32)
    g = torch.Generator().manual_seed(6)
    if which == "seq2seq":
        src, mask = _sources(3, 7)
        memory = model.encode(src, mask)
        for cache in (general, stepped):
            model.set_cross(memory, mask, cache, list(range(3)))
    tokens = torch.randint(4, model.cfg.vocab_size, (3,), generator=g)
    for t in range(5):
        positions = torch.tensor([t, t + 2, t + 1])
        if which == "decoder":
            ref = model(tokens[:, None], positions[:, None], general, list(range(3)))[:, -1]
            k, v = stepped.prefix_views(3, int(positions.max()))
            logits, new_k, new_v = decoder_step(model, tokens, positions, k, v)
        else:
            ref = model.decode(tokens[:, None], positions[:, None], general, list(range(3)))[:, -1]
            k, v, ck, cv, src_len = stepped.prefix_views(3, int(positions.max()), src.shape[1])
            logits, new_k, new_v = decode_step(model, tokens, positions, k, v, ck, cv, src_len)
        assert new_k.dtype == torch.float32
        stepped.write_step(new_k, new_v, positions)
        torch.testing.assert_close(logits.float(), ref.float(), atol=0.1, rtol=0.05)
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))
        tokens = ref.argmax(-1)


def test_decode_prefix_length_repeats_across_steps_and_stays_in_the_cache():
    """A decode step reads its rows' prefix rounded up (the extra keys are masked), so consecutive steps
    share shapes (oneDNN's primitive cache hits), and never more than the cache holds."""
    from service.engine.compiled import LENGTH_STEP, MIN_SIZE, prefix_length

    assert {prefix_length([p], 2047) for p in range(LENGTH_STEP + 1, 2 * LENGTH_STEP + 1)} == {2 * LENGTH_STEP}
    assert prefix_length([3, LENGTH_STEP + 1], 2047) == 2 * LENGTH_STEP  # the longest row sets it
    assert prefix_length([0, 0], 2047) == MIN_SIZE
    assert prefix_length([2040], 2047) == 2047 and prefix_length([40], 47) == 47
