"""Width and punctuation conventions for zh<->en text: normalise inputs, fix the punctuation of outputs.

Inputs are normalised without destroying anything (unlike NFKC, "，" stays). Chinese output gets full-width
marks next to Chinese text, while numbers, Latin words, URLs and e-mail addresses pass through; English
output gets ASCII marks. Deterministic and idempotent, so applied to the training data and every translation.
"""

from __future__ import annotations

import re
import unicodedata
from itertools import accumulate, zip_longest

# CJK ideographs (incl. extension A and compatibility), kana, Hangul: text after which a mark is Chinese
_CJK_CHARS = r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3040-\u30ff\uac00-\ud7af"
_CJK = re.compile(f"[{_CJK_CHARS}]")
FULLWIDTH_MARKS = "，。：；？！“”‘’（）、《》〈〉「」『』【】〔〕…—"
_ZH_CONTEXT = re.compile(f"[{_CJK_CHARS}{re.escape(FULLWIDTH_MARKS)}]")
ASCII_TO_FULL = {",": "，", ".": "。", ":": "：", ";": "；", "?": "？", "!": "！"}
_TO_ASCII = {"，": ",", "。": ".", "：": ":", "；": ";", "？": "?", "！": "!", "（": "(", "）": ")",
             "“": '"', "”": '"', "‘": "'", "’": "'", "、": ",", "……": "...", "…": "...",
             "「": '"', "」": '"', "『": "'", "』": "'", "《": '"', "》": '"', "【": "[", "】": "]",
             "〈": '"', "〉": '"', "〔": "[", "〕": "]"}
_OPENERS, _CLOSING = "“‘「『《【〈〔", "”’」』》】〉〕"
# spans whose characters are never touched: URLs, e-mail addresses, code calls (`print("hi")`, `f(x, y)`)
_URL_CHAR = r"[^\s.,:;!?)\]'\"\u3000-\u303f\uff00-\uffef" + _CJK_CHARS + "]"
# a bracketed part inside a URL (".../Python_(language)") belongs to it; a ")" closing the prose around it does not.
# A run of the marks that may trail a URL is one part: the URL cannot end inside it (it would end where the run
# starts), and testing there, the lookahead scanning the rest of a long run each time, is quadratic
_URL_PART = (r"(?:\([^\s()\u3000-\u303f\uff00-\uffef" + _CJK_CHARS + r"]*\)|(?>[.,:;!?)\]'\"]+)|"
             + _URL_CHAR + ")")
_LINK = (r"(?:https?://|www\.)" + _URL_PART + r"*?(?=[.,:;!?)\]'\"]*(?:\s|$|[^\x00-\x7f]))"
         # an address starts where a run of its characters starts: scanning from inside a long run is quadratic
         r"|(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")
_LINKS = re.compile(f"({_LINK})", re.IGNORECASE)  # a group: split() keeps the links
# A call with ASCII inside is code, not a name with a note in brackets.
# a call starts after no name character, or after a "." that follows none ("f(x).g()", "df[0].sum()")
_PROTECTED = re.compile(_LINK + r"|(?:(?<![A-Za-z0-9_.])|(?<=[^A-Za-z0-9_.]\.))[A-Za-z_][A-Za-z0-9_.]*\([ -'*-~]*\)",
                        re.IGNORECASE)


def without_protected(text: str) -> str:
    """The text with its URLs, e-mail addresses and code calls blanked out: what is left is prose."""
    return _PROTECTED.sub(" ", text)


def is_link(text: str) -> bool:
    """The whole text is one URL or e-mail address."""
    return _LINKS.fullmatch(text) is not None


def split_links(text: str) -> list[str]:
    """The text cut around its URLs and e-mail addresses: prose and links alternate, each stripped, empty pieces
    dropped. (Code calls stay in the prose: "s.2(1)" in legal text looks like one.)"""
    return [p for p in (s.strip() for s in _LINKS.split(text)) if p]


_ABBREV = re.compile(r"(?:\b(?i:Mr|Mrs|Ms|Dr|Prof|St|Jr|Sr|No|Nos|Inc|Ltd|Co|Corp|vs|etc|e\.g|i\.e|a\.m|p\.m|cf|Cap)"
                     r"|(?<![A-Za-z])[A-Z])$")
# "1." / "b." / "III." opening a numbered item keeps its point; "二." becomes "二、"
_LIST_NUMBER = re.compile(r"\s*[(（]?(?:\d{1,3}|[A-Za-z]|[IVXivx]{1,5})")
_ZH_LIST_NUMBER = re.compile(r"\s*[一二三四五六七八九十]{1,3}")
_ENDS_BEFORE_CLOSE = "，。！？；…,.!?;"  # a quote right after these closes a quotation
_ELLIPSIS = re.compile(r"\.{3,}|…+")
_SPACE = re.compile(r"\s+")
# pictographs and what joins or styles them (ZWJ sequences, VS16, keycaps; skin tones lie inside the first range)
EMOJI_CHARS = "\U0001F000-\U0001FAFF\u2300-\u23FF\u2600-\u27BF\u2B00-\u2BFF\uFE0F\u200D\u20E3"
# zero-width characters, but not a joiner inside an emoji sequence ("👨‍👩‍👧" is one picture)
_INVISIBLE = re.compile(f"[\u200b\u200c\u2060\ufeff\u00ad]|\u200d(?![{EMOJI_CHARS}])")


