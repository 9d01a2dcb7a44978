"""The `serve_batch` mode: Ray Serve's request-level batching (`@serve.batch`) in front of the engine.

Requests that arrive within `wait_s` (up to `batch_size`) are submitted to the engine together and
streamed back in lockstep; later requests wait for the whole batch to finish (new requests cannot
join a running `@serve.batch` generator, ray#36098). This is the baseline the engine's own
iteration-level batching is compared against. A disconnect frees its slot when its batch ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ray import serve

from service.engine.types import EngineError, GenerateRequest, GenerationEvent
from service.frontend.generator import GeneratorFrontend


class ServeBatchGenerator(GeneratorFrontend):
    def __init__(self, inner: GeneratorFrontend, batch_size: int, wait_s: float):
        super().__init__(inner.engine, inner.tokenizer, name=inner.name, chat_template=inner.chat_template)
        self._batched = serve.batch(max_batch_size=batch_size, batch_wait_timeout_s=wait_s)(self._run_batch)

    async def _run_batch(self, reqs: list[GenerateRequest]) -> AsyncIterator[list]:
        """One list per step: the next event of each request, or StopIteration once it has ended."""
        streams: list = []
        for r in reqs:
            try:
                streams.append(self.engine.submit(r))
            except EngineError as e:
                streams.append(e)
        done = [False] * len(reqs)
        try:
            while not all(done):
                out: list = []
                for i, s in enumerate(streams):
                    if done[i]:
                        item = StopIteration
                    elif isinstance(s, Exception):
                        item = s
                    else:
                        try:
                            item = await anext(s)
                        except EngineError as e:  # this request's failure, to it alone: raised out of the
                            item = e              # batch generator, Serve would hand it to every caller in the batch
                    done[i] = item is StopIteration or isinstance(item, Exception) or item.finished
                    out.append(item)
                yield out
        finally:  # now, not at garbage collection: a batch closed early (its callers gone) cancels what it streams
            for s in streams:
                if not isinstance(s, Exception):
                    await s.aclose()

    def submit(self, req: GenerateRequest) -> AsyncIterator[GenerationEvent]:
        # the batch submits to the engine later: its check of what fits runs now, so a bad request is a 400
        self.engine.validate(req)
        return self._stream(req)

    def submit_all(self, reqs: list[GenerateRequest]) -> list[AsyncIterator[GenerationEvent]]:
        return [self.submit(req) for req in reqs]  # each checked for room when its batch submits it

    async def _stream(self, req: GenerateRequest) -> AsyncIterator[GenerationEvent]:
        async for item in self._batched(req):
            if isinstance(item, Exception):
                raise item
            yield item
