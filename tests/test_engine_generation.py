"""GenerationEngine on a random tiny Llama: batch invariance, seeds, stops, cancellation, limits."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import torch
from engine_util import CharTokenizer, EndsSink, FailOnce, run_engine, tiny_llama

from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.hooks import StepHooks
from service.engine.stats import MetricsSink
from service.engine.types import (
    EngineError,
    EngineOverloaded,
    EngineStopped,
    GenerateRequest,
    RequestRejected,
    SamplingParams,
)

torch.set_num_threads(1)
TOK = CharTokenizer()


def make_engine(**kw) -> GenerationEngine:
    cfg = dict(max_slots=16, max_seq_len=128, prefill_chunk=8, prefill_budget=24)
    cfg.update(kw)
    return GenerationEngine(tiny_llama(), TOK, EngineConfig(**cfg), eos_ids={TOK.eos_id})


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, TOK.vocab_size) for _ in range(n)]


async def collect(engine, req):
    text, ids, final = "", [], None
    async for ev in engine.submit(req):
        text += ev.text
        ids += ev.token_ids
        final = ev
    return text, ids, final


async def collect_stream(stream):
    """Read a stream to its end (raising its error)."""
    async for _ in stream:
        pass


def run(coro_fn, **kw):
    return run_engine(make_engine(**kw), coro_fn)


TARGET = GenerateRequest(prompt_ids=prompt(random.Random(1), 21),
                         params=SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))


def _company(rng, n=15):
    return [GenerateRequest(prompt_ids=prompt(rng, rng.randint(1, 40)),
                            params=SamplingParams(max_new_tokens=rng.randint(1, 30), temperature=rng.choice([0, 1]),
                                                  seed=rng.randint(0, 99), ignore_eos=True))
            for _ in range(n)]


async def _with_company(engine, target):
    rng = random.Random(7)
    others = _company(rng)

    async def late(req, delay_steps):
        while engine.steps < delay_steps:
            await asyncio.sleep(0.0005)
        return await collect(engine, req)

    tasks = [asyncio.create_task(late(r, i * 2)) for i, r in enumerate(others)]
    # the target starts after a few others hold slots and keeps decoding while the rest join and leave
    while engine.steps < 3:
        await asyncio.sleep(0.0005)
    batch_sizes = []
    engine.sink = type("Rec", (), {"on_step": lambda self, m, b, *a: batch_sizes.append(b),
                                   "__getattr__": lambda self, n: lambda *a: None})()
    result = await collect(engine, target)
    await asyncio.gather(*tasks)
    assert max(batch_sizes) >= 6  # the target really decoded in company
    return result


@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_greedy_identical_alone_and_in_company(mode):
    alone = run(lambda e: collect(e, TARGET))
    company = run(lambda e: _with_company(e, TARGET), mode=mode)
    assert alone[1] == company[1]
    assert len(alone[1]) == 40 and alone[2].finish_reason == "length"
    assert alone[0] == TOK.decode(alone[1])


def test_running_sequences_are_compacted_into_the_lowest_slots():
    """Sequences that outlive their neighbours move down (K/V copied), so every step's rows use slots
    [0, n): the cache reads views. Their output is unchanged by the moves."""
    seen = {"steps": 0, "moves": 0, "holes": 0}

    class Check(StepHooks):
        def on_plan(self, p):  # record, never raise: an exception here would end the engine loop
            running = engine_ref[0].scheduler.running
            seen["holes"] += sorted(s.slot for s in running) != list(range(len(running)))
            seen["steps"] += 1
            seen["moves"] += len(p.moves)

    engine_ref = []

    async def main(engine):
        engine_ref.append(engine)
        engine.hooks = Check()
        return await _with_company(engine, TARGET)

    alone = run(lambda e: collect(e, TARGET))
    compacted = run(main)
    assert seen["holes"] == 0 and seen["moves"] > 0 and seen["steps"] > 0
    assert compacted[1] == alone[1]


def test_seeded_sampling_independent_of_company():
    def req(seed):
        return GenerateRequest(prompt_ids=TARGET.prompt_ids, params=SamplingParams(
            max_new_tokens=30, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True))
    alone = run(lambda e: collect(e, req(5)))
    company = run(lambda e: _with_company(e, req(5)))
    other = run(lambda e: collect(e, req(6)))
    assert alone[1] == company[1]
    assert alone[1] != other[1]


def test_a_callers_next_request_joins_the_next_step():
    """A caller that submits again as soon as its request has ended (a closed-loop client) is admitted by
    the very next step: the engine loop yields to the event loop before it plans, so the new request does
    not wait a step with its slot empty while other requests keep the engine busy. (Its first token streams
    while that step's decode forward still runs, so the step count has not moved yet.)"""
    def req(n: int) -> GenerateRequest:
        return GenerateRequest(prompt_ids=[6, 7, 8, 9], params=SamplingParams(max_new_tokens=n, temperature=0.0,
                                                                              ignore_eos=True))

    async def main(engine):
        busy = asyncio.create_task(collect(engine, req(80)))  # keeps every step running
        gaps, ended = [], None
        for _ in range(4):
            first = True
            async for ev in engine.submit(req(3)):
                if first and ended is not None:
                    gaps.append(engine.steps - ended)  # steps from the last request's end to this one's first token
                first = False
                if ev.finished:
                    ended = engine.steps
        await busy
        return gaps

    assert run(main) == [0, 0, 0]


def test_the_next_step_is_planned_before_a_stream_reads_its_token():
    """While no request has ended, the engine plans and starts the next step before it yields to the event
    loop: a reader's work on the token just delivered (Serve's, the HTTP response's) then runs beside the
    step's compute instead of before it. So by the time the stream sees a token, the next step is planned."""
    class Plans(StepHooks):
        def __init__(self):
            self.n = 0

        def on_plan(self, plan):
            self.n += 1

    async def main(engine):
        engine.hooks = hooks = Plans()
        seen = []  # plans made when each token reached the reader
        async for ev in engine.submit(TARGET):
            if ev.token_ids:
                seen.append(hooks.n)
        return seen

    seen = run(main)
    assert len(seen) == TARGET.params.max_new_tokens
    # the prompt prefills in 3 chunks (prefill_chunk 8 of 21 tokens), the 3rd gives the first token; every
    # token but the last is read after the plan of the step that decodes the next one
    assert seen[:-1] == [4 + i for i in range(len(seen) - 1)]


def test_stop_string_cut_exactly_across_tokens():
    free = run(lambda e: collect(e, TARGET))[0]
    stop = free[10:13]  # three characters = three tokens: matched across token boundaries
    cut = free.index(stop)
    req = GenerateRequest(prompt_ids=TARGET.prompt_ids,
                          params=SamplingParams(max_new_tokens=40, temperature=0.0, stop=["@@never", stop]))
    text, _, final = run(lambda e: collect(e, req))
    assert text == free[:cut]
    assert final.finish_reason == "stop"


def test_eos_ends_request():
    # find a prompt whose greedy continuation contains EOS by sampling prompts until one does
    async def main(engine):
        rng = random.Random(3)
        for _ in range(200):
            p = prompt(rng, 5)
            _, ids, _ = await collect(engine, GenerateRequest(p, SamplingParams(max_new_tokens=30, temperature=0.0,
                                                                               ignore_eos=True)))
            if TOK.eos_id in ids:
                _, ids2, final = await collect(engine, GenerateRequest(p, SamplingParams(max_new_tokens=30,
                                                                                        temperature=0.0)))
                return ids, ids2, final
        pytest.fail("no greedy continuation of 200 seeded prompts reached EOS: the test lost its case")
    ids, ids2, final = run(main)
    assert final.finish_reason == "stop"
    assert TOK.eos_id not in ids2 and ids2 == ids[: ids.index(TOK.eos_id)]
    assert final.usage.completion_tokens == len(ids2) + 1


def test_cancellation_frees_slots():
    async def main(engine):
        req = GenerateRequest(prompt_ids=TARGET.prompt_ids, params=SamplingParams(max_new_tokens=80, ignore_eos=True))
        streams = [engine.submit(req) for _ in range(4)]
        for s in streams:
            await s.__anext__()
        assert engine.stats().slots_used == 4
        for s in streams:
            await s.aclose()
        for _ in range(100):
            if engine.stats().slots_used == 0:
                break
            await asyncio.sleep(0.005)
        return engine.stats()
    st = run(main)
    assert st.slots_used == 0 and st.running == 0 and st.waiting == 0


def test_a_stream_dropped_unread_cancels_its_request():
    """A client gone before its response began: the stream is never iterated (no `finally` runs), so the
    request is cancelled when the stream is collected, not decoded to max_new_tokens for nobody."""
    async def main(engine):
        req = GenerateRequest(prompt_ids=TARGET.prompt_ids, params=SamplingParams(max_new_tokens=100, ignore_eos=True))
        kept = engine.submit(req)
        engine.submit(dataclasses.replace(req, n=2))  # dropped at once
        await kept.__anext__()
        for _ in range(200):
            if engine.stats().slots_used == 1:
                break
            await asyncio.sleep(0.005)
        used = engine.stats().slots_used
        await kept.aclose()
        return used
    assert run(main) == 1  # the dropped request's two slots were freed while the kept one still ran


def test_overload_and_rejections():
    async def main(engine):
        p = SamplingParams(max_new_tokens=5)
        with pytest.raises(RequestRejected, match="context holds 128"):
            engine.submit(GenerateRequest(prompt_ids=[7] * 200, params=p))
        with pytest.raises(RequestRejected, match="max_new_tokens <= 28") as e:
            engine.submit(GenerateRequest(prompt_ids=[7] * 100, params=SamplingParams(max_new_tokens=50)))
        assert e.value.param == "max_new_tokens"
        with pytest.raises(RequestRejected, match="max_completion_tokens=50 does not fit") as e:  # the client's name
            engine.submit(GenerateRequest(prompt_ids=[7] * 100, params=SamplingParams(max_new_tokens=50),
                                          field_names={"max_new_tokens": "max_completion_tokens"}))
        assert e.value.param == "max_completion_tokens"
        with pytest.raises(RequestRejected, match="empty"):
            engine.submit(GenerateRequest(prompt_ids=[], params=p))
        streams = [engine.submit(GenerateRequest(prompt_ids=[7] * 10, params=p)) for _ in range(5)]
        with pytest.raises(EngineOverloaded) as e:
            engine.submit(GenerateRequest(prompt_ids=[7] * 10, params=p))
        assert e.value.retry_after > 0
        for s in streams:
            async for _ in s:
                pass
        return True
    # 2 slots + max_waiting 3, and an engine that is not stepping (started but the loop only runs between awaits)
    assert run(main, max_slots=2, max_waiting=3)


def test_a_context_longer_than_the_models_is_capped_in_the_engine_not_in_the_callers_config():
    cfg = EngineConfig(max_slots=2, max_seq_len=4096)
    engine = GenerationEngine(tiny_llama(), TOK, cfg, eos_ids={TOK.eos_id})
    assert engine.max_context == engine.config.max_seq_len == 128 and engine.runner.cache.max_len == 128
    assert cfg.max_seq_len == 4096  # the caller may build another engine from it


def test_stop_fails_pending_and_rejects_new():
    async def main():
        engine = make_engine()
        await engine.start()
        stream = engine.submit(GenerateRequest(prompt_ids=[9] * 10, params=SamplingParams(max_new_tokens=100,
                                                                                          ignore_eos=True)))
        await stream.__anext__()
        await engine.stop()
        with pytest.raises(EngineStopped):
            async for _ in stream:
                pass
        with pytest.raises(EngineStopped):
            engine.submit(GenerateRequest(prompt_ids=[9], params=SamplingParams()))
    asyncio.run(main())


def test_stop_counts_each_pending_request_once_with_how_it_ended():
    """Requests still running or waiting when the engine stops end with EngineStopped and are counted once each
    as an "error" (as a failed step's are), a request of two choices once; one whose client already left counts
    as "cancelled"; one finished before the stop is not counted again."""
    sink = EndsSink()
    req = GenerateRequest(prompt_ids=[9] * 10, params=SamplingParams(max_new_tokens=100, ignore_eos=True))

    async def main():
        engine = GenerationEngine(tiny_llama(), TOK, EngineConfig(max_slots=3, max_seq_len=128),
                                  eos_ids={TOK.eos_id}, sink=sink)
        await engine.start()
        await collect(engine, dataclasses.replace(req, params=SamplingParams(max_new_tokens=2, ignore_eos=True)))
        running, left = engine.submit(dataclasses.replace(req, n=2)), engine.submit(req)
        await running.__anext__()
        await left.__anext__()
        waiting = engine.submit(req)  # every slot is taken
        await left.aclose()
        await engine.stop()
        for stream in (running, waiting):
            with pytest.raises(EngineStopped):
                await collect_stream(stream)
        return engine.stats()

    stats = asyncio.run(main())
    assert sink.reasons[0] == "length" and sorted(sink.reasons[1:]) == ["cancelled", "error", "error"]
    assert stats.requests_finished == 4 and stats.running == stats.waiting == stats.slots_used == 0


def test_a_sink_raising_while_requests_are_failed_leaves_none_waiting():
    """A fault between steps fails every pending request; a metrics sink that raises as they are counted must
    not keep the rest from being told (they would wait forever) nor end the engine."""
    class Raising(MetricsSink):
        def on_finish(self, model, finish_reason, prompt_tokens, generation_tokens, e2e_s):
            if finish_reason == "error":
                raise RuntimeError("sink bug")

    req = GenerateRequest(prompt_ids=[9] * 10, params=SamplingParams(max_new_tokens=3, ignore_eos=True))
    engine = GenerationEngine(tiny_llama(), TOK, EngineConfig(max_slots=1, max_seq_len=128), eos_ids={TOK.eos_id},
                              sink=Raising())

    async def main(e):
        e.hooks = FailOnce("on_plan", "hook bug")
        streams = [e.submit(req), e.submit(req)]  # one running, one waiting when the first plan fails
        for stream in streams:
            with pytest.raises(EngineError, match="hook bug"):
                await asyncio.wait_for(collect_stream(stream), 30)
        return await asyncio.wait_for(collect(e, req), 30)

    _, ids, final = run_engine(engine, main)
    assert len(ids) == 3 and final.finish_reason == "length"


def test_deadline_times_out():
    req = GenerateRequest(prompt_ids=[9] * 10, params=SamplingParams(max_new_tokens=100, ignore_eos=True),
                          deadline_s=0.0)
    _, _, final = run(lambda e: collect(e, req))
    assert final.finish_reason == "timeout"


@pytest.mark.parametrize("mode", ["continuous", "static", "serial"])
def test_no_slot_leaks_under_mixed_load_with_cancellations(mode):
    n = 300 if mode == "continuous" else 60

    async def main(engine):
        rng = random.Random(11)

        async def client(i):
            req = GenerateRequest(prompt_ids=prompt(rng, rng.randint(1, 30)), params=SamplingParams(
                max_new_tokens=rng.randint(1, 12), temperature=rng.choice([0, 0.8]), seed=i,
                stop=rng.choice([[], ["a", "b"]])))
            try:
                stream = engine.submit(req)
            except EngineOverloaded:
                return "overloaded"
            cancel_after = rng.choice([None, 0, 1, 3])
            got = 0
            async for ev in stream:
                got += 1
                if cancel_after is not None and got > cancel_after:
                    await stream.aclose()
                    return "cancelled"
                if ev.finished:
                    return ev.finish_reason
            return "?"

        outcomes = await asyncio.gather(*(client(i) for i in range(n)))
        for _ in range(200):
            if engine.stats().slots_used == 0:
                break
            await asyncio.sleep(0.005)
        return outcomes, engine.stats()

    outcomes, st = run(main, max_slots=8, max_waiting=1000, mode=mode)
    assert st.slots_used == 0 and st.running == 0 and st.waiting == 0
    assert set(outcomes) <= {"stop", "length", "cancelled"} and "cancelled" in outcomes
    assert st.requests_finished == n - outcomes.count("overloaded")


def test_an_error_between_steps_fails_the_requests_and_the_engine_serves_on():
    """A bug outside the worker step (here a hook raising while the plan is made) must not end the engine's
    task silently: its requests fail with an engine error, and later requests are served."""

    req = GenerateRequest(prompt_ids=TARGET.prompt_ids, params=SamplingParams(max_new_tokens=3, ignore_eos=True))

    async def main(engine):
        engine.hooks = FailOnce("on_plan", "hook bug")
        with pytest.raises(EngineError, match="hook bug"):
            await asyncio.wait_for(collect(engine, req), 60)
        _, ids, final = await asyncio.wait_for(collect(engine, req), 60)
        return ids, final, engine.stats()

    ids, final, stats = run(main)
    assert len(ids) == 3 and final.finish_reason == "length"
    assert stats.running == 0 and stats.slots_used == 0


def test_a_schedule_that_ends_by_itself_fails_its_requests_and_reads_as_stopped():
    """A BaseException past the schedule's handler (here a hook raising CancelledError) ended the engine's task
    with `started` still True: the health check said healthy, queued requests waited forever."""

    class CancelOnPlan(StepHooks):
        def on_plan(self, plan):
            raise asyncio.CancelledError

    req = GenerateRequest(prompt_ids=TARGET.prompt_ids, params=SamplingParams(max_new_tokens=3, ignore_eos=True))

    async def main(engine):
        engine.hooks = CancelOnPlan()
        with pytest.raises(EngineError, match="stopped unexpectedly"):
            await asyncio.wait_for(collect(engine, req), 60)
        assert not engine.started
        with pytest.raises(EngineStopped):
            engine.submit(req)
        return engine.stats()

    stats = run(main)
    assert stats.running == 0 and stats.waiting == 0


def test_metrics_sink_sees_running_return_to_zero_when_idle():
    from service.engine.stats import MetricsSink

    class Recorder(MetricsSink):
        def __init__(self):
            self.steps = []

        def on_step(self, model, batch_size, kv_usage, running, waiting):
            self.steps.append((running, waiting, kv_usage))

    sink = Recorder()

    async def main():
        engine = GenerationEngine(tiny_llama(), TOK, EngineConfig(max_slots=4, max_seq_len=128), eos_ids={TOK.eos_id},
                                  sink=sink)
        await engine.start()
        try:
            await collect(engine, GenerateRequest(prompt_ids=TARGET.prompt_ids,
                                                  params=SamplingParams(max_new_tokens=4, ignore_eos=True)))
            for _ in range(100):
                if sink.steps and sink.steps[-1] == (0, 0, 0.0):
                    break
                await asyncio.sleep(0.005)
        finally:
            await engine.stop()

    asyncio.run(main())
    assert any(r > 0 for r, _, _ in sink.steps)
    assert sink.steps[-1] == (0, 0, 0.0)


def test_prefill_groups_bound_padding_and_keep_every_chunk():
    import random

    from service.engine.decoder_runner import padding_bounded_groups

    rng = random.Random(0)
    for _ in range(200):
        chunks = [(i, rng.randint(1, 256)) for i in range(rng.randint(1, 8))]
        lengths = [c for _, c in chunks]
        groups = padding_bounded_groups(list(range(len(chunks))), lengths, max_padding=0.25)
        assert sorted(x for g in groups for x in g) == list(range(len(chunks)))
        for g in groups:
            width, real = max(lengths[i] for i in g), sum(lengths[i] for i in g)
            assert len(g) == 1 or width * len(g) <= 1.25 * real
    assert len(padding_bounded_groups([0, 1], [256, 16])) == 2  # 240 pad positions: apart
    assert len(padding_bounded_groups([0, 1, 2], [256, 250, 240])) == 1


def test_prefill_sends_few_or_long_chunks_one_by_one_to_the_compiled_prefill():
    """With a compiled prefill, a group of one or two chunks, or of chunks 32 tokens long on average, goes
    through it a chunk at a time; many short chunks share one eager forward; a chunk it refuses (None) is
    run eagerly. Logits come back in the chunks' order."""
    from service.engine.decoder_runner import DecoderRunner, compiled_one_by_one

    assert compiled_one_by_one([3]) and compiled_one_by_one([2, 300]) and compiled_one_by_one([30, 34, 40])
    assert not compiled_one_by_one([4, 4, 4]) and not compiled_one_by_one([40, 8, 8, 8])
    model = tiny_llama()
    runner = DecoderRunner(model, EngineConfig(max_slots=8, max_seq_len=128))
    reference = DecoderRunner(model, EngineConfig(max_slots=8, max_seq_len=128))
    eager = DecoderRunner(model, EngineConfig(max_slots=8, max_seq_len=128))
    eager.cache = runner.cache

    class Compiled:  # stands in for CompiledDecoder.prefill: eager logits for slots it takes, None for slot 1
        calls: list[int] = []

        def prefill(self, slot, tokens, start):
            self.calls.append(slot)
            return None if slot == 1 else eager.prefill([(slot, tokens, start)])[0]

    runner.compiled = Compiled()
    rng = random.Random(0)
    for lengths, one_by_one in (([40, 40, 36], [0, 1, 2]), ([5, 6, 7, 5], [])):
        chunks = [(slot, prompt(rng, n), 0) for slot, n in enumerate(lengths)]
        Compiled.calls.clear()
        got = runner.prefill(chunks)
        assert Compiled.calls == one_by_one
        want = reference.prefill(chunks)
        assert torch.allclose(got, want, atol=1e-5)
        for slot, n in enumerate(lengths):  # past a chunk, a batched forward's pad rows may write
            assert torch.allclose(runner.cache.k[:, slot, :, :n], reference.cache.k[:, slot, :, :n], atol=1e-5)


def test_submit_marks_the_engine_busy_before_its_loop_turns(tmp_path):
    """Two replicas receiving a burst in the same millisecond: each sees the other busy as soon as the
    other queued work, so neither borrows the core the other is about to use."""
    from service.engine.cpu_runtime import BusyBoard

    neighbour = BusyBoard(tmp_path)
    engine = make_engine(threads=1, prefill_threads=2)
    engine.busy = BusyBoard(tmp_path)
    req = GenerateRequest(prompt_ids=prompt(random.Random(4), 9),
                          params=SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))

    async def scenario(engine):
        assert not neighbour.others_busy()
        stream = engine.submit(req)
        busy_at_once = neighbour.others_busy()  # no await since submit: the loop has not turned
        async for _ in stream:
            pass
        return busy_at_once

    assert run_engine(engine, scenario)


