"""Client disconnect cancels the engine request and frees its KV slot (raw ASGI, no Ray)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import torch
from api_util import backends

from service.api.app import create_app
from service.config import GENERATOR_ID
from service.engine.types import GenerateRequest, SamplingParams
from service.metrics import PROMETHEUS

torch.set_num_threads(1)


async def call(app, body: dict, disconnect_after_chunks: int | None, disconnect_on: threading.Event | None = None,
               path: str = "/v1/generate"):
    """Drive the app like a server would; the client goes away after N body chunks (or once `disconnect_on`
    is set by the model)."""
    sent: list[dict] = []
    gone = asyncio.Event()
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    first = [True]

    async def receive():
        if first[0]:
            first[0] = False
            return {"type": "http.request", "body": payload, "more_body": False}
        if disconnect_on is not None:
            await asyncio.get_running_loop().run_in_executor(None, disconnect_on.wait, 30)
            gone.set()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if disconnect_after_chunks is not None and len(chunks) >= disconnect_after_chunks:
            gone.set()

    await asyncio.wait_for(app(scope, receive, send), timeout=60)
    return sent


def cancelled() -> float:
    return PROMETHEUS["request_success"].labels(GENERATOR_ID, "cancelled")._value.get()


def _gate(engine, after_steps: int = 3) -> threading.Event:
    """Set once the model has run `after_steps` forward passes; from then on each pass sleeps, so the
    rest of a 120-token request takes over a second and cannot end before the disconnect is seen."""
    reached, fast, calls = threading.Event(), engine.model.forward, [0]

    def forward(*args, **kw):
        calls[0] += 1
        if calls[0] >= after_steps:
            reached.set()
            time.sleep(0.01)
        return fast(*args, **kw)

    engine.model.forward = forward
    return reached


def _run(body, gated: bool = False, **kw):
    async def main():
        b = backends({"max_slots": 2}, with_translator=False)
        app = create_app(b, static_dir=None)
        await b.start()
        engine = b.generator.engine
        try:
            if gated:
                kw["disconnect_on"] = _gate(engine)
            sent = await call(app, body, **kw)
            for _ in range(200):  # the engine frees the slot on its next step
                if engine.stats().running == 0:
                    break
                await asyncio.sleep(0.01)
            return sent, engine.stats(), engine
        finally:
            await b.stop()
    return asyncio.run(main())


LONG = {"prompt": "tell me", "max_tokens": 120, "ignore_eos": True, "temperature": 0.0}


def test_stream_disconnect_cancels():
    before = cancelled()
    sent, stats, _ = _run({**LONG, "stream": True}, disconnect_after_chunks=2)
    assert cancelled() == before + 1
    chunks = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
    assert sent[0]["status"] == 200
    assert b"[DONE]" not in b"".join(m["body"] for m in chunks)
    assert stats.running == 0 and stats.slots_used == 0


def test_non_stream_disconnect_cancels():
    before = cancelled()
    sent, stats, _ = _run(LONG, gated=True, disconnect_after_chunks=None)
    assert cancelled() == before + 1
    assert not any(m["type"] == "http.response.start" and m["status"] == 200 for m in sent)
    assert stats.running == 0 and stats.slots_used == 0



def test_a_batch_of_prompts_is_cancelled_whole():
    """/v1/completions with two prompts, each its own engine request: a disconnect cancels both."""
    batch = {"prompt": ["tell me", "a story"], "max_tokens": 120, "ignore_eos": True, "temperature": 0.0}
    for body, kw in (({**batch, "stream": True}, {"disconnect_after_chunks": 2}),
                     (batch, {"gated": True, "disconnect_after_chunks": None})):
        before = cancelled()
        _, stats, _ = _run(body, path="/v1/completions", **kw)
        assert cancelled() == before + 2, body.get("stream")
        assert stats.running == 0 and stats.slots_used == 0


def test_a_client_gone_before_its_body_is_in_is_a_499_not_a_400():
    """Half the body, then the client leaves: a disconnect (499, as any), not "body could not be parsed"
    (a 400 counted as the client's bad request)."""
    async def main():
        b = backends(with_translator=False)
        app = create_app(b, static_dir=None)
        payload = json.dumps({"prompt": "hello " * 50, "max_tokens": 3}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/generate", "raw_path": b"/v1/generate", "query_string": b"",
                 "root_path": "", "headers": [(b"content-type", b"application/json"),
                                              (b"content-length", str(len(payload)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        messages = [{"type": "http.request", "body": payload[:40], "more_body": True}]
        sent: list[dict] = []

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await b.start()
        try:
            await asyncio.wait_for(app(scope, receive, send), timeout=30)
        finally:
            await b.stop()
        return sent

    sent = asyncio.run(main())
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]


def test_a_stream_gone_before_its_first_event_is_cancelled():
    """A streamed request waits for its first event before its status line: a client leaving meanwhile
    (queued behind a busy slot) cancels it there, and the queue is empty again."""
    async def main():
        b = backends({"max_slots": 1}, with_translator=False)
        app = create_app(b, static_dir=None)
        await b.start()
        engine = b.generator.engine
        held = engine.submit(GenerateRequest(prompt_ids=[7] * 4, params=SamplingParams(max_new_tokens=100,
                                                                                        ignore_eos=True)))
        gone = threading.Event()

        async def leave_once_queued():
            while (engine.stats().running, engine.stats().waiting) != (1, 1):
                await asyncio.sleep(0.01)
            gone.set()

        try:
            leaving = asyncio.ensure_future(leave_once_queued())
            sent = await call(app, {**LONG, "stream": True}, disconnect_after_chunks=None, disconnect_on=gone)
            await leaving
            for _ in range(200):
                if engine.stats().waiting == 0:
                    break
                await asyncio.sleep(0.01)
            return sent, engine.stats()
        finally:
            await held.aclose()
            await b.stop()

    before = cancelled()
    sent, stats = asyncio.run(main())
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
    assert cancelled() == before + 1 and stats.waiting == 0