def normalise_input(text: str) -> str:
    """NFC, full-width letters/digits and ideographic space to ASCII, no invisible characters, single spaces.
    Unlike NFKC, punctuation (，。“” …) keeps its form."""
    text = unicodedata.normalize("NFC", text)
    text = "".join(chr(ord(c) - 0xFEE0) if ("０" <= c <= "９" or "Ａ" <= c <= "Ｚ" or "ａ" <= c <= "ｚ") else c
                   for c in text)
    text = _INVISIBLE.sub("", text)
    return _SPACE.sub(" ", text).strip()  # \s covers U+3000 and no-break spaces


def _is_zh(c: str | None) -> bool:
    return c is not None and bool(_ZH_CONTEXT.match(c))


def _neighbour(chars: list[str] | str, i: int, step: int) -> str | None:
    """The nearest non-space character before (step -1) or after (step +1) position i."""
    j = i + step
    while 0 <= j < len(chars) and chars[j].isspace():
        j += step
    return chars[j] if 0 <= j < len(chars) else None


def _pair_is_zh(chars: list[str], cjk: list[int], a: int, b: int, context) -> bool:
    """Do the paired marks at a and b enclose Chinese (`cjk[i]`: the CJK characters before i; counted, a
    search of each pair's inside is quadratic in nested brackets), or stand next to `context` characters?"""
    return cjk[b] > cjk[a + 1] or context(_neighbour(chars, a, -1)) or context(_neighbour(chars, b, 1))


def to_chinese_punctuation(text: str) -> str:
    """ASCII punctuation in Chinese context -> full-width; spaces around full-width marks dropped. A mark
    converted can make its neighbour Chinese context ("，" before a quote): repeated until nothing changes, where
    a bracket pair changes again only next to a converted mark, not next to another bracket: section numbers
    keep the form of the data, "第19(1)(b)（ii）条"."""
    if not _CJK.search(text):
        return text
    bracket_context = _is_zh_not_bracket
    for _ in range(4):
        out = _chinese_pass(text, bracket_context)
        if out == text:
            break
        text, bracket_context = out, _is_converted_mark
    return text


def _is_zh_not_bracket(c: str | None) -> bool:
    return _is_zh(c) and c not in "（）"


def _is_converted_mark(c: str | None) -> bool:
    # after the first pass a full-width neighbour is one this call converted (quotes and "……" too): a bracket
    # left ASCII then changes as a later call, which sees that mark in the input, would change it
    return c is not None and c in FULLWIDTH_MARKS and c not in "（）"


