"""presence_penalty, frequency_penalty, logit_bias and max_completion_tokens through the official `openai`
SDK, streamed and not, against greedy decoding with OpenAI's semantics on full forwards of the model;
their bad values are 400s naming the field."""

from __future__ import annotations

import openai
import pytest
import torch
from api_util import TOK
from openai_sdk_util import BAN_SPECIALS, MODEL, chat, completion, greedy_reference, ids_of, served, tokenize

torch.set_num_threads(1)
PROMPT = "abab,abab"
MSGS = [{"role": "user", "content": "Repeat:abab"}]
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
CASES = [  # (presence, frequency, bias): each changes what greedy decoding picks on this model
    (0.0, 0.0, BAN_SPECIALS),
    (-1.5, 0.0, BAN_SPECIALS),  # a negative presence penalty encourages repeats
    (0.0, 2.0, BAN_SPECIALS),
    (-1.0, 0.5, {**BAN_SPECIALS, "40": 4.0, "41": 2.5}),
]


@pytest.fixture(scope="module")
def server():
    with served() as s:
        yield s


def test_the_cases_differ():
    p = TOK.encode(PROMPT)
    outs = {tuple(greedy_reference(p, 10, pres, freq, bias)) for pres, freq, bias in CASES}
    assert len(outs) == len(CASES)  # else a case would not show its field working


@STREAM
@pytest.mark.parametrize("presence, frequency, bias", CASES)
def test_completion_penalties_and_bias_follow_openai(server, stream, presence, frequency, bias):
    client, _ = server
    choices, _ = completion(client, stream, prompt=PROMPT, max_tokens=10, temperature=0, presence_penalty=presence,
                            frequency_penalty=frequency, logit_bias=bias)
    want = greedy_reference(TOK.encode(PROMPT), 10, presence, frequency, bias)
    assert choices[0]["text"] == TOK.decode(want)


@STREAM
@pytest.mark.parametrize("presence, frequency, bias", CASES[1:])
def test_chat_penalties_and_bias_follow_openai(server, stream, presence, frequency, bias):
    client, url = server
    choices, usage = chat(client, stream, messages=MSGS, max_completion_tokens=8, temperature=0, logprobs=True,
                          presence_penalty=presence, frequency_penalty=frequency, logit_bias=bias)
    want = greedy_reference(tokenize(url, messages=MSGS), 8, presence, frequency, bias)
    assert ids_of([e["token"] for e in choices[0]["logprobs"]]) == want
    assert usage["completion_tokens"] == 8 and choices[0]["finish_reason"] == "length"


@STREAM
def test_max_completion_tokens_bounds_the_output(server, stream):
    client, _ = server
    choices, usage = chat(client, stream, messages=MSGS, max_completion_tokens=3, logit_bias=BAN_SPECIALS)
    assert usage["completion_tokens"] == 3 and choices[0]["finish_reason"] == "length"
    # max_completion_tokens wins over the older max_tokens
    choices, usage = chat(client, stream, messages=MSGS, max_completion_tokens=2, max_tokens=5,
                          logit_bias=BAN_SPECIALS)
    assert usage["completion_tokens"] == 2


@pytest.mark.parametrize("kw, param", [
    (dict(logit_bias={"97": 1}), "logit_bias"),  # the model has ids 0..96
    (dict(logit_bias={"-1": 1}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias.5"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
])
def test_bad_values_are_400s_naming_the_field(server, kw, param):
    client, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **kw)
    assert e.value.param == param
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, stream=True, **kw)
    assert e.value.param == param
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=500)
    assert e.value.param == "max_completion_tokens"
