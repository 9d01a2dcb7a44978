"""Shared helpers for the engine tests: a char-level tokenizer and random tiny models."""

from __future__ import annotations

import asyncio
import dataclasses
import string
from collections.abc import Iterator

import torch

from model.bpe_tokenizer import BPETokenizer
from model.config import TINY_LLAMA, TINY_SEQ2SEQ
from model.decoder import DecoderLM
from model.seq2seq import EncoderDecoder
from service.engine.hooks import StepHooks
from service.engine.stats import MetricsSink

SPECIALS = ["<pad>", "<s>", "</s>", "<2en>", "<2zh>"]


class CharTokenizer:
    """One token per character (97 ids: 5 specials + printable characters); satisfies Tokenizer."""

    def __init__(self, vocab_size: int = 97):
        chars = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
        self.itos = (SPECIALS + chars)[:vocab_size]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.vocab_size = len(self.itos)
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    def encode(self, text: str) -> list[int]:
        return [self.stoi[c] for c in text if c in self.stoi]

    def decode(self, ids) -> str:
        return "".join(self.itos[i] for i in ids if i >= len(SPECIALS))

    def token_to_id(self, token: str) -> int | None:
        return self.stoi.get(token)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes in decoded text (specials: their name), as BPETokenizer gives them."""
        return [s.encode() for s in self.itos]

    @property
    def special_ids(self) -> set[int]:
        return set(range(len(SPECIALS)))

    def save(self, directory) -> None:
        raise NotImplementedError("test tokenizer")


def sharpen(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """Random models with std-0.02 weights give nearly flat logits, where rounding differences
    between batch shapes could flip an argmax; larger weights give decisive choices."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    return model.eval()


def tiny_llama(seed: int = 0, vocab_size: int = TINY_LLAMA.vocab_size) -> DecoderLM:
    """vocab_size 100 with CharTokenizer(100) has every printable character ('}', '~' and ' ' too)."""
    torch.manual_seed(seed)
    return sharpen(DecoderLM(dataclasses.replace(TINY_LLAMA, vocab_size=vocab_size)), 20.0)


BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_MERGES = ["h e", "l l", "he ll", "Ġ w", "Ġw o", "ä ½"]  # the last: the first two bytes of "你"


def tiny_bpe() -> BPETokenizer:
    """A byte-level BPE tokenizer (SmolLM2's kind): 3 special tokens, the 256 bytes, 6 merges."""
    from tokenizers import pre_tokenizers

    tokens = BPE_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in BPE_MERGES]
    meta = {"model": "gpt2", "tokens": tokens, "token_type": [3] * len(BPE_SPECIALS) + [1] * (len(tokens) - 3),
            "merges": BPE_MERGES, "bos_token_id": 1, "eos_token_id": 2}
    return BPETokenizer.from_gguf_metadata(meta)


def tiny_seq2seq(seed: int = 0) -> EncoderDecoder:
    torch.manual_seed(seed)
    return sharpen(EncoderDecoder(TINY_SEQ2SEQ), 3.0)


def run_engine(engine, coro_fn):
    """Start `engine`, return `await coro_fn(engine)`, stop it, in a fresh event loop."""
    async def main():
        await engine.start()
        try:
            return await coro_fn(engine)
        finally:
            await engine.stop()
    return asyncio.run(main())


def stream_model(model, tokenizer, prompt_ids: list[int], params, stop_ids: set[int], stats: dict | None = None,
                 threads: int | None = None) -> Iterator[str]:
    """`attnserve generate`'s streaming (`stream_engine`) over a one-slot serial engine for `model` as it is
    (its dtype, eager)."""
    from service.commands.generate import stream_engine
    from service.engine.config import DTYPES, EngineConfig
    from service.engine.generation import GenerationEngine

    dtype = next(name for name, dt in DTYPES.items() if dt == model.embed.weight.dtype)
    max_len = min(len(prompt_ids) + params.max_new_tokens, model.cfg.max_seq_len)
    cfg = EngineConfig(max_slots=1, max_seq_len=max(max_len, 1), max_waiting=1, mode="serial", dtype=dtype,
                       threads=threads)
    yield from stream_engine(GenerationEngine(model, tokenizer, cfg, eos_ids=stop_ids, name="cli"), prompt_ids,
                             params, stats)


class EndsSink(MetricsSink):
    """A metrics sink that records each finished request's reason, in order."""

    def __init__(self):
        self.reasons: list[str] = []

    def on_finish(self, model, finish_reason, prompt_tokens, generation_tokens, e2e_s):
        self.reasons.append(finish_reason)


class FailOnce(StepHooks):
    """Raises RuntimeError(message) the first time the engine calls `hook`: "on_plan" (a fault between steps,
    on the event loop) or "step_started" (a fault inside the worker's step)."""

    def __init__(self, hook: str, message: str):
        self.hook, self.message, self.failed = hook, message, False

    def _fail(self, hook: str) -> None:
        if hook == self.hook and not self.failed:
            self.failed = True
            raise RuntimeError(self.message)

    def on_plan(self, plan):
        self._fail("on_plan")

    def step_started(self, plan):
        self._fail("step_started")