@pytest.mark.parametrize("others_busy, want", [(False, [2, 1]), (True, [1, 1])])
def test_prefill_borrows_idle_cores_only_when_nothing_decodes(tmp_path, others_busy, want):
    """`prefill_threads`: a prompt reaching an idle engine prefills on more threads while no other engine
    on the host has work; a prompt joining running streams, or a busy neighbour, keeps the engine's own
    count."""
    from service.engine.cpu_runtime import BusyBoard

    neighbour = BusyBoard(tmp_path)
    neighbour.set(others_busy)
    engine = make_engine(threads=1, prefill_threads=2, prefill_chunk=64, prefill_budget=64)
    engine.busy = BusyBoard(tmp_path)
    seen, prefill = [], engine.runner.prefill

    def counting(chunks):
        seen.append(torch.get_num_threads())
        return prefill(chunks)

    engine.runner.prefill = counting
    long = GenerateRequest(prompt_ids=prompt(random.Random(2), 20),
                           params=SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True))
    late = GenerateRequest(prompt_ids=prompt(random.Random(3), 9),
                           params=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))

    async def scenario(engine):
        seen.clear()  # the start's warm-up calls
        stream = engine.submit(long)
        first = await stream.__anext__()  # prefilled alone: nothing else running
        _, _, done = await collect(engine, late)  # joins while `long` decodes
        async for _ in stream:
            pass
        return first, done

    first, done = run_engine(engine, scenario)
    assert done.finish_reason == "length"
    assert seen == want
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("others_busy, want", [(False, 2), (True, 1)])
def test_decode_borrows_idle_cores_while_no_other_engine_works(tmp_path, others_busy, want):
    """`decode_threads`: decode steps run on more threads while no other engine on the host has work."""
    from service.engine.cpu_runtime import BusyBoard

    neighbour = BusyBoard(tmp_path)
    neighbour.set(others_busy)
    engine = make_engine(threads=1, decode_threads=2)
    engine.busy = BusyBoard(tmp_path)
    seen, rows_seen, decode = [], [], engine.runner.decode

    def counting(slots, *args):
        seen.append(torch.get_num_threads())
        rows_seen.append(len(slots))
        return decode(slots, *args)

    engine.runner.decode = counting
    req = GenerateRequest(prompt_ids=prompt(random.Random(4), 7),
                          params=SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    async def alone(e):
        seen.clear()  # the start's warm-up calls
        rows_seen.clear()
        return await collect(e, req)

    _, _, done = run_engine(engine, alone)
    assert done.finish_reason == "length"
    assert seen == [want] * 4  # the first token comes from the prefill
    # a fuller step keeps the engine's own threads: three rows decode together after one shared prefill
    seen.clear()
    rows_seen.clear()
    reqs = [dataclasses.replace(req, prompt_ids=prompt(random.Random(5 + i), 7)) for i in range(3)]

    async def together(e):
        seen.clear()
        rows_seen.clear()
        return await asyncio.gather(*(collect(e, r) for r in reqs))

    run_engine(engine, together)
    assert 1 in seen and all(n == 1 for n, rows in zip(seen, rows_seen, strict=True) if rows > 2)
    assert torch.get_num_threads() == 1


@pytest.mark.timeout(120)
def test_start_runs_each_kind_of_call_once_before_any_request():
    """The first prefill and decode of a process pay one-time costs: the engine pays them at start, on free
    slots, so the first request's time to first token does not (the slots stay free, the output unchanged)."""
    engine = make_engine()
    calls = []
    for name in ("prefill", "decode"):
        real = getattr(engine.runner, name)
        setattr(engine.runner, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))

    async def main(e):
        started, st = list(calls), e.stats()
        ids, _, _ = await collect(e, TARGET)
        return started, st, ids

    started, st, ids = run_engine(engine, main)
    assert "prefill" in started and "decode" in started
    assert st.slots_used == 0 and st.steps == 0
    cold = make_engine()
    cold.runner.warm_up = lambda: None
    assert ids == run_engine(cold, lambda e: collect(e, TARGET))[0]


