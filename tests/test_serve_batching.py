"""The serve_batch baseline's batch loop: one request's failure reaches that request alone, and a batch
closed early closes the engine streams it still holds (which cancels their requests)."""

from __future__ import annotations

import asyncio

from service.engine.types import GenerationEvent, RequestRejected
from service.serve_batching import ServeBatchGenerator


class FakeEngine:
    """Request i streams i + 1 events, the last finished; the request named "bad" fails at its second."""

    def __init__(self):
        self.closed: list[str] = []

    def submit(self, req):
        async def stream():
            try:
                for k in range(req["events"]):
                    if req["name"] == "bad" and k == 1:
                        raise RequestRejected("output cannot follow the schema", "response_format")
                    yield GenerationEvent(text=f"{req['name']}{k}",
                                          finish_reason="stop" if k == req["events"] - 1 else None)
            finally:
                self.closed.append(req["name"])
        return stream()


class Batch:
    def __init__(self):
        self.engine = FakeEngine()

    run = ServeBatchGenerator._run_batch


async def steps(reqs, limit=None) -> tuple[list[list], list[str]]:
    b = Batch()
    gen = b.run(reqs)
    out = []
    async for step in gen:
        out.append(step)
        if limit is not None and len(out) == limit:
            await gen.aclose()
            break
    return out, list(b.engine.closed)  # now, not when the event loop finalises what was left open


def test_a_failing_request_fails_alone_and_the_others_finish():
    reqs = [{"name": "a", "events": 3}, {"name": "bad", "events": 3}, {"name": "c", "events": 2}]
    out, closed = asyncio.run(steps(reqs))
    assert len(out) == 3
    assert [ev.text for ev in out[0]] == ["a0", "bad0", "c0"]
    assert isinstance(out[1][1], RequestRejected) and out[1][1].param == "response_format"
    assert out[1][0].text == "a1" and out[1][2].finish_reason == "stop"
    assert out[2][0].finish_reason == "stop" and out[2][1] is StopIteration and out[2][2] is StopIteration
    assert sorted(closed) == ["a", "bad", "c"]


def test_a_batch_closed_early_closes_its_open_streams():
    reqs = [{"name": "a", "events": 5}, {"name": "b", "events": 1}]
    out, closed = asyncio.run(steps(reqs, limit=1))
    assert out[0][1].finish_reason == "stop"
    assert sorted(closed) == ["a", "b"]  # "a" was still open: closing it is what cancels its request
