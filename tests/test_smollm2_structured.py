"""Structured output on the real SmolLM2-135M-Instruct, through the served app and the openai SDK, 16
requests at a time: greedy, every shipped schema (loadtests/data/schemas/) gives JSON that parses and
validates (100 %), ended by the grammar ("stop") well within max_tokens; sampled, every output the grammar
ended validates.

Slow: needs the converted SmolLM2 checkpoint (fetched and converted once by ensure_smollm2)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import torch
from live_app import serve_in_thread

from loadtests.schemas import chat_messages, load_schemas
from model.checkpoint import load_checkpoint, load_tokenizer
from model.importers.smollm2 import ensure_smollm2
from service.api.app import create_app
from service.api.backends import Backends
from service.config import GENERATOR_ID, TRANSLATOR_ID
from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.frontend.generator import GeneratorFrontend

pytestmark = pytest.mark.slow
SCHEMAS = load_schemas()
MAX_TOKENS = 512


@pytest.fixture(scope="module")
def client():
    d = ensure_smollm2("float32")
    tok = load_tokenizer(d)
    engine = GenerationEngine(load_checkpoint(d, dtype=torch.float32), tok,
                              EngineConfig(max_slots=16, max_seq_len=2048, threads=1), eos_ids=tok.stop_ids(),
                              name=GENERATOR_ID)
    backends = Backends(generator=GeneratorFrontend(engine, tok, name=GENERATOR_ID, chat_template=tok.chat_template),
                        unavailable={TRANSLATOR_ID: "not in this test"})
    with serve_in_thread(create_app(backends, None, manage_engines=True, api_keys=[])) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def ask(client, schema: dict, **sampling) -> tuple[str, str]:
    out = client.chat.completions.create(
        model=GENERATOR_ID, messages=chat_messages(schema), max_tokens=MAX_TOKENS, **sampling,
        response_format={"type": "json_schema", "json_schema": {"name": schema["title"], "schema": schema,
                                                                "strict": True}})
    return out.choices[0].message.content, out.choices[0].finish_reason


def answers(client, **sampling) -> list[tuple[dict, str, str]]:
    with ThreadPoolExecutor(16) as pool:
        return [(s, *a) for s, a in zip(SCHEMAS, pool.map(lambda s: ask(client, s, **sampling), SCHEMAS))]


def problems(results, allow_length: bool) -> list[str]:
    bad = []
    for schema, text, finish in results:
        if allow_length and finish == "length":
            continue
        try:
            assert finish == "stop", f"finish_reason {finish}"
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append(f"{schema['title']}: {str(e)[:200]} <- {text[:200]!r}")
    return bad


def test_every_shipped_schema_gives_valid_json_greedy(client):
    assert len(SCHEMAS) >= 20
    bad = problems(answers(client, temperature=0), allow_length=False)
    assert not bad, "\n".join(bad)


def test_sampled_outputs_ended_by_the_grammar_are_all_valid(client):
    """Sampling can run a number's digits on forever (JSON numbers have no length bound): those end at
    max_tokens with "length", never as invalid JSON reported as complete."""
    results = answers(client, temperature=0.8, top_p=0.95, seed=7)
    bad = problems(results, allow_length=True)
    assert not bad, "\n".join(bad)
    assert sum(finish == "stop" for _, _, finish in results) >= len(results) - 2
