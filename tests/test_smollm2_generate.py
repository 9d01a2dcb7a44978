"""The local streaming loop behind `attnserve generate`, on a tiny random model (fast)."""

import pytest
import torch

from model.config import TINY_LLAMA
from model.decoder import DecoderLM
from service.commands.generate import stream
from service.engine.types import SamplingParams


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
    text = "".join(stream(tiny, ByteTok(), prompt, SamplingParams(max_new_tokens=20, temperature=0), set(), stats))
    assert stats["ids"] == _full_greedy(tiny, prompt, 20)
    assert text == ByteTok().decode(stats["ids"])


def test_seeded_sampling_reproducible_and_stops_at_stop_id(tiny):
    p = SamplingParams(max_new_tokens=30, temperature=1.5, top_p=0.95, seed=7)
    runs = []
    for _ in range(2):
        stats: dict = {}
        list(stream(tiny, ByteTok(), [1, 2, 3], p, set(), stats))
        runs.append(stats["ids"])
    assert runs[0] == runs[1]
    stop = runs[0][3]
    stats = {}
    text = "".join(stream(tiny, ByteTok(), [1, 2, 3], p, {stop}, stats))
    first = runs[0].index(stop)
    assert stats["ids"] == runs[0][: first + 1]  # ends on the stop token, which is not printed
    assert text == ByteTok().decode(runs[0][:first])


def test_too_long_request_is_refused(tiny):
    with pytest.raises(ValueError, match="exceeds the model's context"):
        list(stream(tiny, ByteTok(), [1] * 100, SamplingParams(max_new_tokens=50), set()))