def test_prefill_threads_must_be_positive():
    with pytest.raises(ValueError, match="prefill_threads"):
        EngineConfig(prefill_threads=0)
    with pytest.raises(ValueError, match="decode_threads"):
        EngineConfig(decode_threads=0)


def test_a_new_prompts_first_token_streams_before_the_running_rows_decode():
    """A prompt that joins running streams gets its first token while that step's decode forward still runs."""
    import contextlib
    import threading

    seen_first = threading.Event()
    during_decode = []  # per mixed step: did the client see the new prompt's first token during the decode?

    class Hooks(StepHooks):
        mixed = False

        def on_plan(self, plan):
            self.mixed = bool(plan.prefill) and bool(plan.decode)

        def phase(self, name):
            if name == "decode forward" and self.mixed:
                during_decode.append(seen_first.wait(timeout=5))  # the event loop streams meanwhile
            return contextlib.nullcontext()

    engine = make_engine()
    engine.hooks = Hooks()
    runner_req = GenerateRequest(prompt_ids=prompt(random.Random(3), 5),
                                 params=SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True))
    late_req = GenerateRequest(prompt_ids=prompt(random.Random(4), 6),
                               params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))

    async def main(engine):
        running = asyncio.create_task(collect(engine, runner_req))
        while engine.steps < 3:
            await asyncio.sleep(0.0005)
        stream = engine.submit(late_req)
        first = await stream.__anext__()
        seen_first.set()
        rest = [ev async for ev in stream]
        await running
        return first, rest

    first, rest = run_engine(engine, main)
    assert during_decode[:1] == [True]  # streamed before the decode forward finished
    alone = run(lambda e: collect(e, late_req))
    assert first.token_ids + [t for ev in rest for t in ev.token_ids] == alone[1]  # same tokens as alone
    assert rest[-1].finish_reason == "length"


