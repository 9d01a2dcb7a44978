"""TranslationEngine on a random tiny encoder-decoder: equals offline greedy/beam_search, alone or in
company; multi-text order; cancellation, overload, rejections."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from engine_util import CharTokenizer, EndsSink, FailOnce, tiny_seq2seq

from model.generate import beam_search, greedy
from model.punctuation import postprocess
from model.translation import encode_source, join_sentences, split_long
from service.engine.config import EngineConfig
from service.engine.hooks import StepHooks
from service.engine.translation import TranslationEngine
from service.engine.types import EngineOverloaded, RequestRejected, SourceBatch, TranslateRequest
from service.frontend.translator import TranslationFrontend

torch.set_num_threads(1)
TOK = CharTokenizer()
MODEL = tiny_seq2seq()
WORDS = "the cat sat on a mat while dogs ran far away from home and back again".split()


def translate(engine, req):
    """Through the translator's frontend, as a replica and the CLI build it."""
    return TranslationFrontend(engine, TOK).translate(req)


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))


def make_engine(**kw) -> TranslationEngine:
    cfg = dict(max_slots=24, max_waiting=256)
    cfg.update(kw)
    return TranslationEngine(MODEL, EngineConfig(**cfg))


def run(fn, **kw):
    async def main():
        engine = make_engine(**kw)
        await engine.start()
        try:
            return await fn(engine)
        finally:
            await engine.stop()
    return asyncio.run(main())


def offline(texts, beam):
    srcs = [encode_source(TOK, t, "zh") for t in texts]
    if beam == 1:
        return [TOK.decode(h) for h in greedy(MODEL, srcs)]
    return [TOK.decode(h[0].tokens) for h in beam_search(MODEL, srcs, beam_size=beam)]


TEXTS = ["the cat sat on a mat", "dogs ran far", "home", "and back again while the cat ran away"]


@pytest.mark.parametrize("beam", [1, 4])
def test_engine_equals_offline_alone_and_in_company(beam):
    expected = offline(TEXTS, beam)
    assert len(set(expected)) > 1 and all(expected)

    alone = run(lambda e: translate(e, TranslateRequest(TEXTS, target_lang="zh", beam_size=beam)))
    assert alone.translations == expected
    assert alone.target_langs == ["zh"] * 4 and alone.source_langs == ["en"] * 4

    async def company(engine):
        rng = random.Random(5)
        others = [TranslateRequest([sentence(rng) for _ in range(rng.randint(1, 3))], target_lang="zh",
                                   beam_size=rng.choice([1, 2, 4])) for _ in range(15)]

        async def late(req, steps):
            while engine.steps < steps:
                await asyncio.sleep(0.0005)
            return await translate(engine, req)

        tasks = [asyncio.create_task(late(r, i)) for i, r in enumerate(others)]
        while engine.steps < 2:
            await asyncio.sleep(0.0005)
        result = await translate(engine, TranslateRequest(TEXTS, target_lang="zh", beam_size=beam))
        other_results = await asyncio.gather(*tasks)
        for r, res in zip(others, other_results, strict=True):  # company is right too
            assert res.translations == offline(r.texts, r.beam_size)
        return result

    assert run(company, max_slots=24).translations == expected


def test_hypotheses_are_compacted_into_the_lowest_slots():
    """Hypotheses that outlive their neighbours move down (self and cross K/V copied), so every step's
    rows are slots [0, R) and the cache reads views; outputs (greedy and beam) are unchanged."""
    seen = {"steps": 0, "moves": 0, "holes": 0}
    rng = random.Random(11)
    reqs = [TranslateRequest([sentence(rng)], target_lang="zh", beam_size=rng.choice([1, 2, 3])) for _ in range(20)]

    class Check(StepHooks):
        def on_plan(self, p):  # record, never raise: an exception here would end the engine loop
            slots = sorted(s for it in p.sentences for s in it.slots)
            seen["holes"] += slots != list(range(len(slots)))
            seen["steps"] += 1
            seen["moves"] += len(p.moves)

    async def main(engine):
        engine.hooks = Check()
        return await asyncio.gather(*(translate(engine, r) for r in reqs))

    results = run(main, max_slots=12)
    assert seen["holes"] == 0 and seen["moves"] > 0 and seen["steps"] > 0
    for r, res in zip(reqs, results, strict=True):
        assert res.translations == offline(r.texts, r.beam_size)


