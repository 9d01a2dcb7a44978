"""Requests, events and errors shared by the engines and the HTTP layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from model.translation import (
    DEFAULT_BEAM_SIZE,
    DEFAULT_LENGTH_PENALTY,
    DEFAULT_MIN_LENGTH_RATIO,
    DEFAULT_NO_REPEAT_NGRAM,
)

FinishReason = Literal["stop", "length", "cancelled", "timeout", "error"]


class EngineError(Exception):
    """Base class for errors the HTTP layer maps to a status code."""

    status_code = 500


class EngineOverloaded(EngineError):
    """The waiting queue is full: HTTP 429 with Retry-After."""

    status_code = 429
    retry_after = 1.0  # seconds


class RequestRejected(EngineError):
    """A request that can never run (prompt too long, max_new_tokens cannot fit, ...): HTTP 400.
    The message names the limit; `param`, where set, the request field at fault."""

    status_code = 400

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def rejection(names: dict[str, str], field: str, message: str, got: object = None) -> RequestRejected:
    """RequestRejected naming `field` as the client named it (`names`: ours -> the client's, where they
    differ); "{}" in `message` stands for that name. `got`, a value the client sent, is appended after the
    substitution, so a "{}" inside it reads back as sent."""
    name = names.get(field, field)
    message = message.replace("{}", name)
    return RequestRejected(message if got is None else f"{message}, got {got!r}", name)


class EngineStopped(EngineError):
    """The engine is shutting down: HTTP 503."""

    status_code = 503


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (0 = off)
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings: matched across tokens, never emitted
    seed: int | None = None  # per-request generator: same seed -> same text whatever the batch
    ignore_eos: bool = False  # for benchmarks
    presence_penalty: float = 0.0  # OpenAI's: minus this from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # log-probabilities of the model's own distribution (before penalties, bias and temperature):
    # None = not computed; k >= 0 = each sampled token's and the k most likely alternatives
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (scoring)
    # structured output: the text must be JSON valid against this schema ({"type": "object"} for any
    # object), enforced by a token mask (service/engine/structured.py); the output ends when it is complete
    json_schema: dict | None = None


@dataclass
class GenerateRequest:
    prompt_ids: list[int]  # already tokenized (chat template applied by the caller)
    params: SamplingParams = field(default_factory=SamplingParams)
    deadline_s: float | None = None  # per-request time limit; ends with finish_reason "timeout"
    n: int = 1  # choices: one prefill, its K/V copied to n slots; choice i samples with seed + i
    # the client's names of fields whose names differ from ours ("prompt_ids" -> "messages",
    # "max_new_tokens" -> "max_completion_tokens", ...): rejections name the field the client sent
    field_names: dict[str, str] = field(default_factory=dict)


@dataclass(kw_only=True)
class TranslationSettings:
    """How a translation is decoded: the request carries them, the engine's batch takes them as they are."""

    beam_size: int = DEFAULT_BEAM_SIZE  # 1 = greedy
    length_penalty: float = DEFAULT_LENGTH_PENALTY
    no_repeat_ngram: int = DEFAULT_NO_REPEAT_NGRAM  # > 0: no n-gram of this size twice in an output
    min_length_ratio: float = DEFAULT_MIN_LENGTH_RATIO  # no EOS before this x the source's pieces
    max_length: int | None = None  # target tokens per sentence; None = relative to the source
    deadline_s: float | None = None
    # the client's names of these fields and of the request's, where they differ ("beam_size" -> "--beam"):
    # rejections name the field the client sent
    field_names: dict[str, str] = field(default_factory=dict)


@dataclass
class SourceBatch(TranslationSettings):
    """Model-ready input of the translation engine: one tagged source per sentence ([tag] + ids + [eos],
    model/translation.py), decoded with the same settings (the frontend turns texts into this)."""

    sources: list[list[int]]


@dataclass
class TranslateRequest(TranslationSettings):
    texts: list[str]
    target_lang: str | None = None  # "en" | "zh"; None = the other language, detected per text
    # "en" | "zh": every sentence with letters is translated from it; None = detected per text and sentence
    source_lang: str | None = None
    max_sentences: int | None = None  # sentences to translate the texts may hold; None = no bound


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the cache, not prefill (prefix reuse)


@dataclass
class TokenLogprob:
    """A token's log-probability and the `top` most likely tokens at its position, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


@dataclass
class GenerationEvent:
    """One streamed delta of choice `index`; a choice's last event has `finish_reason` set and that
    choice's usage. With n > 1 choices the events of all choices share one stream, which ends with the
    finishing event that has `more` False."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage = field(default_factory=Usage)
    index: int = 0
    # when the request asked: one per token id, and on a finishing event one for the end-of-sequence token
    # that ended the choice (which has no text, so no id in token_ids)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, the first None
    cumulative_logprob: float | None = None  # finishing event: sum over every sampled token (eos too)
    more: bool = False  # on a finishing event: other choices of the request are still running

    @property
    def choice_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def finished(self) -> bool:
        """The stream's last event."""
        return self.finish_reason is not None and not self.more


@dataclass
class TranslationResult:
    translations: list[str]
    source_langs: list[str]
    target_langs: list[str]
    usage: Usage
