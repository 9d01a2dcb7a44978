"""A request's engine events, one stream for all its choices, gathered per choice; usage counted as
OpenAI does (each prompt once, the completion tokens of every choice generated, best_of candidates
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
    """Usage over a request's choices, from their finishing events. With several prompts, their choices
    come `per_prompt` to a prompt, indexed prompt by prompt."""

    per_prompt: int = 0  # 0: every choice is of one prompt
    prompts: dict[int, tuple[int, int]] = field(default_factory=dict)  # prompt -> (prompt, cached) tokens
    completion_tokens: int = 0
    finished: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(p for p, _ in self.prompts.values())

    @property
    def cached_tokens(self) -> int:
        return sum(c for _, c in self.prompts.values())

    def add(self, ev: GenerationEvent) -> None:
        if ev.choice_finished:
            prompt = ev.index // self.per_prompt if self.per_prompt else 0
            self.prompts[prompt] = (ev.usage.prompt_tokens, ev.usage.cached_tokens)
            self.completion_tokens += ev.usage.completion_tokens
            self.finished += 1


def gather(events: list[GenerationEvent], per_prompt: int = 0) -> tuple[list[Choice], UsageTotal]:
    """Choices in index order, and the request's usage (`per_prompt`: as UsageTotal's)."""
    choices: dict[int, Choice] = {}
    usage = UsageTotal(per_prompt)
    for ev in events:
        choices.setdefault(ev.index, Choice(ev.index)).add(ev)
        usage.add(ev)
    return [choices[i] for i in sorted(choices)], usage


def best(choices: list[Choice], n: int, first: int = 0) -> list[Choice]:
    """The n candidates with the highest log probability per token (as OpenAI ranks best_of), best first,
    re-indexed from `first`."""
    top = sorted(choices, key=lambda c: -(c.cumulative_logprob or 0.0) / max(1, c.completion_tokens))[:n]
    for i, c in enumerate(top):
        c.index = first + i
    return top