@pytest.mark.timeout(60)
def test_a_fault_between_steps_while_idle_does_not_end_the_engine():
    """A metrics sink that raises while the engine idles (its gauges are re-reported then) is logged; the
    schedule goes on and serves the next request instead of leaving it to wait forever."""
    from service.engine.stats import MetricsSink

    class FlakySink(MetricsSink):
        faults = 1

        def on_step(self, model, batch_size, kv_usage, running, waiting):
            if batch_size == 0 and self.faults:
                self.faults -= 1
                raise RuntimeError("scrape target gone")

    engine = make_engine()
    engine.sink = FlakySink()

    async def main(e):
        while e.sink.faults:
            await asyncio.sleep(0.01)
        return await asyncio.wait_for(collect(e, TARGET), 30)

    _, ids, done = run_engine(engine, main)
    assert done.finish_reason == "length" and len(ids) == 40


def test_a_step_raising_stopiteration_fails_its_requests_not_the_engine():
    """asyncio cannot carry StopIteration out of the worker thread's future (the step would never end):
    the engine turns it into an error for that step's requests and keeps serving."""
    class Raising(StepHooks):
        raised = False

        def step_started(self, plan):
            if not self.raised:
                Raising.raised = True
                raise StopIteration("next() on an empty iterator")

    engine = make_engine()
    engine.hooks = Raising()

    async def main(e):
        with pytest.raises(EngineError):
            await asyncio.wait_for(collect(e, TARGET), 30)
        return await asyncio.wait_for(collect(e, TARGET), 30)

    _, ids, _ = run_engine(engine, main)
    assert len(ids) == 40


