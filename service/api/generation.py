"""Turning a validated body into an engine request: limits, tokenization (the engine checks what fits),
logit_bias ids, the number of choices."""

from __future__ import annotations

import uuid

from service.api.errors import ApiError
from service.api.schemas import ChatMessage, ChatRendering, PromptOrMessages, Sampling
from service.config import ApiLimits
from service.engine.types import GenerateRequest, SamplingParams
from service.frontend.generator import GeneratorFrontend


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def check_prompt(text: str, limits: ApiLimits, param: str) -> None:
    if len(text) > limits.max_prompt_chars:
        raise ApiError(400, f"{param} is {len(text)} characters; the limit is {limits.max_prompt_chars}", param)


def encode_messages(gen: GeneratorFrontend, messages: list[ChatMessage], limits: ApiLimits,
                    rendering: ChatRendering | None = None) -> list[int]:
    if len(messages) > limits.max_messages:
        raise ApiError(400, f"messages has {len(messages)} entries; the limit is {limits.max_messages}", "messages")
    # a message's name goes to the template where given, as HF's and vLLM's pass it ({{ message.name }})
    plain = [{"role": m.template_role, "content": m.text(), **({"name": m.name} if m.name is not None else {})}
             for m in messages]
    check_prompt("".join(m["content"] for m in plain), limits, "messages")
    r = rendering or ChatRendering()
    return gen.encode_chat(plain, r.add_generation_prompt, r.continue_final_message)


def encode_input(gen: GeneratorFrontend, body: PromptOrMessages, limits: ApiLimits) -> tuple[list[int], str]:
    """The ids of a body's `prompt` or chat `messages`, and the name of the one it sent."""
    if body.prompt is None:
        rendering = body if isinstance(body, ChatRendering) else None
        return encode_messages(gen, body.messages, limits, rendering), "messages"
    check_prompt(body.prompt, limits, "prompt")
    return gen.encode_prompt(body.prompt), "prompt"


def check_choices(gen: GeneratorFrontend, n: int, limits: ApiLimits, param: str) -> None:
    """n (or best_of) choices: within ApiLimits.max_n and the engine's slots, or a 400 naming the field."""
    most = min(limits.max_n, gen.max_choices)
    if n > most:
        why = (f"the limit is {limits.max_n}" if limits.max_n <= gen.max_choices
               else f"model {gen.name} runs at most {gen.max_choices} sequences at once")
        raise ApiError(400, f"{param}={n}: {why}; use {param} <= {most}", param)


def logit_bias_ids(gen: GeneratorFrontend, bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's {"token id": bias} -> {id: bias}, or a 400 naming logit_bias and the bad key."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        tid = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= tid < gen.vocab_size:
            raise ApiError(400, f"logit_bias: key {key!r} is not a token id of model {gen.name} "
                                f"(a decimal integer in [0, {gen.vocab_size}))", "logit_bias")
        out[tid] = value
    return out


def build_request(gen: GeneratorFrontend, body: Sampling, prompt_ids: list[int], *, prompt_param: str,
                  max_tokens: int | None, default_max_tokens: int, limits: ApiLimits,
                  max_tokens_param: str = "max_tokens", n: int = 1, logprobs: int | None = None,
                  prompt_logprobs: int | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                  logit_bias: dict[str, float] | None = None, json_schema: dict | None = None) -> GenerateRequest:
    """The engine request for a validated body; the engine's check of what fits (`submit`) names the field
    as the client named it (`prompt_param`, `max_tokens_param`)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > limits.max_stop:
        raise ApiError(400, f"stop has {len(stop)} strings; the limit is {limits.max_stop}", "stop")
    if not all(0 < len(s) <= limits.max_stop_chars for s in stop):
        raise ApiError(400, f"each stop string must have 1..{limits.max_stop_chars} characters", "stop")
    bias = logit_bias_ids(gen, logit_bias)
    room = gen.max_context - len(prompt_ids)
    params = SamplingParams(
        max_new_tokens=max_tokens if max_tokens is not None else max(1, min(default_max_tokens, room)),
        temperature=body.temperature, top_k=max(body.top_k, 0), top_p=body.top_p, min_p=body.min_p,
        repetition_penalty=body.repetition_penalty, stop=stop, seed=body.seed, ignore_eos=body.ignore_eos,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, logit_bias=bias, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, json_schema=json_schema)
    names = {"prompt_ids": prompt_param, "max_new_tokens": max_tokens_param, "json_schema": "response_format"}
    return GenerateRequest(prompt_ids=prompt_ids, params=params, n=n, field_names=names)


def usage_dict(usage) -> dict:
    """OpenAI's usage object from an engine Usage (or a `UsageTotal`); `prompt_tokens_details.cached_tokens`
    counts the prompt tokens served from cached prefixes, as OpenAI and vLLM report them."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
