"""zh<->en translation conventions shared by training, the CLI and the engine.

One bidirectional model: the source carries a target-language tag (`<2en>` / `<2zh>`), as Marian's
multilingual models do. Source = [tag] + pieces + [eos]; target = [bos] + pieces + [eos].
"""

from __future__ import annotations

import re
from pathlib import Path

LANGS = ("en", "zh")
TAGS = {"en": "<2en>", "zh": "<2zh>"}
# Decoding defaults of every translation path (HTTP, CLI, evaluation); chosen on TED dev (docs/performance.md).
DEFAULT_BEAM_SIZE = 4
DEFAULT_LENGTH_PENALTY = 0.6
DEFAULT_NO_REPEAT_NGRAM = 3
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")


def detect_lang(text: str) -> str:
    """'zh' if the text is mostly CJK characters among its letters, else 'en'."""
    cjk = len(_CJK.findall(text))
    latin = sum(c.isascii() and c.isalpha() for c in text)
    return "zh" if cjk and cjk * 3 >= latin else "en"


_SENT_END = re.compile(r"(?<=[。！？；!?])\s*|(?<=[.;])\s+(?=[\"“‘(\[A-Z0-9\u3400-\u9fff])")


_ABBREV = re.compile(r"\b(?:Mr|Mrs|Ms|Dr|Prof|No|Nos|St|Co|Ltd|Inc|Cap|paras?|ss?|arts?|e\.g|i\.e|cf|vs|etc)\.$",
                     re.IGNORECASE)


def split_sentences(text: str) -> list[str]:
    """Split a text into sentences (after 。！？；!? and after . or ; before a capital, digit or CJK);
    each sentence is translated as its own item and the outputs are joined again."""
    out: list[str] = []
    for p in (p.strip() for p in _SENT_END.split(text)):
        if out and _ABBREV.search(out[-1]):
            out[-1] = f"{out[-1]} {p}".strip()  # "Mr." / "No." / "s." do not end a sentence
        elif p:
            out.append(p)
    return out or [text]


def join_sentences(parts: list[str], lang: str) -> str:
    return ("" if lang == "zh" else " ").join(p for p in parts if p)


def other(lang: str) -> str:
    return "en" if lang == "zh" else "zh"


def encode_source(tokenizer, text: str, target_lang: str, max_len: int | None = None) -> list[int]:
    tag = tokenizer.token_to_id(TAGS[target_lang])
    ids = tokenizer.encode(text)
    if max_len is not None:
        ids = ids[: max_len - 2]
    return [tag, *ids, tokenizer.eos_id]


class Translator:
    """Offline translator (CLI, evaluation): checkpoint + SentencePiece + greedy/beam search."""

    def __init__(self, directory: str | Path, dtype=None):
        from model.checkpoint import load_checkpoint, load_tokenizer

        self.model = load_checkpoint(directory, dtype=dtype)
        self.tok = load_tokenizer(directory)

    def translate(self, texts: list[str], target_lang: str | None = None, beam_size: int = 4,
                  batch_size: int = 32) -> list[str]:
        from model.generate import beam_search, greedy
        from model.punctuation import postprocess

        out: list[str] = []
        cap = self.model.cfg.max_src_len
        for i in range(0, len(texts), batch_size):
            chunk = texts[i: i + batch_size]
            langs = [target_lang or other(detect_lang(t)) for t in chunk]
            srcs = [encode_source(self.tok, t, lang, cap) for t, lang in zip(chunk, langs)]
            if beam_size <= 1:
                hyps = greedy(self.model, srcs)
            else:
                hyps = [h[0].tokens for h in beam_search(self.model, srcs, beam_size=beam_size)]
            out.extend(postprocess(self.tok.decode(h), lang) for h, lang in zip(hyps, langs))
        return out