def test_a_step_failing_before_its_slot_copies_leaves_no_request_on_copies_never_made():
    """A step fails before its slot copies ran (here a hook raising as it starts): a request whose slot was to
    receive K/V in that step (a reused prefix, while another prompt took the prefill budget) must not go on
    over the slot as if the copy had been made. It fails with the step, or answers as it does alone; no
    slot leaks and the next request is served."""
    rng = random.Random(3)
    old = GenerateRequest(prompt_ids=prompt(rng, 60), params=SamplingParams(max_new_tokens=3, ignore_eos=True))
    shares = GenerateRequest(prompt_ids=old.prompt_ids[:8] + prompt(rng, 12),
                             params=SamplingParams(max_new_tokens=10, ignore_eos=True))
    seen = {}

    class FailOnReuse(StepHooks):
        def step_started(self, plan):
            if plan.reuse and not seen:
                seen["starved"] = all(s.prompt != shares.prompt_ids for s, _ in plan.prefill)
                raise RuntimeError("kernel fault")

    async def main(engine):
        engine.hooks = FailOnReuse()
        first = asyncio.create_task(collect(engine, old))
        while engine.steps < 1:
            await asyncio.sleep(0.0005)
        try:
            got = (await asyncio.wait_for(collect(engine, shares), 60))[1]
        except EngineError:
            got = "failed"
        with pytest.raises(EngineError):
            await first
        after = (await asyncio.wait_for(collect(engine, shares), 60))[1]
        return got, after, engine.stats()

    alone = run(lambda e: collect(e, shares), prefill_chunk=8, prefill_budget=8)[1]
    got, after, stats = run(main, prefill_chunk=8, prefill_budget=8)
    assert seen == {"starved": True}  # the case: the reusing prompt got no budget in the failed step
    assert got in ("failed", alone) and after == alone
    assert stats.slots_used == 0 and stats.running == 0


