"""The engine's token log-probabilities in OpenAI's two response shapes.

Completions: `{tokens, token_logprobs, top_logprobs, text_offset}` (parallel lists; a prompt's first
token has no logprob: None), `top_logprobs` maps token text to logprob and includes the chosen token,
as vLLM returns it. Chat: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
A token's text is the tokenizer's decoding of that one token (a byte-level token holding part of a UTF-8
character decodes to U+FFFD, as in vLLM).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from service.engine.types import TokenLogprob


def token_texts(decode: Callable[[list[int]], str]) -> Callable[[int], str]:
    """Token id -> its text, decoded once per request."""
    return functools.cache(lambda token_id: decode([token_id]))


class CompletionLogprobs:
    """Accumulates one choice's completions-shape logprobs; `text_offset` counts characters of the
    choice's text from its start (the echoed prompt included)."""

    def __init__(self, texts: Callable[[int], str]):
        self.texts, self.offset = texts, 0

    def render(self, pairs: list[tuple[int, TokenLogprob | None]]) -> dict:
        """pairs: (token id, its logprob entry or None) -> the lists for these tokens."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, entry in pairs:
            text = self.texts(tid)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(entry.logprob)
            top = {self.texts(t): lp for t, lp in entry.top}
            top.setdefault(text, entry.logprob)
            out["top_logprobs"].append(top)
        return out


def prompt_pairs(prompt_ids: list[int], entries: list[TokenLogprob | None]) -> list[tuple[int, TokenLogprob | None]]:
    return list(zip(prompt_ids, entries, strict=True))


def output_pairs(entries: list[TokenLogprob]) -> list[tuple[int, TokenLogprob | None]]:
    return [(e.token_id, e) for e in entries]


def chat_content(texts: Callable[[int], str], entries: list[TokenLogprob]) -> list[dict]:
    def one(tid: int, lp: float) -> dict:
        text = texts(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
