"""zh<->en translation conventions shared by training, the CLI and the engine.

One bidirectional model: the source carries a target-language tag (`<2en>` / `<2zh>`), as Marian's
multilingual models do. Source = [tag] + pieces + [eos]; target = [bos] + pieces + [eos].
"""

from __future__ import annotations

import re

from model.punctuation import (
    ASCII_TO_FULL,
    EMOJI_CHARS,
    is_link,
    normalise_input,
    postprocess,
    split_links,
    without_protected,
)

TAGS = {"en": "<2en>", "zh": "<2zh>"}
LANGS = tuple(TAGS)
# Decoding defaults of every translation path (HTTP, CLI, evaluation); chosen on the dev splits (docs/performance.md).
DEFAULT_BEAM_SIZE = 4
DEFAULT_LENGTH_PENALTY = 2.0
DEFAULT_NO_REPEAT_NGRAM = 3
DEFAULT_MIN_LENGTH_RATIO = 0.0  # EOS banned before this x the source's pieces
# The bounds of the decoding options, the same for every path: HTTP answers 400, the CLI exits 2, the engine rejects.
DECODING_LIMITS = {"length_penalty": (0.0, 2.0), "no_repeat_ngram": (0, 16), "min_length_ratio": (0.0, 1.0)}
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
_LATIN_WORD = re.compile(r"[A-Za-z]+")


class DecodingOptionError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field  # as the caller named it


def check_decoding_options(names: dict[str, str], **options: float) -> None:
    """Raise DecodingOptionError naming the first option outside DECODING_LIMITS as `names` maps it (an option
    missing from `names` keeps its own name)."""
    for option, value in options.items():
        lo, hi = DECODING_LIMITS[option]
        if not lo <= value <= hi:
            name = names.get(option, option)
            raise DecodingOptionError(name, f"{name} must be in [{lo}, {hi}], got {value}")


def detect_lang(text: str) -> str:
    """'zh' if the text has CJK characters and at least as many of them as Latin words, else 'en': a Chinese
    sentence naming "Visual Studio Code" stays Chinese. URLs, e-mail addresses and code are not words. Read
    as normalised, so a text and each of its normalised sentences are judged alike."""
    text = without_protected(normalise_input(text))
    cjk = len(_CJK.findall(text))
    return "zh" if cjk and cjk >= len(_LATIN_WORD.findall(text)) else "en"


# A sentence ends after a run of 。！？； or after . ; ! ? before a space and a capital, digit or opening mark, or
# before Chinese: "a != b", "page?id=3", '"Stop!" he said' go on. The closing quotes and brackets right after
# the mark stay with it ("你好！”", "What?!"). A match starts where a run of . ; ! ? starts: one that fails there fails
# inside the run too, and trying each position of a long run is quadratic.
_CLOSERS = "”’」』）)\"'"
_SENT_END = re.compile(rf"[。！？；]+[{_CLOSERS}]*\s*"
                       rf"|(?<![.;!?])[.;!?]+[{_CLOSERS}]*(?:\s+(?=[\"“‘(\[A-Z0-9\u3400-\u9fff])|(?=[\u3400-\u9fff]))")
# a part ending like these does not end a sentence: titles, abbreviations, initials (U.K.); and before a number,
# legal and citation abbreviations ("No. 5", "s. 2(1)", "p. 5"; but "The answer was no. Then ...")
_ABBREV = re.compile(r"\b(?:Mr|Mrs|Ms|Dr|Prof|St|Co|Ltd|Inc|al|approx|e\.g|i\.e|cf|vs|etc|[A-Za-z])\.$", re.IGNORECASE)
_NUMBERED = re.compile(r"\b(?:No|Nos|Cap|paras?|ss?|arts?|pp?|figs?|vols?)\.$", re.IGNORECASE)
_ITEM_LABEL = re.compile(r"[(（]?(?:\d{1,3}|[IVXivx]{1,5})[.)）]")  # "1." / "(2)" / "iv." opening a list item


def split_sentences(text: str) -> list[str]:
    """One line of text -> its sentences, each translated as its own item (`join_sentences` rejoins them)."""
    ends = [m.end() for m in _SENT_END.finditer(text)]
    out: list[str] = []
    last = ""  # the part out[-1] ends with: the abbreviations hold no space, so they are searched in it alone
    for p in (text[a:b].strip() for a, b in zip([0, *ends], [*ends, len(text)], strict=True)):
        if not p:
            continue
        # searching the whole of a sentence merged again and again ("Mr. A. B. ...") would be quadratic
        if out and (_ABBREV.search(last) or _ITEM_LABEL.fullmatch(out[-1])
                    or _NUMBERED.search(last) and p[0] in "0123456789("):
            out[-1] = f"{out[-1]} {p}"  # "Mr." / "No." / "U.K." / "1." do not end a sentence
        else:
            out.append(p)
        last = p
    return out


