"""Structured output through the official `openai` SDK against the served app, streamed and not:
response_format json_object and json_schema on chat and completions, `chat.completions.parse` (and the beta
path) and the `stream` helper with a pydantic model, n choices, and the refusals (400 naming the field).

The tiny model runs with CharTokenizer(100): the default 97 ids lack '}' (service/engine/structured.py then
ends a row with an error rather than invalid JSON, tests/test_engine_structured.py)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Literal

import jsonschema
import openai
import pytest
import torch
from api_util import TEMPLATE
from engine_util import CharTokenizer, tiny_llama
from live_app import serve_in_thread
from openai_sdk_util import MODEL, chat, completion
from pydantic import BaseModel, Field

from service.api.app import create_app
from service.api.backends import Backends
from service.config import TRANSLATOR_ID
from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.frontend.generator import GeneratorFrontend
from service.metrics import EngineMetrics

torch.set_num_threads(1)
TOK = CharTokenizer(100)
MSGS = [{"role": "user", "content": "Weather?"}]
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"},
    "temp": {"type": "integer", "minimum": -20, "maximum": 45}, "note": {"type": "string", "maxLength": 8}},
    "required": ["city", "sunny", "temp", "note"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


class Forecast(BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool
    days: list[Literal["mon", "tue"]] = Field(max_length=2)


@contextmanager
def served():
    engine = GenerationEngine(tiny_llama(vocab_size=TOK.vocab_size), TOK,
                              EngineConfig(max_slots=4, max_seq_len=128, prefill_chunk=32),
                              eos_ids={TOK.eos_id}, sink=EngineMetrics())
    backends = Backends(generator=GeneratorFrontend(engine, TOK, chat_template=TEMPLATE),
                        unavailable={TRANSLATOR_ID: "not in this test"})
    with serve_in_thread(create_app(backends, None, manage_engines=True, api_keys=[])) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client():
    with served() as c:
        yield c


def valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@STREAMS
def test_chat_json_schema(client, stream):
    choices, usage = chat(client, stream, messages=MSGS, max_tokens=80, temperature=0, response_format=FORMAT)
    assert choices[0]["finish_reason"] == "stop"
    valid(choices[0]["content"], SCHEMA)
    assert usage["completion_tokens"] == len(TOK.encode(choices[0]["content"]))  # no end-of-sequence token


@STREAMS
def test_chat_json_schema_sampled_n_choices(client, stream):
    choices, _ = chat(client, stream, messages=MSGS, max_tokens=80, temperature=1.0, seed=3, n=3,
                      response_format=FORMAT)
    assert sorted(choices) == [0, 1, 2]
    for c in choices.values():
        assert c["finish_reason"] == "stop"
        valid(c["content"], SCHEMA)


@STREAMS
def test_chat_json_object_mode(client, stream):
    """JSON mode: a JSON object, any keys (this model, greedy, closes it within the budget)."""
    choices, _ = chat(client, stream, messages=MSGS, max_tokens=100, temperature=0,
                      response_format={"type": "json_object"})
    assert choices[0]["finish_reason"] == "stop"
    assert isinstance(valid(choices[0]["content"], {"type": "object"}), dict)


@STREAMS
def test_completions_json_schema(client, stream):
    choices, _ = completion(client, stream, prompt="JSON: ", max_tokens=80, temperature=0,
                            extra_body={"response_format": FORMAT})
    assert choices[0]["finish_reason"] == "stop"
    valid(choices[0]["text"], SCHEMA)


def test_completions_json_schema_with_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL, prompt="JSON: ", max_tokens=80, temperature=0, echo=True,
                                    logprobs=1, extra_body={"response_format": FORMAT})
    c = out.choices[0]
    assert c.text.startswith("JSON: ")
    valid(c.text[len("JSON: "):], SCHEMA)
    assert "".join(c.logprobs.tokens) == c.text


@pytest.mark.parametrize("parse", ["chat", "beta"])
def test_parse_with_a_pydantic_model(client, parse):
    api = client.chat.completions if parse == "chat" else client.beta.chat.completions
    out = api.parse(model=MODEL, messages=MSGS, max_tokens=80, temperature=0, response_format=Forecast)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "stop" and msg.refusal is None
    assert isinstance(msg.parsed, Forecast)
    assert msg.parsed == Forecast.model_validate_json(msg.content)


def test_stream_helper_with_a_pydantic_model(client):
    with client.chat.completions.stream(model=MODEL, messages=MSGS, max_tokens=80, temperature=0,
                                        response_format=Forecast) as s:
        deltas = [e.delta for e in s if e.type == "content.delta"]
        final = s.get_final_completion()
    msg = final.choices[0].message
    assert isinstance(msg.parsed, Forecast) and "".join(deltas) == msg.content


def test_text_format_is_plain_generation(client):
    a, _ = chat(client, False, messages=MSGS, max_tokens=12, temperature=0, response_format={"type": "text"})
    b, _ = chat(client, False, messages=MSGS, max_tokens=12, temperature=0)
    assert a == b


REFUSALS = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
     "response_format", "uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "("}}},
     "response_format", "regex"),
    ({"type": "json_schema"}, "response_format", "json_schema"),
    ({"type": "json_object", "json_schema": FORMAT["json_schema"]}, "response_format", "json_schema"),
    ({"type": "xml"}, "response_format.type", "json_object"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "response_format.json_schema.name",
     "pattern"),
]


@STREAMS
@pytest.mark.parametrize("fmt, param, words", REFUSALS)
def test_refusals_name_the_field(client, stream, fmt, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, stream=stream, response_format=fmt)
    assert e.value.param == param and words in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=stream,
                                  extra_body={"response_format": fmt})
    assert e.value.param == param and words in e.value.message


def test_ignore_eos_with_a_schema_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, response_format=FORMAT,
                                       extra_body={"ignore_eos": True})
    assert e.value.param == "ignore_eos" and "response_format" in e.value.message


def test_a_schema_the_vocabulary_cannot_spell_is_an_error_not_content(client):
    """CharTokenizer(100) has no 'é': the grammar fails mid-answer. The client gets an error naming the field,
    never a 200 whose content is a diagnostic instead of JSON; streamed, an error event."""
    fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": {"type": "string", "enum": ["é"]}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, response_format=fmt)
    assert e.value.param == "response_format" and "cannot follow the schema" in e.value.message
    with pytest.raises(openai.APIError, match="cannot follow the schema") as e:
        for _ in client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, response_format=fmt,
                                                stream=True):
            pass
    assert e.value.body["param"] == "response_format"  # the streamed error names the field too


def test_a_schema_that_cannot_be_satisfied_is_named_without_the_parser_dump(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {  # an object that must contain itself
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, response_format=fmt)
    assert e.value.param == "response_format" and "too complex or unsatisfiable" in e.value.message
    assert "<state>" not in e.value.message and len(e.value.message) < 400
