"""Tokenizers behind one small interface, and incremental detokenization for streaming."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    def save(self, directory: str | Path) -> None: ...


def encode_rendered(tok: Tokenizer, text: str) -> list[int]:
    """`text`'s ids with no BOS added (a rendered chat template, text a grammar forces): a tokenizer that adds
    one by itself says how (`encode_rendered`, model/bpe_tokenizer.py); the others add none."""
    return getattr(tok, "encode_rendered", tok.encode)(text)


class SentencePieceTokenizer:
    """SentencePiece model; user-defined symbols (e.g. language tags `<2en>`) are single tokens."""

    FILE = "tokenizer.model"

    def __init__(self, model_file: str | Path):
        import sentencepiece as spm

        self.path = Path(model_file)
        if not self.path.is_file():
            raise FileNotFoundError(f"SentencePiece model not found: {self.path}")
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size = self.sp.get_piece_size()
        ids = (self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id())
        self.bos_id, self.eos_id, self.pad_id = (None if i < 0 else i for i in ids)  # -1: the model has none

    @classmethod
    def train(cls, texts: Iterable[str], prefix: str | Path, vocab_size: int, *,
              model_type: str = "unigram", user_symbols: Iterable[str] = (),
              num_threads: int | None = None, input_sentence_size: int = 0) -> SentencePieceTokenizer:
        """Train on `texts`, write `<prefix>.model` and load it. Ids: pad=0, bos=1, eos=2, unk=3, then user
        symbols, then learned pieces."""
        import sentencepiece as spm

        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=vocab_size,
            model_type=model_type, character_coverage=0.9995,
            pad_id=0, bos_id=1, eos_id=2, unk_id=3, user_defined_symbols=list(user_symbols),
            byte_fallback=True, normalization_rule_name="nmt_nfkc", hard_vocab_limit=False,
            num_threads=num_threads or os.cpu_count() or 1,
            input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
            minloglevel=2,
        )
        return cls(f"{prefix}.model")

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return None if i == self.sp.unk_id() and token != self.sp.id_to_piece(i) else i

    def save(self, directory: str | Path) -> None:
        Path(directory, self.FILE).write_bytes(self.path.read_bytes())


def check_vocabularies(tokenizer, model_vocab_size: int) -> None:
    """A tokenizer with ids the model cannot embed is another model's: every step holding one would fail."""
    n = getattr(tokenizer, "vocab_size", None)
    if n is not None and n > model_vocab_size:
        raise ValueError(f"the tokenizer has {n} ids but the model's vocabulary {model_vocab_size}: "
                         f"they belong to different models")


class IncrementalDetokenizer:
    """Token ids -> text deltas that never split a UTF-8 character: a delta ending in U+FFFD (a partial
    character) waits for the next token. It diffs decodes of a short window of recent tokens, which suits
    SentencePiece's leading-space markers and byte-level BPE alike. `context`: the prompt; its last tokens are
    read first, so the first output token is decoded as it follows them (SentencePiece's "▁Paris" reads " Paris"
    after a prompt and "Paris" alone), as vLLM seeds its window."""

    CONTEXT = 5  # prompt tokens read first, as vLLM's

    def __init__(self, tokenizer: Tokenizer, skip_ids: Iterable[int] = (), context: Iterable[int] = ()):
        self.tok = tokenizer
        self.skip = set(skip_ids)
        self.ids: list[int] = [int(i) for i in context if i not in self.skip][-self.CONTEXT:]
        if self.ids and tokenizer.decode(self.ids).endswith("\ufffd"):  # a prompt ending inside a character:
            self.ids = []  # the output's first bytes would complete it and shift every delta after
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # tokens up to here have been emitted (or are the prompt's)

    def push(self, token_id: int) -> str:
        if token_id in self.skip:
            return ""
        self.ids.append(int(token_id))
        delta = self._unread_text()
        if delta and not delta.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)  # the window slides on
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is left at the end (may contain U+FFFD if the stream ended mid-character)."""
        delta = self._unread_text()
        self.prefix_offset = self.read_offset = len(self.ids)
        return delta

    def _unread_text(self) -> str:
        """The text the unread tokens add to the window's ("" where it did not grow)."""
        prefix_text = self.tok.decode(self.ids[self.prefix_offset:self.read_offset])
        return self.tok.decode(self.ids[self.prefix_offset:])[len(prefix_text):]
