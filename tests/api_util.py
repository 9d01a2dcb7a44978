"""Helpers for the HTTP API tests: the real engines on random tiny models behind the real app, no Ray."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
from engine_util import CharTokenizer, tiny_llama

from service.api.app import create_app
from service.api.backends import Backends
from service.config import TRANSLATOR_ID, ApiLimits
from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.frontend.generator import GeneratorFrontend
from service.metrics import EngineMetrics

TOK = CharTokenizer()
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }} | {% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def generator(**engine_kw) -> GeneratorFrontend:
    cfg = EngineConfig(**{"max_slots": 4, "max_seq_len": 128, "prefill_chunk": 32, **engine_kw})
    engine = GenerationEngine(tiny_llama(), TOK, cfg, eos_ids={TOK.eos_id}, sink=EngineMetrics())
    return GeneratorFrontend(engine, TOK, chat_template=TEMPLATE)


def translator(**engine_kw):
    from engine_util import tiny_seq2seq

    from service.engine.translation import TranslationEngine
    from service.frontend.translator import TranslationFrontend

    cfg = EngineConfig(**{"max_slots": 8, "max_seq_len": 64, **engine_kw})
    return TranslationFrontend(TranslationEngine(tiny_seq2seq(), cfg, sink=EngineMetrics()), TOK)


def backends(gen_kw: dict | None = None, with_translator: bool = True) -> Backends:
    b = Backends(generator=generator(**(gen_kw or {})))
    tr = translator() if with_translator else None
    if tr is None:
        b.unavailable[TRANSLATOR_ID] = "no translator checkpoint in this test"
    else:
        b.translator = tr
    return b


@asynccontextmanager
async def client(b: Backends | None = None, limits: ApiLimits | None = None, *, root_path: str = "", **app_kw):
    """`root_path`: the app mounted under a route prefix, as Serve's proxy passes it."""
    b = b if b is not None else backends()
    app = create_app(b, limits, **app_kw)
    await b.start()
    try:
        transport = httpx.ASGITransport(app=app, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            c.app = app
            yield c
    finally:
        await b.stop()


def run(coro_fn, *args, **kw):
    """Run `coro_fn(client)` against a fresh app and engines."""
    async def main():
        async with client(*args, **kw) as c:
            return await coro_fn(c)
    return asyncio.run(main())


def sse_events(text: str) -> list:
    """Parse an SSE body into JSON payloads; the `[DONE]` sentinel stays a string."""
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