_CLAUSE_END = re.compile(r"[，、；：]\s*|[,;:]\s+|\s+[-–—]+\s+")  # not 1,000 / 12:30 / https://
_KEYCAP = "[0-9#*]\ufe0f?\u20e3"  # a digit is an emoji only with its keycap mark ("1️⃣")
# a run of emoji, with the clause mark after it ("👍, see you"): emoji stand between clauses as marks do
_EMOJI_RUN = re.compile(f"((?:{_KEYCAP}|[{EMOJI_CHARS}])(?:{_KEYCAP}|[{EMOJI_CHARS}\\s])*[，、；：,;:]?)")


def pieces(sentence: str, fits) -> list[str]:
    """What the model translates one by one: the sentence cut around URLs, e-mail addresses and runs of emoji
    (they pass through: the vocabulary hardly holds emoji, and the model rewrites them as words), long pieces
    cut at clauses."""
    out = []
    for p in split_links(sentence):
        if is_link(p):
            out.append(p)
            continue
        for q in (q.strip() for q in _EMOJI_RUN.split(p)):
            out += split_long(q, fits) if q else []
    return out


def split_long(sentence: str, fits) -> list[str]:
    """Cut a sentence too long for the model (`fits(piece)` is False) into pieces that fit: at the clause mark
    nearest its middle, else at the space nearest it, else between characters."""
    if fits(sentence) or len(sentence) < 2:
        return [sentence]
    cuts = [m.end() for m in _CLAUSE_END.finditer(sentence) if 0 < m.end() < len(sentence)]
    cuts = cuts or [m.end() for m in re.finditer(r"\s+", sentence) if 0 < m.start()] or list(range(1, len(sentence)))
    cut = min(cuts, key=lambda c: abs(2 * c - len(sentence)))
    return [p for half in (sentence[:cut], sentence[cut:]) if (h := half.strip()) for p in split_long(h, fits)]


_ASCII_ALNUM = re.compile(r"[A-Za-z0-9]")
_NO_SPACE_BEFORE = ",.;:!?)]}”’）】》」』，。；：！？"  # English: closing marks hug the piece before them
_NO_SPACE_AFTER = "([{“‘（【《「『"  # and opening marks the piece after them


def join_sentences(parts: list[str], lang: str) -> str:
    """Translated sentences and passed-through pieces (URLs, numbers, marks) as one text. English: a space
    between pieces, none before closing punctuation. Chinese: no space, but one between a URL or e-mail
    address and ASCII letters or digits next to it (glued, they would change the address), and a lone
    mark between pieces in its full-width form ("https://a.com,https://b.com" would read as one URL)."""
    out = last = ""
    for p in (p for p in parts if p):
        if lang == "zh":
            p = ASCII_TO_FULL.get(p, p)
            apart = (is_link(last) and _ASCII_ALNUM.match(p[0])) or (is_link(p) and _ASCII_ALNUM.match(out[-1:]))
            out += (" " if out and apart else "") + p
        else:
            out += (" " if out and p[0] not in _NO_SPACE_BEFORE and out[-1] not in _NO_SPACE_AFTER else "") + p
        last = p
    return out


_LINE_BREAK = re.compile(r"\r\n|[\n\r\x85\u2028\u2029]")  # Windows, old Mac and Unicode line ends


def split_text(text: str) -> list[list[str]]:
    """A text's lines (line breaks are kept as they are: lists, paragraphs), each normalised as the training
    data was (model/punctuation.py) and split into sentences."""
    return [split_sentences(normalise_input(line)) for line in _LINE_BREAK.split(text)]


def join_text(lines: list[list[str]], lang: str) -> str:
    """Each line's sentences joined and punctuated for `lang` as one piece: a quotation or a pass-through
    "4." after a translated sentence gets the marks its neighbours call for."""
    return "\n".join(postprocess(join_sentences(parts, lang), lang) for parts in lines)


def needs_translation(sentence: str, target_lang: str, source_lang: str | None = None) -> bool:
    """False for a sentence without letters or already in the target language (detected unless `source_lang`
    says): it passes through, with the target's punctuation, rather than being rewritten by the model."""
    return (any(c.isalpha() for c in without_protected(sentence))
            and (detect_lang(sentence) if source_lang is None else source_lang) != target_lang)


def other(lang: str) -> str:
    return "en" if lang == "zh" else "zh"


def encode_source(tokenizer, text: str, target_lang: str, max_len: int | None = None) -> list[int]:
    tag = tokenizer.token_to_id(TAGS[target_lang])
    tags = {tokenizer.token_to_id(t) for t in TAGS.values()}
    ids = [i for i in tokenizer.encode(text) if i not in tags]  # a "<2en>" typed in the text steers nothing
    if max_len is not None:
        ids = ids[: max_len - 2]
    return [tag, *ids, tokenizer.eos_id]
