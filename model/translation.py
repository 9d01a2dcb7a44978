"""zh<->en translation conventions shared by training, the CLI and the engine.

One bidirectional model: the source carries a target-language tag (`<2en>` / `<2zh>`), as Marian's
multilingual models do. Source = [tag] + pieces + [eos]; target = [bos] + pieces + [eos].
"""

from __future__ import annotations

import re

LANGS = ("en", "zh")
TAGS = {"en": "<2en>", "zh": "<2zh>"}
# Decoding defaults of every translation path (HTTP, CLI, evaluation); chosen on the dev splits (docs/performance.md).
DEFAULT_BEAM_SIZE = 4
DEFAULT_LENGTH_PENALTY = 2.0
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