def test_start_and_stop_while_starting_wait_for_the_start():
    """A second start during the first one's preparation prepares nothing again and runs no second schedule;
    a stop during a start waits for it, then stops (no engine left running, no worker thread left)."""
    import time

    engine = make_engine()
    warm_ups = []
    engine.runner.warm_up = lambda: warm_ups.append(time.sleep(0.2))

    async def main():
        first = asyncio.create_task(engine.start())
        await asyncio.sleep(0.05)  # the first start is preparing on the worker thread
        await engine.start()
        assert first.done() and engine.started and len(warm_ups) == 1
        await engine.stop()
        starting = asyncio.create_task(engine.start())
        await asyncio.sleep(0.05)
        await engine.stop()
        await starting
        return engine.started, engine._pool

    assert asyncio.run(main()) == (False, None) and len(warm_ups) == 2


def test_a_start_while_a_stop_is_in_progress_waits_for_it_then_starts():
    """start() called while stop() waits for the step in flight: once the stop is done the engine runs again
    (one schedule, serving requests), not a stopped engine whose start returned as if it had started."""
    engine = make_engine()
    req = GenerateRequest(prompt_ids=TARGET.prompt_ids, params=SamplingParams(max_new_tokens=3, ignore_eos=True))

    async def main():
        await engine.start()
        stream = engine.submit(TARGET)
        await stream.__anext__()
        stopping = asyncio.create_task(engine.stop())
        await asyncio.sleep(0)  # the stop now waits for the schedule to end
        assert not stopping.done()
        await engine.start()
        await stopping
        with pytest.raises(EngineStopped):  # the request before the stop was failed by it
            async for _ in stream:
                pass
        started = engine.started
        _, ids, _ = await asyncio.wait_for(collect(engine, req), 30)
        tasks = [t for t in asyncio.all_tasks() if t.get_name() == f"engine-{engine.name}"]
        await engine.stop()
        return started, len(ids), len(tasks)

    assert asyncio.run(main()) == (True, 3, 1)


