"""One choice of a generation request while it waits or runs: the generation engine's unit of work
(one cache slot), with what its output processing keeps between tokens."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from model.tokenizer import IncrementalDetokenizer
from service.engine.scheduler import Expiry
from service.engine.stopping import StopMatcher
from service.engine.types import GenerationEvent, SamplingParams, TokenLogprob


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue  # the request's event stream, shared by its choices
    detok: IncrementalDetokenizer
    stopper: StopMatcher
    generator: torch.Generator | None
    deadline: float | None  # time.monotonic() limit
    t_submit: float
    slots: list[int] = field(default_factory=list)  # its one cache slot while admitted
    n_cached: int = 0  # tokens whose K/V are in the cache
    n_reused: int = 0  # prompt tokens whose K/V were copied from a cached prefix (service/engine/prefix_reuse.py)
    output: list[int] = field(default_factory=list)
    t_admit: float = 0.0
    t_last: float = 0.0
    cancelled: bool = False
    outbox: list[GenerationEvent] = field(default_factory=list)  # staged by the worker thread
    # (finish reason, last text, last ids, their logprobs), set by the worker
    done: tuple[str, str, list[int], list[TokenLogprob] | None] | None = None
    finish_reason: str | None = None  # set on the event loop when the final event is queued
    error: Exception | None = None  # with done[0] == "error": what its stream's reader gets raised
    index: int = 0  # which of the request's choices
    group: list[Sequence] = field(default_factory=list)  # every choice of the request, this one included
    forks: list[Sequence] = field(default_factory=list)  # choices waiting for this one's prefill
    pending_fork: bool = False  # holds a slot, waiting for the K/V of the choice that prefills
    prompt_lp: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs: filled by prefill
    cum_logprob: float = 0.0  # with params.logprobs: sum over the sampled tokens
    matcher: object | None = None  # with params.json_schema: this choice's grammar state
    schema_field: str = "json_schema"  # the request's name for its schema, in errors
    slots_needed = 1  # not a field (no annotation): a choice holds one KV slot

    @property
    def slot(self) -> int:
        return self.slots[0] if self.slots else -1

    @property
    def cached_ids(self) -> list[int]:
        """The tokens whose K/V its slot holds, in order (the last sampled token is not yet among them)."""
        return (self.prompt + self.output)[:self.n_cached]

    @property
    def kv_len(self) -> int:
        return self.n_cached

    def expired(self, now: float) -> Expiry | None:
        if self.cancelled:
            return "cancelled"
        return "timeout" if self.deadline is not None and now > self.deadline else None
