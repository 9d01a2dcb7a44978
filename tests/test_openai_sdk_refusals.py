"""What the server refuses, through the official `openai` SDK, streamed and not: a 400 that names the field
and says what to change (tools, out-of-range logprobs, max_tokens 0 without echo). Structured output's own
refusals: tests/test_openai_sdk_structured.py."""

from __future__ import annotations

import openai
import pytest
import torch
from openai_sdk_util import MODEL, served

torch.set_num_threads(1)
MSGS = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}

@pytest.fixture(scope="module")
def client():
    with served() as (c, _):
        yield c


CHAT = [
    (dict(tools=[TOOL]), "tools", "cannot call tools"),
    (dict(tools=[TOOL], tool_choice="auto"), "tools", "cannot call tools"),
    (dict(tool_choice="required"), "tool_choice", "cannot call tools"),
    (dict(functions=[TOOL["function"]]), "functions", "cannot call tools"),
    (dict(top_logprobs=2), "top_logprobs", "logprobs: true"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "20"),
    (dict(n=0), "n", "greater than or equal to 1"),
]
COMPLETIONS = [
    (dict(logprobs=6), "logprobs", "5"),
    (dict(max_tokens=0), "max_tokens", "echo"),
    (dict(max_tokens=0, logprobs=1), "max_tokens", "echo"),
    (dict(suffix="x"), "suffix", "Extra inputs"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kw, param, words", CHAT)
def test_chat_refusals_name_the_field(client, stream, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, stream=stream, **kw)
    assert e.value.param == param and words in e.value.message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kw, param, words", COMPLETIONS)
def test_completion_refusals_name_the_field(client, stream, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", stream=stream, **{"max_tokens": 2, **kw})
    assert e.value.param == param and words in e.value.message


def test_text_format_and_no_tool_choice_are_served(client):
    out = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, response_format={"type": "text"},
                                         tool_choice="none")
    assert out.choices[0].finish_reason in ("length", "stop")
