"""Server-sent events and client-disconnect handling.

A streamed response stops when the client goes away (Starlette cancels the body iterator); the
`finally` here closes the engine's iterator, which cancels the request and frees its KV slot.
A non-streamed request races its work against `http.disconnect` and cancels the work on a disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from service.api.errors import engine_error, error_body
from service.engine.types import EngineError

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def sse_stream(source: AsyncGenerator, render: Callable[[object], list[dict]],
                     tail: Callable[[], list[dict]] | None = None) -> AsyncIterator[bytes]:
    """Render each engine event as zero or more SSE `data:` lines, then `tail()`, then `[DONE]`.
    An engine error mid-stream becomes one error event (the status line has already been sent)."""
    try:
        async for event in source:
            for chunk in render(event):
                yield sse(chunk)
        for chunk in tail() if tail else []:
            yield sse(chunk)
    except EngineError as e:
        a = engine_error(e)
        yield sse(error_body(a.status, a.message, a.param))
    finally:
        await source.aclose()
    yield sse("[DONE]")


async def started(request: Request, source: AsyncGenerator) -> AsyncGenerator:
    """`source` once its first event is in: an error before it (the engine stopped, a step that failed, a
    batch with no room) raises here, while the status line can still be the error's, as the request's
    answer without streaming is. A client gone meanwhile cancels the request (ClientDisconnected)."""
    try:
        first = await unless_disconnected(request, anext(source))
    except StopAsyncIteration:  # no events at all: nothing to start with
        return source
    except BaseException:
        await source.aclose()
        raise

    async def rest() -> AsyncGenerator:
        try:
            yield first
            async for event in source:
                yield event
        finally:
            await source.aclose()
    return rest()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected


async def collect(source: AsyncGenerator) -> list:
    """All events of an engine stream (closing it even when cancelled)."""
    try:
        return [event async for event in source]
    finally:
        await source.aclose()


async def merged(sources: list[AsyncGenerator], stride: int) -> AsyncGenerator:
    """The events of several engine streams as they come, source i's choices indexed from i * stride (the
    prompts of one completions request). An error in one ends the whole; closing it closes every source,
    which cancels what still runs."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, source: AsyncGenerator) -> None:
        try:
            async for ev in source:
                queue.put_nowait(dataclasses.replace(ev, index=ev.index + i * stride))
            queue.put_nowait(None)
        except Exception as e:  # the reader raises it
            queue.put_nowait(e)
        finally:
            await source.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    try:
        for _ in sources:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