def _chinese_pass(text: str, bracket_context) -> str:
    text = _ELLIPSIS.sub(lambda m: "……" if _is_zh(_neighbour(m.string, m.start(), -1))
                         or _is_zh(_neighbour(m.string, m.end() - 1, 1)) else m.group(), text)
    chars = list(text)
    n = len(chars)
    protected = [False] * n
    cjk = list(accumulate((_CJK.match(c) is not None for c in chars), initial=0))  # marks converted stay non-CJK
    for m in _PROTECTED.finditer(text):
        protected[m.start():m.end()] = [True] * (m.end() - m.start())

    # parentheses: a matched pair changes together
    stack: list[int] = []
    pairs: list[tuple[int, int | None]] = []
    for i, c in enumerate(chars):
        if c == "(" and not protected[i]:
            stack.append(i)
        elif c == ")" and not protected[i]:
            pairs.append((stack.pop(), i) if stack else (i, None))
    pairs += [(i, None) for i in stack]
    for a, b in pairs:
        if b is None:
            if bracket_context(_neighbour(chars, a, -1)) or bracket_context(_neighbour(chars, a, 1)):
                chars[a] = "（" if chars[a] == "(" else "）"
        elif _pair_is_zh(chars, cjk, a, b, bracket_context):
            chars[a], chars[b] = "（", "）"

    # double quotes: paired in order of appearance
    quotes = [i for i, c in enumerate(chars) if c == '"' and not protected[i]]
    for a, b in zip_longest(quotes[::2], quotes[1::2]):
        if b is None:  # a quote whose partner is in another sentence
            left = _neighbour(chars, a, -1)
            if left is not None and left in _ENDS_BEFORE_CLOSE:
                chars[a] = "”"
            elif _is_zh(_neighbour(chars, a, 1)):
                chars[a] = "“"
            elif _is_zh(left):
                chars[a] = "”"
        elif _pair_is_zh(chars, cjk, a, b, _is_zh):
            chars[a], chars[b] = "“", "”"

    # single quotes used as quotation marks, paired in order (an apostrophe between Latin letters is none)
    singles = [i for i, c in enumerate(chars) if c == "'" and not protected[i]
               and not (0 < i < n - 1 and _latin(chars[i - 1]) and _latin(chars[i + 1]))]
    for a, b in zip(singles[::2], singles[1::2], strict=False):
        if _pair_is_zh(chars, cjk, a, b, _is_zh):
            chars[a], chars[b] = "‘", "’"

    # , . : ; ? !  ("..." is the ellipsis rule's: next pass, when its neighbours may have become Chinese).
    # A converted mark is Chinese context for the marks beside it: swept both ways, a run converts in one pass
    first = next((k for k, c in enumerate(chars) if not c.isspace()), n)
    dots = {i for m in re.finditer(r"\.{3,}", "".join(chars)) for i in range(m.start(), m.end())}
    for i in (*range(n), *reversed(range(n))):
        c = chars[i]
        if c not in ASCII_TO_FULL or protected[i] or i in dots:
            continue
        prev, nxt = chars[i - 1] if i else "", chars[i + 1] if i + 1 < n else ""
        if prev.isdigit() and nxt.isdigit():
            continue  # 3.5, 1,000, 12:30
        if c == "." and _latin(prev) and _latin(nxt):
            continue  # v1.2, U.S, example.com
        if (not prev or prev.isspace()) and (_latin(nxt) or c == "." and nxt == "/"):
            continue  # a mark that begins a token: .NET, .5, ./configure, :hover, !important, ?id=3
        left, right = _neighbour(chars, i, -1), _neighbour(chars, i, 1)
        if c == "." and right is not None:
            # a list number is at most 6 characters after the leading spaces and an abbreviation 5: read
            # only so much of what comes before (the whole of it for every "." is quadratic)
            numbered = i - first <= 6 and "".join(chars[:i])
            if numbered and _ZH_LIST_NUMBER.fullmatch(numbered):
                chars[i] = "、"
                continue
            j = i - 1
            while j >= 0 and chars[j].isspace():
                j -= 1
            tail = "".join(chars[max(0, j - 15):j + 1])
            if not _is_zh(left) and (_ABBREV.search(tail) or numbered and _LIST_NUMBER.fullmatch(numbered)):
                continue  # Mr. / Inc. / J. K. before a name; "1." numbering an item
        if _is_zh(left) or _is_zh(right) or (right is None and c in ".?!" and left is not None):
            chars[i] = ASCII_TO_FULL[c]

    return re.sub(rf"\s*([{re.escape(FULLWIDTH_MARKS)}])\s*", r"\1", "".join(chars))


def to_english_punctuation(text: str) -> str:
    """Full-width punctuation -> ASCII, with English spacing after , . : ; ? ! and around ( )."""
    if not re.search(f"[{re.escape(FULLWIDTH_MARKS)}]", text):
        return text
    text = text.replace("……", "...")
    out: list[str] = []
    for i, c in enumerate(text):
        a = _TO_ASCII.get(c)
        if a is None:
            out.append(c)
            continue
        prev, nxt = text[i - 1] if i else "", text[i + 1] if i + 1 < len(text) else ""
        if a in ",.:;?!":
            while out and out[-1] == " ":
                out.pop()
            glued = not nxt or nxt.isspace() or nxt in ",.:;?!)\"']" + FULLWIDTH_MARKS or (
                a in ",.:" and prev.isdigit() and nxt.isdigit())  # 10：30 -> 10:30
            out.append(a + ("" if glued else " "))
        elif prev.isalnum() and nxt.isalnum() and a == "'":  # an apostrophe: It’s
            out.append(a)
        elif a == "(" or c in _OPENERS:
            out.append((" " if out and _latin(out[-1]) or a == "(" and out and out[-1] not in " ([" else "") + a)
        elif a == ")" or c in _CLOSING:
            out.append(a + (" " if _latin(nxt) else ""))
        else:
            out.append(a)
    return _SPACE.sub(" ", "".join(out)).strip()


def _latin(c: str) -> bool:
    return c.isascii() and c.isalnum()


def postprocess(text: str, lang: str) -> str:
    """A translation's punctuation for its target language ('zh' or 'en')."""
    return to_chinese_punctuation(text) if lang == "zh" else to_english_punctuation(text)


def punctuation_counts(text: str) -> tuple[int, int]:
    """(full-width marks, ASCII marks next to Chinese text) among , . : ; ? ! ( ) " in a Chinese text. The
    point of an Arabic ordinal opening the text ("30. 最后") is not counted: Chinese writes it so (GB/T 15834)."""
    full = sum(text.count(c) for c in "，。：；？！“”（）")
    ascii_ = 0
    for i, c in enumerate(text):
        if c in ',.:;?!()"':
            prev, nxt = text[i - 1] if i else "", text[i + 1] if i + 1 < len(text) else ""
            if prev.isdigit() and nxt.isdigit():
                continue
            if c == "." and re.fullmatch(r"\s*\d{1,3}", text[:i]):
                continue
            if _CJK.match(_neighbour(text, i, -1) or "") or _CJK.match(_neighbour(text, i, 1) or ""):
                ascii_ += 1
    return full, ascii_