def test_static_and_serial_modes_agree():
    expected = offline(TEXTS, 2)
    for mode in ("static", "serial"):
        res = run(lambda e: translate(e, TranslateRequest(TEXTS, target_lang="zh", beam_size=2)), mode=mode)
        assert res.translations == expected


def test_empty_text_kept_in_place():
    res = run(lambda e: translate(e, TranslateRequest(["", "the cat", "  "], target_lang="zh", beam_size=1)))
    assert res.translations[0] == "" and res.translations[2] == ""
    assert res.translations[1] == offline(["the cat"], 1)[0]


async def cancel_once_running(engine) -> None:
    """A request of many sentences, cancelled by its client once it holds slots; returns once the engine has
    dropped it (or after ~1 s)."""
    task = asyncio.create_task(translate(engine, TranslateRequest(TEXTS * 3, target_lang="zh", beam_size=2)))
    while engine.stats().slots_used == 0:
        await asyncio.sleep(0.0005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if engine.stats().slots_used == 0 and engine.stats().waiting == 0:
            break
        await asyncio.sleep(0.005)


def test_cancellation_frees_slots():
    async def main(engine):
        await cancel_once_running(engine)
        return engine.stats()
    st = run(main)
    assert st.slots_used == 0 and st.running == 0 and st.waiting == 0


@pytest.mark.parametrize("beam", [1, 4])
def test_survivors_are_unchanged_when_company_is_cancelled(beam):
    """Cancelled requests free slots mid-decode; survivors move into them and must decode as if alone."""
    expected = offline(TEXTS, beam)
    seen = {"moves": 0}

    class Count(StepHooks):
        def on_plan(self, p):
            seen["moves"] += bool(p.moves)

    async def main(engine):
        engine.hooks = Count()
        rng = random.Random(7)
        others = [TranslateRequest([sentence(rng) for _ in range(rng.randint(1, 3))], target_lang="zh",
                                   beam_size=rng.choice([1, 2, 4])) for _ in range(12)]
        tasks = [asyncio.create_task(translate(engine, r)) for r in others]
        mine = asyncio.create_task(translate(engine, TranslateRequest(TEXTS, target_lang="zh", beam_size=beam)))
        while engine.steps < 3:
            await asyncio.sleep(0.0005)
        for t in tasks[::2]:
            t.cancel()
        result = await mine
        kept = await asyncio.gather(*tasks[1::2])
        for r, res in zip(others[1::2], kept, strict=True):
            assert res.translations == offline(r.texts, r.beam_size)
        return result

    assert run(main, max_slots=48).translations == expected
    assert seen["moves"] > 0  # survivors did move into freed slots


def test_overload_and_rejections():
    async def main(engine):
        with pytest.raises(RequestRejected, match="beam_size"):
            await translate(engine, TranslateRequest(["a"], beam_size=99))
        with pytest.raises(RequestRejected, match="target_lang"):
            await translate(engine, TranslateRequest(["a"], target_lang="fr"))
        # the bounds /v1/translate and the CLI take (model/translation.py), named by the rejection
        for option, value in (("min_length_ratio", -1.0), ("length_penalty", 2.5), ("no_repeat_ngram", 17)):
            with pytest.raises(RequestRejected, match=option) as e:
                await translate(engine, TranslateRequest(["a"], **{option: value}))
            assert e.value.param == option
        # the client's names of the fields, where they differ from ours, are the ones its rejections give
        names = {"beam_size": "--beam", "length_penalty": "--alpha", "source_lang": "--from", "target_lang": "--to"}
        for fields, message in (({"beam_size": 99}, "--beam must be in [1, "),
                                ({"length_penalty": 2.5}, "--alpha must be in [0.0, 2.0], got 2.5"),
                                ({"target_lang": "fr"}, "--to must be one of ['en', 'zh'], got 'fr'"),
                                ({"target_lang": "{}"}, "--to must be one of ['en', 'zh'], got '{}'"),
                                ({"source_lang": "en", "target_lang": "en"}, "--to must differ from --from")):
            with pytest.raises(RequestRejected) as e:
                await translate(engine, TranslateRequest(["a"], field_names=names, **fields))
            assert str(e.value).startswith(message) and e.value.param == message.split()[0], str(e.value)
        # a request arriving while the queue has room is queued whole, however many sentences it has: more
        # than the free slots + max_waiting is no reason to refuse it (the CLI sends the same texts one by one)
        first = asyncio.create_task(translate(engine, TranslateRequest(["the cat"] * 9, target_lang="zh",
                                                                       beam_size=1)))
        await asyncio.sleep(0)  # `first` queues its sentences; the engine has not planned since
        with pytest.raises(EngineOverloaded):  # 5 wait beyond the 4 free slots, past the bound: 429 until it drains
            await translate(engine, TranslateRequest(["a dog"], target_lang="zh", beam_size=1))
        assert len((await first).translations) == 9
        return (await translate(engine, TranslateRequest(["the cat"] * 4, target_lang="zh"))).translations
    assert len(run(main, max_slots=4, max_waiting=2)) == 4


def test_slots_without_a_position_for_an_output_token_are_refused_when_built():
    """One target position holds only the start token: every beam request would fail its step (a 500), so
    such an engine is refused when it is built, with the setting named; two positions translate."""
    with pytest.raises(ValueError, match="max_seq_len 1 .* leave 1"):
        make_engine(max_slots=2, max_seq_len=1)
    src = encode_source(TOK, "the cat", "zh")
    out = run(lambda e: e.run(SourceBatch([src, src], beam_size=2)), max_slots=4, max_seq_len=2)
    assert [len(o) for o in out] == [1, 1]


def test_no_slot_leaks_with_random_cancellations():
    async def main(engine):
        rng = random.Random(2)

        async def client(i):
            req = TranslateRequest([sentence(rng) for _ in range(rng.randint(1, 3))], target_lang="zh",
                                   beam_size=rng.choice([1, 2, 3]))
            task = asyncio.create_task(translate(engine, req))
            if rng.random() < 0.3:
                await asyncio.sleep(rng.random() * 0.01)
                task.cancel()
            try:
                await task
                return "ok"
            except asyncio.CancelledError:
                return "cancelled"

        out = await asyncio.gather(*(client(i) for i in range(150)))
        for _ in range(200):
            if engine.stats().slots_used == 0:
                break
            await asyncio.sleep(0.005)
        return out, engine.stats()
    out, st = run(main, max_slots=8, max_waiting=1000)
    assert st.slots_used == 0 and st.running == 0 and st.waiting == 0
    assert "ok" in out and "cancelled" in out


def test_a_request_of_many_sentences_takes_turns_with_the_next_request():
    """Waiting requests take turns for free slots, one sentence each: a one-sentence request that arrives
    behind one of 20 sentences is done long before it, not after it."""
    async def main(engine):
        done_at = {}

        async def timed(name, texts):
            out = await translate(engine, TranslateRequest(texts, target_lang="zh", beam_size=1))
            done_at[name] = engine.steps
            return out

        big = asyncio.create_task(timed("big", ["the cat sat on a mat"] * 20))
        await asyncio.sleep(0)  # queued whole before the next one arrives
        small = await timed("small", ["dogs ran far"])
        assert not big.done()
        assert len((await big).translations) == 20 and len(small.translations) == 1
        return done_at
    done_at = run(main, max_slots=2)
    assert done_at["small"] * 4 < done_at["big"]  # first come first served: small would end with big


def test_multi_sentence_text_is_split_and_reassembled_in_order():
    parts = ["the cat sat on a mat.", "Dogs ran far!", "Home and back again?"]
    expected = offline(parts, 4)

    async def main(engine):
        return await translate(engine, TranslateRequest(texts=[" ".join(parts), "home"], target_lang="zh",
                                                       beam_size=4))
    res = run(main)
    assert res.translations[0] == "".join(expected)  # zh output: sentences joined without spaces
    assert res.translations[1] == offline(["home"], 4)[0]
    assert res.usage.prompt_tokens == sum(len(encode_source(TOK, t, "zh")) for t in parts + ["home"])


def test_beam_reorder_keeps_each_hypothesis_with_its_parents_cache_in_the_fewest_copies():
    from service.engine.beam import reassign_slots

    rng = random.Random(5)
    for _ in range(500):
        k = rng.randint(2, 6)
        slots = rng.sample(range(40), k)
        parents = [rng.randrange(k) for _ in range(k)]
        cache = {s: f"kv of hypothesis {i}" for i, s in enumerate(slots)}  # what each slot holds
        new, copies = reassign_slots(slots, parents)
        assert sorted(new) == sorted(slots)  # a permutation of the item's own slots
        assert len(copies) == k - len(set(parents))  # one copy per child beyond each parent's first
        before = dict(cache)
        for src, dst in copies:  # copy_slots gathers every source before writing
            cache[dst] = before[src]
        assert [cache[s] for s in new] == [f"kv of hypothesis {p}" for p in parents]
    # a pure permutation of the hypotheses (ranks swapped) costs no copy at all
    assert reassign_slots([7, 3, 9], [2, 0, 1]) == ([9, 7, 3], [])


def test_lines_kept_and_what_needs_no_translation_passes_through():
    text = "the cat sat.\n\n😀 \n你好，世界。\nDogs ran far!"
    want = [offline(["the cat sat."], 1)[0], "", "😀", "你好，世界。", offline(["Dogs ran far!"], 1)[0]]

    async def main(engine):
        return await translate(engine, TranslateRequest([text], target_lang="zh", beam_size=1))
    res = run(main)
    assert res.translations == ["\n".join(want)]
    assert res.usage.prompt_tokens == sum(len(encode_source(TOK, t, "zh")) for t in ("the cat sat.", "Dogs ran far!"))


def test_an_overlong_sentence_is_cut_at_clauses_and_translated_in_pieces():
    clause = "the cat sat on a mat while dogs ran far away"
    text = f"{clause}, {clause}; {clause}"  # one sentence of 136 tokens; the engine takes 62
    pieces = split_long(text, lambda s: len(encode_source(TOK, s, "zh")) <= 64)
    assert pieces == [f"{clause},", f"{clause};", clause]

    async def main(engine):
        return await translate(engine, TranslateRequest([text, "a" * 100], target_lang="zh", beam_size=1))
    res = run(main)
    assert res.translations == ["".join(offline(pieces, 1)), "".join(offline(["a" * 50] * 2, 1))]


def test_what_passes_through_is_not_cut_to_the_models_length():
    """A piece passed through never reaches the model: cut to fit it anyway, a long token (a key, a hash) came
    back with spaces inside it."""
    key = "Qm9vayBvZiBrZXlz" * 10  # 160 characters and no space: beyond the engine's 62 tokens
    text = f"The key is {key} ok."

    async def main(engine):
        return await translate(engine, TranslateRequest([text, key], target_lang="en", beam_size=1))
    res = run(main)
    assert res.translations == [text, key]
    assert res.usage.prompt_tokens == 0  # nothing reached the model


def test_urls_and_addresses_pass_through_as_they_are():
    text = "the cat sat on https://example.com/a_b?c=1 and mail a.b@example.com now."

    async def main(engine):
        return await translate(engine, TranslateRequest([text], target_lang="zh", beam_size=1))
    want = [offline(["the cat sat on"], 1)[0], "https://example.com/a_b?c=1", offline(["and mail"], 1)[0],
            "a.b@example.com", offline(["now."], 1)[0]]
    assert run(main).translations == [join_sentences(want, "zh")]  # a space keeps a link off ASCII next to it


def test_emoji_inside_a_sentence_pass_through_in_place_and_never_reach_the_model():
    """The vocabulary hardly holds emoji: sent to the model inside a sentence, they came back as words, or not
    at all. The text on either side of a run is translated as a piece of its own."""
    text = "the cat sat \U0001F600 dogs ran far \U0001F44D, the end."

    async def main(engine):
        return await translate(engine, TranslateRequest([text], target_lang="zh", beam_size=1))
    res = run(main)
    want = [offline(["the cat sat"], 1)[0], "\U0001F600", offline(["dogs ran far"], 1)[0], "\U0001F44D,",
            offline(["the end."], 1)[0]]
    assert res.translations == [postprocess(join_sentences(want, "zh"), "zh")]
    assert res.usage.prompt_tokens == sum(len(encode_source(TOK, t, "zh"))
                                          for t in ("the cat sat", "dogs ran far", "the end."))


def test_a_failed_step_fails_its_requests_with_an_engine_error_counted_once():
    """As in the generation engine: the step's requests get an EngineError naming the engine (the HTTP layer's
    500 carries it), each counted once as an error, and the engine serves the next request."""
    from service.engine.types import EngineError

    async def main(engine):
        engine.hooks, engine.sink = FailOnce("step_started", "kernel fault"), EndsSink()
        with pytest.raises(EngineError, match="step failed: RuntimeError: kernel fault"):
            await asyncio.wait_for(translate(engine, TranslateRequest(texts=TEXTS[:2], target_lang="zh")), 60)
        ok = await asyncio.wait_for(translate(engine, TranslateRequest(texts=TEXTS[:1], target_lang="zh")), 60)
        return ok, engine.sink.reasons

    ok, reasons = run(main)
    assert len(ok.translations) == 1 and reasons == ["error", "stop"]


def test_every_request_is_counted_once_with_how_it_ended():
    """Finished requests by reason, as vLLM counts them: a translation that completes, one past its deadline and
    one whose client went away each count once, with their reason, in the sink and the engine's stats."""
    async def main(engine):
        engine.sink = EndsSink()
        await translate(engine, TranslateRequest(TEXTS[:1], target_lang="zh"))
        with pytest.raises(TimeoutError):
            await translate(engine, TranslateRequest(TEXTS[:2], target_lang="zh", deadline_s=0.0))
        await cancel_once_running(engine)
        return engine.sink.reasons, engine.stats().requests_finished

    reasons, finished = run(main)
    assert reasons == ["stop", "timeout", "cancelled"] and finished == 3


def test_stop_counts_each_pending_request_once_with_how_it_ended():
    """Requests still running or waiting when the engine stops end with EngineStopped and are counted once each
    as an "error" (as a failed step's are), a request of many sentences once; one whose client already left
    counts as "cancelled"."""
    from service.engine.types import EngineStopped

    async def main():
        engine = make_engine(max_slots=2)
        engine.sink = EndsSink()
        await engine.start()
        # many sentences: some running, the rest waiting, for more steps than the stop lets run
        tasks = [asyncio.create_task(translate(engine, TranslateRequest(texts, target_lang="zh", beam_size=1)))
                 for texts in (TEXTS * 5, TEXTS[:1], TEXTS[1:2])]
        while engine.stats().slots_used == 0:
            await asyncio.sleep(0.0005)
        tasks[2].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[2]
        await engine.stop()
        for task in tasks[:2]:
            with pytest.raises(EngineStopped):
                await task
        return engine.sink.reasons, engine.stats()

    reasons, stats = asyncio.run(main())
    assert sorted(reasons) == ["cancelled", "error", "error"]
    assert stats.requests_finished == 3 and stats.running == stats.waiting == stats.slots_used == 0
