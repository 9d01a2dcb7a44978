"""Sentence splitting and length-based sentence alignment of zh-en documents (Gale & Church 1993).

Dynamic programming groups both sides' sentences into beads (1-1, 2-1, ..., 1-0 for no counterpart)
minimising -log P(bead kind) - log P(length difference), where delta = (l_en - c * l_zh) / sqrt(s2 * l):
lengths in non-space characters, l the bead's mean length in Chinese characters, c and s2 fitted on the
corpus itself (`LengthModel.fit`), c refitted per document.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from itertools import accumulate

# prior of each bead kind (zh units, en units); 1-1 dominates, as in Gale & Church's table
SENTENCE_PRIORS = {(1, 1): 0.89, (1, 0): 0.005, (0, 1): 0.005, (2, 1): 0.04, (1, 2): 0.04, (2, 2): 0.01,
                   (3, 1): 0.005, (1, 3): 0.005}

BREAK_BONUS = 1.0  # nats: a bead ending at a paragraph end on both sides
BAND_MIN, BAND_SHARE = 30, 0.2  # DP cells within max(30, 20 % of the sentences) of the diagonal

_EN_BOUNDARY = re.compile(r"[.!?]+[\"”’')\]]*\s+(?=[\"“‘'(\[]?[A-Z0-9])")
_EN_ABBREV = re.compile(r"(?:\b(?:Mr|Mrs|Ms|Dr|Prof|St|Jr|Sr|Mt|No|vs|etc|e\.g|i\.e|a\.m|p\.m|U\.S|U\.K|"
                        r"Inc|Ltd|Co|Corp|Gen|Gov|Sen|Rep|Fig|Vol|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)"
                        r"|(?<![A-Za-z])[A-Z])\.$")
_ZH_BOUNDARY = re.compile(r"[。！？!?]+[”’」』）)\"]*\s*|\s*…{2,}\s+")
_SPACE = re.compile(r"\s+")


def split_english(paragraph: str) -> list[str]:
    """Sentences of an English paragraph: after . ! ? (and closing quotes) before a capital, digit or
    opening quote; not after abbreviations (Mr., U.S.) or initials."""
    out, start = [], 0
    for m in _EN_BOUNDARY.finditer(paragraph):
        head = paragraph[start:m.end()].rstrip()
        if _EN_ABBREV.search(head):
            continue
        out.append(head.strip())
        start = m.end()
    out.append(paragraph[start:].strip())
    return [s for s in out if s]


def split_chinese(paragraph: str) -> list[str]:
    """Sentences of a Chinese paragraph: after 。！？ (with closing quotes), or at …… followed by a space."""
    ends = [m.end() for m in _ZH_BOUNDARY.finditer(paragraph) if m.end() < len(paragraph)]
    cuts = zip([0, *ends], [*ends, len(paragraph)], strict=True)
    return [s for s in (paragraph[a:b].strip() for a, b in cuts) if s]


def length(text: str) -> int:
    return len(_SPACE.sub("", text))


@dataclass(frozen=True)
class LengthModel:
    c: float  # English characters per Chinese character
    s2: float  # variance of l_en - c * l_zh per Chinese character

    @classmethod
    def fit(cls, pairs: list[tuple[int, int]]) -> LengthModel:
        """From (l_zh, l_en) of paragraph pairs: c is the ratio of the totals; s2 a median-based estimate
        (the median of a squared standard normal is 0.4549), so mis-paired paragraphs barely move it."""
        pairs = [(z, e) for z, e in pairs if z > 0 and e > 0]
        if not pairs:
            raise ValueError("no paragraph pairs to fit the length model on")
        c = sum(e for _, e in pairs) / sum(z for z, _ in pairs)
        sq = sorted((e - c * z) ** 2 / ((z + e / c) / 2) for z, e in pairs)
        return cls(c=c, s2=max(sq[len(sq) // 2] / 0.4549, 1.0))  # the floor guards tiny corpora

    def delta(self, l_zh: int, l_en: int) -> float:
        mean = max((l_zh + l_en / self.c) / 2, 1.0)
        return (l_en - self.c * l_zh) / math.sqrt(self.s2 * mean)


@dataclass(frozen=True)
class Bead:
    zh: tuple[int, int]  # [start, end) of the Chinese sentences
    en: tuple[int, int]
    delta: float

    @property
    def kind(self) -> str:
        return f"{self.zh[1] - self.zh[0]}-{self.en[1] - self.en[0]}"


def align(zh_lens: list[int], en_lens: list[int], lm: LengthModel, *,
          breaks: tuple[set[int], set[int]], band: int | None = None) -> list[Bead]:
    """Gale-Church dynamic programming over sentence lengths; beads in order.

    breaks: sentence indices at which a paragraph ends on each side; a bead ending where both sides end
    a paragraph costs BREAK_BONUS less, so interleaved files keep their paragraph pairs where the lengths
    allow. band: only cells within this many sentences of the diagonal (long documents)."""
    costs = [(di, dj, -math.log(p)) for (di, dj), p in SENTENCE_PRIORS.items()]
    n, m = len(zh_lens), len(en_lens)
    zc, ec = list(accumulate(zh_lens, initial=0)), list(accumulate(en_lens, initial=0))  # prefix sums
    zb, eb = breaks
    c, s2, erfc, log, sqrt = lm.c, lm.s2, math.erfc, math.log, math.sqrt
    inf = float("inf")
    best = [[inf] * (m + 1) for _ in range(n + 1)]
    back: list[list[tuple[int, int] | None]] = [[None] * (m + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for i in range(n + 1):
        lo, hi = 0, m
        if band is not None and n:
            mid = i * m / n
            lo, hi = max(0, int(mid) - band), min(m, int(mid) + band + 1)
        for j in range(lo, hi + 1):
            if i == j == 0:
                continue
            b_ij, arg = inf, None
            for di, dj, prior in costs:
                if di > i or dj > j:
                    continue
                prev = best[i - di][j - dj]
                if prev == inf:
                    continue
                lz, le = zc[i] - zc[i - di], ec[j] - ec[j - dj]
                mean = (lz + le / c) / 2
                d = abs(le - c * lz) / sqrt(s2 * (mean if mean > 1 else 1.0))  # |lm.delta|, inlined: the hot loop
                # the bead's length cost: -log P(|delta| at least this large) under a standard normal
                cost = prev + prior - log(max(erfc(d * 0.7071067811865476), 1e-300))
                if cost < b_ij:
                    b_ij, arg = cost, (di, dj)
            if arg is not None and i in zb and j in eb:
                b_ij -= BREAK_BONUS
            best[i][j], back[i][j] = b_ij, arg
    if back[n][m] is None and (n or m):
        return align(zh_lens, en_lens, lm, breaks=breaks)  # the band cut every path: no band
    beads = []
    i, j = n, m
    while i or j:
        di, dj = back[i][j]
        beads.append(Bead((i - di, i), (j - dj, j), lm.delta(zc[i] - zc[i - di], ec[j] - ec[j - dj])))
        i, j = i - di, j - dj
    return beads[::-1]


def sentences(paragraphs: list[str], split) -> tuple[list[str], set[int]]:
    """The sentences of consecutive paragraphs, and the sentence counts at which a paragraph ends."""
    out, ends = [], set()
    for p in paragraphs:
        out += split(p)
        ends.add(len(out))
    return out, ends


def paragraph_indices(paragraphs: list[str], split, sentence_indices) -> set[int]:
    """The paragraphs (indices) that hold the given sentences of `sentences(paragraphs, split)`."""
    ends = list(accumulate(len(split(p)) for p in paragraphs))  # a paragraph without sentences keeps its index
    return {bisect.bisect_right(ends, i) for i in sentence_indices}


def align_document(zh_paragraphs: list[str], en_paragraphs: list[str], lm: LengthModel, *,
                   own_ratio: bool = True) -> list[tuple[str, str, Bead]]:
    """(zh sentence(s), en sentence(s), bead) for every bead of a document, 1-0 and 0-1 beads included.

    Aligned sentence by sentence, as paragraphs need not correspond. With own_ratio, c is refitted to the
    document's 1-1 beads and it is aligned again: each translator writes longer or shorter."""
    zs, zb = sentences(zh_paragraphs, split_chinese)
    es, eb = sentences(en_paragraphs, split_english)
    zl, el = [length(s) for s in zs], [length(s) for s in es]
    band = max(BAND_MIN, int(BAND_SHARE * max(len(zs), len(es))))
    beads = align(zl, el, lm, breaks=(zb, eb), band=band)
    ones = [b for b in beads if b.kind == "1-1"]
    if own_ratio and len(ones) >= 5:
        c = sum(el[b.en[0]] for b in ones) / max(sum(zl[b.zh[0]] for b in ones), 1)
        lm = LengthModel(c=c, s2=lm.s2)
        beads = align(zl, el, lm, breaks=(zb, eb), band=band)
    return [("".join(zs[b.zh[0]:b.zh[1]]), " ".join(es[b.en[0]:b.en[1]]), b) for b in beads]