def test_a_start_waiting_for_a_start_that_failed_fails_too():
    import time

    from service.engine.types import EngineStopped

    engine = make_engine()

    def broken():
        time.sleep(0.2)
        raise OSError("no space left for the compiled step")

    engine._prepare = broken

    async def main():
        first = asyncio.create_task(engine.start())
        await asyncio.sleep(0.05)
        with pytest.raises(EngineStopped, match="did not start"):
            await engine.start()
        with pytest.raises(OSError):
            await first
        return engine.started, engine._pool

    assert asyncio.run(main()) == (False, None)


@pytest.mark.parametrize("max_seq_len", [1, 2, 3])
def test_slots_of_a_few_tokens_start_without_a_failed_warm_up(max_seq_len, caplog):
    engine = make_engine(max_seq_len=max_seq_len)

    async def main():
        await engine.start()
        await engine.stop()

    asyncio.run(main())
    assert not [r for r in caplog.records if "warm-up" in r.getMessage()]


class LeadingSpaceTokenizer(CharTokenizer):
    """Decodes as SentencePiece does: "_" is its "▁", a space, dropped where it leads the text."""

    def decode(self, ids) -> str:
        return super().decode(ids).replace("_", " ").removeprefix(" ")


def test_the_first_output_token_is_read_after_the_prompt():
    """With SentencePiece-style tokenizers the first token's leading space was lost ("…isParis"): its text
    was decoded alone. The detokenizer now reads the prompt's last tokens first, as vLLM does, so prompt +
    completion reads as the tokens decoded together."""
    tok = LeadingSpaceTokenizer()
    space = tok.stoi["_"]
    req = GenerateRequest(prompt_ids=tok.encode("Paris_is"),
                          params=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True,
                                                logit_bias={space: 100.0}))
    engine = GenerationEngine(tiny_llama(), tok, EngineConfig(max_slots=2, max_seq_len=32), eos_ids={tok.eos_id})
    text, ids, _ = run_engine(engine, lambda e: collect(e, req))
    assert ids == [space] * 3 and text == "   "
    assert tok.decode(req.prompt_ids) + text == tok.decode(req.prompt_ids + ids)


