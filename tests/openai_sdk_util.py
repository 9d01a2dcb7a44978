"""Helpers for the tests that drive the app with the official `openai` SDK over real HTTP: a served app on
a tiny fp32 model, responses gathered per choice whether streamed or not, and references computed by
full forwards of the same model."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import httpx
import openai
import torch
from api_util import TOK, backends
from engine_util import tiny_llama
from live_app import serve_in_thread

from service.api.app import create_app
from service.config import GENERATOR_ID, ApiLimits

MODEL = GENERATOR_ID
TOL = 1e-4
# the char tokenizer decodes its 5 special ids to "": banning them keeps every output token readable back
BAN_SPECIALS = {str(i): -100 for i in range(5)}
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")
LP_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


@contextmanager
def served(limits: ApiLimits | None = None):
    """(openai client, base URL) of the app on loopback, no API keys."""
    app = create_app(backends(with_translator=False), limits, manage_engines=True, api_keys=[])
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60), url


def tokenize(url: str, **body) -> list[int]:
    r = httpx.post(url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def ids_of(tokens: list[str]) -> list[int]:
    return [TOK.stoi[t] for t in tokens]


def _usage(u) -> dict:
    return {k: getattr(u, k) for k in USAGE_KEYS}


def completion(client: openai.OpenAI, stream: bool, **kw) -> tuple[dict[int, dict], dict]:
    """{index: {text, logprobs (completions shape or None), finish_reason}}, usage — from one response or
    from the chunks of a stream."""
    if not stream:
        out = client.completions.create(model=MODEL, **kw)
        return ({c.index: {"text": c.text, "finish_reason": c.finish_reason,
                           "logprobs": {k: getattr(c.logprobs, k) for k in LP_KEYS} if c.logprobs else None}
                 for c in out.choices}, _usage(out.usage))
    choices: dict[int, dict] = {}
    usage = None
    for chunk in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = _usage(chunk.usage)
        for c in chunk.choices:
            d = choices.setdefault(c.index, {"text": "", "finish_reason": None, "logprobs": None})
            d["text"] += c.text
            if c.logprobs is not None:
                lp = d["logprobs"] = d["logprobs"] or {k: [] for k in LP_KEYS}
                for k in LP_KEYS:
                    lp[k] += getattr(c.logprobs, k)
            if c.finish_reason is not None:
                assert d["finish_reason"] is None
                d["finish_reason"] = c.finish_reason
    return choices, usage


def chat(client: openai.OpenAI, stream: bool, **kw) -> tuple[dict[int, dict], dict]:
    """{index: {content, logprobs (list of content entries as dicts, or None), finish_reason}}, usage."""
    if not stream:
        out = client.chat.completions.create(model=MODEL, **kw)
        return ({c.index: {"content": c.message.content, "finish_reason": c.finish_reason,
                           "logprobs": [e.model_dump() for e in c.logprobs.content] if c.logprobs else None}
                 for c in out.choices}, _usage(out.usage))
    choices: dict[int, dict] = {}
    usage = None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                **kw):
        if chunk.usage is not None:
            usage = _usage(chunk.usage)
        for c in chunk.choices:
            d = choices.setdefault(c.index, {"content": "", "finish_reason": None, "logprobs": None})
            if d["content"] == "" and c.delta.role is not None:
                assert c.delta.role == "assistant"
            d["content"] += c.delta.content or ""
            if c.logprobs is not None:
                d["logprobs"] = (d["logprobs"] or []) + [e.model_dump() for e in c.logprobs.content]
            if c.finish_reason is not None:
                assert d["finish_reason"] is None
                d["finish_reason"] = c.finish_reason
    return choices, usage


_MODEL = None


def reference(ids: list[int]) -> torch.Tensor:
    """Log-probabilities at every position of `ids` from one cache-free fp32 forward: (T, V)."""
    global _MODEL
    if _MODEL is None:
        _MODEL = tiny_llama()
    with torch.no_grad():
        return torch.log_softmax(_MODEL(torch.tensor([ids])).float()[0], -1)


def greedy_reference(prompt_ids: list[int], steps: int, presence: float = 0.0, frequency: float = 0.0,
                     bias: dict[str, float] | None = None) -> list[int]:
    """Greedy decoding with OpenAI's penalties and logit bias, one full forward per token."""
    out: list[int] = []
    for _ in range(steps):
        x = reference(prompt_ids + out)[-1].clone()
        for t, b in (bias or {}).items():
            x[int(t)] += b
        for t, n in Counter(out).items():
            x[t] -= n * frequency + presence
        out.append(int(x.argmax()))
    return out


def same_up_to_float(a, b, tol: float = TOL) -> bool:
    """Nested responses equal, floats within `tol`: a repeated prompt reads its prefix's K/V from the cache
    (prefix reuse), computed in a forward of another shape, so logprobs agree to rounding, not bits."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_up_to_float(a[k], b[k], tol) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_up_to_float(x, y, tol) for x, y in zip(a, b, strict=True))
    return a == b
