"""Prompt prefixes already in the KV cache, reused instead of prefilled (vLLM's prefix caching, per slot).

K/V at positions [0, n) depend only on tokens [0, n), so a prompt that starts like a running sequence's
tokens, or like what a freed slot still holds (freeing writes nothing), copies those K/V into its slot and
prefills only the rest; chat prompts share their system turn, so nearly every request gains. A slot is
forgotten as soon as anything may write it. The prompt's last token is always prefilled: its logits start
the answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MIN_REUSE = 8  # shorter shared prefixes are prefilled: not worth a copy


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class PrefixIndex:
    def __init__(self, min_tokens: int = MIN_REUSE):
        self.min_tokens = min_tokens
        self.freed: dict[int, list[int]] = {}  # free slot -> the tokens whose K/V it still holds

    def freed_slot(self, slot: int, tokens: list[int]) -> None:
        if slot >= 0 and tokens:
            self.freed[slot] = tokens

    def forget(self, slots: Iterable[int]) -> None:
        """These slots are (or may be) written from now on."""
        for s in slots:
            self.freed.pop(s, None)

    def longest(self, prompt: Sequence[int], sources: Iterable[tuple[int, Sequence[int]]]) -> tuple[int, int]:
        """The source (slot, cached tokens) sharing the longest prefix with `prompt` -> (slot, positions
        to reuse), at most len(prompt) - 1; (-1, 0) when none reaches `min_tokens`."""
        best, best_n = -1, 0
        for slot, tokens in sources:
            n = common_prefix(prompt, tokens)
            if n > best_n:
                best, best_n = slot, n
        best_n = min(best_n, len(prompt) - 1)
        return (best, best_n) if best_n >= self.min_tokens else (-1, 0)
