"""The one-request `stream` helper (service/commands/generate.py: a serial GenerationEngine over a model as it is),
on a tiny random model (fast)."""

import asyncio

import pytest
import torch
from engine_util import stream_model

from model.config import TINY_LLAMA
from model.decoder import DecoderLM
from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.types import GenerateRequest, RequestRejected, SamplingParams


class ByteTok:
    """ids are bytes: decoding a partial UTF-8 sequence gives U+FFFD, like a byte-level BPE."""

    vocab_size, bos_id, eos_id, pad_id = 97, None, None, None

    def decode(self, ids):
        return bytes(int(i) + 100 if int(i) > 60 else int(i) + 32 for i in ids).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(4)
    return DecoderLM(TINY_LLAMA).eval()


def _full_greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_stream_equals_recompute_without_cache(tiny):
    stats: dict = {}
    prompt = [5, 9, 2, 40, 7]
    params = SamplingParams(max_new_tokens=20, temperature=0)
    text = "".join(stream_model(tiny, ByteTok(), prompt, params, set(), stats))
    assert stats["ids"] == _full_greedy(tiny, prompt, 20)
    assert text == ByteTok().decode(stats["ids"])


def test_seeded_sampling_reproducible_and_stops_at_stop_id(tiny):
    p = SamplingParams(max_new_tokens=30, temperature=1.5, top_p=0.95, seed=7)
    runs = []
    for _ in range(2):
        stats: dict = {}
        list(stream_model(tiny, ByteTok(), [1, 2, 3], p, set(), stats))
        runs.append(stats["ids"])
    assert runs[0] == runs[1]
    stop = runs[0][3]
    stats = {}
    text = "".join(stream_model(tiny, ByteTok(), [1, 2, 3], p, {stop}, stats))
    first = runs[0].index(stop)
    assert stats["ids"] == runs[0][:first]  # ends at the stop token, which is neither an output id nor printed
    assert text == ByteTok().decode(runs[0][:first])


def test_too_long_request_is_refused_naming_the_field(tiny):
    with pytest.raises(RequestRejected, match="--max-tokens"):
        list(stream_model(tiny, ByteTok(), [1] * 100, SamplingParams(max_new_tokens=50), set()))


async def _served(model, prompts, params):
    """The same requests through a continuous-batching engine, all at once (as the service runs them)."""
    engine = GenerationEngine(model, ByteTok(), EngineConfig(max_slots=4, max_seq_len=64), eos_ids=set())
    await engine.start()

    async def one(prompt):
        out = []
        async for ev in engine.submit(GenerateRequest(prompt, params)):
            out.append(ev.text)
        return "".join(out)

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await engine.stop()


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=16, temperature=0),
                                    SamplingParams(max_new_tokens=16, temperature=1.2, top_p=0.9, seed=3)])
def test_serial_stream_and_the_continuous_engine_give_the_same_text(tiny, params):
    prompts = [[5, 9, 2, 40, 7], [1, 2, 3], [60, 61, 62, 63, 64, 65, 66]]
    cli = ["".join(stream_model(tiny, ByteTok(), p, params, set())) for p in prompts]
    assert asyncio.run(_served(tiny, prompts, params)) == cli