def test_a_tokenizer_with_ids_the_model_cannot_embed_is_refused_when_built():
    """Another model's tokenizer: a prompt holding one of its extra ids failed every step it was in."""
    from model.config import TINY_SEQ2SEQ
    from model.seq2seq import EncoderDecoder
    from service.engine.translation import TranslationEngine
    from service.frontend.translator import TranslationFrontend

    with pytest.raises(ValueError, match="the tokenizer has 97 ids but the model's vocabulary 64"):
        GenerationEngine(tiny_llama(vocab_size=64), TOK, EngineConfig(max_slots=2, max_seq_len=32), eos_ids={2})
    small = EncoderDecoder(dataclasses.replace(TINY_SEQ2SEQ, vocab_size=64)).eval()
    engine = TranslationEngine(small, EngineConfig(max_slots=2, max_seq_len=32))
    with pytest.raises(ValueError, match="the tokenizer has 97 ids but the model's vocabulary 64"):
        TranslationFrontend(engine, TOK)


def test_ids_past_the_tokenizers_are_padding_never_sampled():
    """An embedding padded past the tokenizer (to a multiple of 64, say): its extra ids are no text. Sampled,
    one decoded to nothing (or failed the step in SentencePiece); as vLLM, they are never sampled, and ids
    a request names must be the tokenizer's."""
    model = tiny_llama(vocab_size=128)
    with torch.no_grad():  # padding rows that would win every step, whatever the sign of the hidden state
        model.lm_head.weight[97:112] = 1000 * model.lm_head.weight[5]
        model.lm_head.weight[112:] = -1000 * model.lm_head.weight[5]
    engine = GenerationEngine(model, TOK, EngineConfig(max_slots=2, max_seq_len=64), eos_ids={TOK.eos_id})
    req = GenerateRequest(prompt_ids=TOK.encode("hello"), params=SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                                ignore_eos=True, logprobs=2))
    text, ids, _ = run_engine(engine, lambda e: collect(e, req))
    assert len(ids) == 8 and max(ids) < 97 and text == TOK.decode(ids)
    assert engine.vocab_size == 97
    scoring = GenerateRequest(prompt_ids=TOK.encode("hello"),
                              params=SamplingParams(max_new_tokens=0, prompt_logprobs=3))

    async def first_event(engine):
        async for ev in engine.submit(scoring):
            return ev

    tops = [t for lp in run_engine(engine, first_event).prompt_logprobs[1:] for t in lp.top]  # scored as text
    assert len(tops) == 12 and all(tok < 97 for tok, _ in tops)
    with pytest.raises(RequestRejected, match=r"token ids must be in \[0, 97\)"):
        engine.validate(GenerateRequest(prompt_ids=[100], params=SamplingParams()))
