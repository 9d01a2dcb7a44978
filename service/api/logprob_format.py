"""The engine's token log-probabilities in OpenAI's two response shapes.

Completions: parallel lists `{tokens, token_logprobs, top_logprobs, text_offset}` (a prompt's first token
has logprob None; `top_logprobs` includes the chosen token, as vLLM's). Chat: `{"content": [{token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}]}]}`. A token's text is its own decoding (U+FFFD for part of
a UTF-8 character, as in vLLM); its `bytes` are its own, so a client can join a split character.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Callable

from service.engine.types import TokenLogprob


class TokenTexts:
    """One request's view of token ids: each one's text (decoded once), its bytes, and which ids the
    generated text leaves out."""

    def __init__(self, decode: Callable[[list[int]], str],
                 vocab_bytes: Callable[[], list[bytes] | None] = lambda: None, hidden: set[int] = frozenset()):
        """`vocab_bytes`: returns each id's bytes (or None), called on the first `bytes` (building the table
        takes a while: a request without logprobs never needs it)."""
        self.text = functools.cache(lambda token_id: decode([token_id]))
        self.vocab_bytes, self.hidden = functools.cache(vocab_bytes), hidden

    def bytes(self, token_id: int) -> bytes:
        """The token's own bytes; a special token's are those of its text as listed (the name)."""
        table = self.vocab_bytes()
        if table is not None and 0 <= token_id < len(table) and token_id not in self.hidden:
            return table[token_id]
        return self.text(token_id).encode("utf-8")


class CompletionLogprobs:
    """Accumulates one choice's completions-shape logprobs; `text_offset` counts characters of the
    choice's text from its start (the echoed prompt included): the characters its tokens' bytes have
    completed so far, so the pieces of a split character do not count one U+FFFD each."""

    def __init__(self, texts: TokenTexts):
        self.texts, self.offset = texts, 0
        self.chars = codecs.getincrementaldecoder("utf-8")("replace")

    def render(self, prompt: list[tuple[int, TokenLogprob | None]], output: list[TokenLogprob]) -> dict:
        """The lists for the echoed prompt's (token id, logprob entry or None) pairs, then generated tokens."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        hidden = self.texts.hidden
        for tid, entry, generated in [*((t, e, False) for t, e in prompt), *((e.token_id, e, True) for e in output)]:
            text = self.texts.text(tid)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            if not (generated and tid in hidden):  # an echoed prompt keeps its special tokens as written
                self.offset += len(self.chars.decode(self.texts.bytes(tid)))
            top = None
            if entry is not None:
                top = {self.texts.text(t): lp for t, lp in entry.top}
                top.setdefault(text, entry.logprob)
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            out["top_logprobs"].append(top)
        return out


def chat_content(texts: TokenTexts, entries: list[TokenLogprob]) -> list[dict]:
    def one(tid: int, lp: float) -> dict:
        return {"token": texts.text(tid), "logprob": lp, "bytes": list(texts.bytes(tid))}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
