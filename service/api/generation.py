"""Turning a validated body into an engine request: limits, tokenization, "max_tokens fits"."""

from __future__ import annotations

import uuid

from service.api.backends import GeneratorBackend
from service.api.errors import ApiError
from service.api.schemas import ChatMessage, Sampling
from service.config import ApiLimits
from service.engine.types import GenerateRequest, SamplingParams


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def check_prompt(text: str, limits: ApiLimits, param: str) -> None:
    if len(text) > limits.max_prompt_chars:
        raise ApiError(400, f"{param} is {len(text)} characters; the limit is {limits.max_prompt_chars}", param)


def encode_messages(gen: GeneratorBackend, messages: list[ChatMessage], limits: ApiLimits) -> list[int]:
    if len(messages) > limits.max_messages:
        raise ApiError(400, f"messages has {len(messages)} entries; the limit is {limits.max_messages}", "messages")
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    check_prompt("".join(m["content"] for m in plain), limits, "messages")
    return gen.encode_chat(plain)


def check_stop(stop: list[str], limits: ApiLimits) -> None:
    if len(stop) > limits.max_stop:
        raise ApiError(400, f"stop has {len(stop)} strings; the limit is {limits.max_stop}", "stop")
    for s in stop:
        if not s or len(s) > limits.max_stop_chars:
            raise ApiError(400, f"each stop string must have 1..{limits.max_stop_chars} characters", "stop")


def build_request(gen: GeneratorBackend, body: Sampling, prompt_ids: list[int], *, prompt_param: str,
                  max_tokens: int | None, default_max_tokens: int, limits: ApiLimits, top_k: int = 0,
                  repetition_penalty: float = 1.0, ignore_eos: bool = False,
                  request_id: str = "") -> GenerateRequest:
    """An engine request whose prompt + output fits the model's context, or a 400 naming the field."""
    stop = body.stop_list()
    check_stop(stop, limits)
    if not prompt_ids:
        raise ApiError(400, f"{prompt_param} is empty", prompt_param)
    room = gen.max_context - len(prompt_ids)
    if room < 1:
        raise ApiError(400, f"{prompt_param} is {len(prompt_ids)} tokens; the context holds "
                            f"{gen.max_context} tokens including the output", prompt_param)
    if max_tokens is not None and max_tokens > room:
        raise ApiError(400, f"max_tokens={max_tokens} does not fit: the prompt is {len(prompt_ids)} tokens "
                            f"and the context holds {gen.max_context}; use max_tokens <= {room}", "max_tokens")
    params = SamplingParams(
        max_new_tokens=max_tokens if max_tokens is not None else min(default_max_tokens, room),
        temperature=body.temperature, top_k=top_k, top_p=body.top_p, repetition_penalty=repetition_penalty,
        stop=stop, seed=body.seed, ignore_eos=ignore_eos)
    return GenerateRequest(prompt_ids=prompt_ids, params=params, request_id=request_id)


def usage_dict(usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
