"""`n` and `best_of` through the official `openai` SDK, streamed and not: indexed choices, choice i seeded
with seed + i, usage with the prompt once and every choice's tokens, best_of's most likely candidates,
and the limits as 400s naming the field."""

from __future__ import annotations

import openai
import pytest
import torch
from api_util import TOK
from openai_sdk_util import BAN_SPECIALS, MODEL, chat, completion, served

torch.set_num_threads(1)
PROMPT = "Once,upon"
MSGS = [{"role": "user", "content": "Tell!"}]
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
SAMPLED = dict(temperature=1.0, logit_bias=BAN_SPECIALS)  # no special token: no early end, every token counted


@pytest.fixture(scope="module")
def server():
    with served() as s:
        yield s


@STREAM
def test_completion_choices_are_seeded_seed_plus_index(server, stream):
    client, _ = server
    choices, usage = completion(client, stream, prompt=PROMPT, n=3, seed=7, max_tokens=8, **SAMPLED)
    assert sorted(choices) == [0, 1, 2]
    for i in range(3):
        alone, _ = completion(client, False, prompt=PROMPT, seed=7 + i, max_tokens=8, **SAMPLED)
        assert choices[i] == alone[0]
    assert len({c["text"] for c in choices.values()}) > 1
    p = len(TOK.encode(PROMPT))
    assert usage == {"prompt_tokens": p, "completion_tokens": 24, "total_tokens": p + 24}


@STREAM
def test_chat_choices_are_seeded_seed_plus_index(server, stream):
    client, _ = server
    choices, usage = chat(client, stream, messages=MSGS, n=2, seed=3, max_completion_tokens=6, **SAMPLED)
    assert sorted(choices) == [0, 1]
    for i in range(2):
        alone, _ = chat(client, False, messages=MSGS, seed=3 + i, max_completion_tokens=6, **SAMPLED)
        assert choices[i] == alone[0]
    assert usage["completion_tokens"] == 12 and usage["total_tokens"] == usage["prompt_tokens"] + 12


def test_streamed_chunks_carry_their_choice_index(server):
    client, _ = server
    seen = [c.index for chunk in client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=4,
                                                            stream=True, **SAMPLED) for c in chunk.choices]
    assert set(seen) == {0, 1, 2} and len(seen) == 12
    roles = [c.index for chunk in client.chat.completions.create(model=MODEL, messages=MSGS, n=2, max_tokens=2,
                                                                  stream=True, **SAMPLED)
             for c in chunk.choices if c.delta.role == "assistant"]
    assert sorted(roles) == [0, 1]  # each choice opens with the assistant role


def test_best_of_returns_the_most_likely_candidates(server):
    client, _ = server
    kw = dict(prompt=PROMPT, seed=11, max_tokens=6, **SAMPLED)
    candidates, _ = completion(client, False, n=4, logprobs=0, **kw)
    mean = {c["text"]: sum(c["logprobs"]["token_logprobs"]) / 6 for c in candidates.values()}
    ranked = sorted(mean, key=lambda t: -mean[t])
    one, usage = completion(client, False, n=1, best_of=4, **kw)
    assert one[0] == {"text": ranked[0], "finish_reason": "length", "logprobs": None}
    assert usage["completion_tokens"] == 24  # every candidate was generated
    two, _ = completion(client, False, n=2, best_of=4, logprobs=1, **kw)
    assert [two[i]["text"] for i in (0, 1)] == ranked[:2] and two[0]["logprobs"]["tokens"]


@pytest.mark.parametrize("kw, param", [
    (dict(n=9), "n"),  # beyond ApiLimits.max_n (8)
    (dict(n=5), "n"),  # beyond the engine's 4 slots
    (dict(n=2, best_of=1), "best_of"),
    (dict(best_of=9), "best_of"),
    (dict(best_of=2, stream=True), "best_of"),
])
def test_choice_limits_are_400s_naming_the_field(server, kw, param):
    client, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **kw)
    assert e.value.param == param and param in e.value.message
    if "best_of" not in kw:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, **kw)
        assert e.value.param == param
