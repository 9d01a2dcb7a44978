"""A request's engine events, one stream for all its choices, gathered per choice; usage counted as
OpenAI does (the prompt once, the completion tokens of every choice generated, best_of candidates
included); best_of's pick of the n most likely candidates."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.engine.types import GenerationEvent, TokenLogprob


@dataclass
class Choice:
    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0  # every sampled token, an end-of-sequence token included
    cumulative_logprob: float | None = None

    def add(self, ev: GenerationEvent) -> None:
        self.text += ev.text
        self.logprobs += ev.logprobs or []
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        if ev.choice_finished:
            self.finish_reason = ev.finish_reason
            self.completion_tokens = ev.usage.completion_tokens
            self.cumulative_logprob = ev.cumulative_logprob


@dataclass
class UsageTotal:
    """Usage over a request's choices, from their finishing events."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finished: int = 0

    def add(self, ev: GenerationEvent) -> None:
        if ev.choice_finished:
            self.prompt_tokens = ev.usage.prompt_tokens
            self.cached_tokens = ev.usage.cached_tokens
            self.completion_tokens += ev.usage.completion_tokens
            self.finished += 1


def gather(events: list[GenerationEvent]) -> tuple[list[Choice], UsageTotal]:
    """Choices in index order, and the request's usage."""
    choices: dict[int, Choice] = {}
    usage = UsageTotal()
    for ev in events:
        choices.setdefault(ev.index, Choice(ev.index)).add(ev)
        usage.add(ev)
    return [choices[i] for i in sorted(choices)], usage


def best(choices: list[Choice], n: int) -> list[Choice]:
    """The n candidates with the highest log probability per token (as OpenAI ranks best_of), best first,
    re-indexed 0..n-1."""
    top = sorted(choices, key=lambda c: -(c.cumulative_logprob or 0.0) / max(1, c.completion_tokens))[:n]
    for i, c in enumerate(top):
        c.index = i
    return top
