"""Inputs for the load-test scenarios: chat prompts we wrote, and translation sentences.

Translation inputs come from the held-out TEST split of the translator's corpus (never its training
data). That corpus is "Free For Educational Use" and must not be committed, so
`data/translate_inputs.jsonl` is generated at run time from `<home>/data/translate/test.tsv`
(English TAB Chinese) when missing; without the split, a small set of sentences we wrote is used."""

from __future__ import annotations

import json
import os
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
PROMPTS = DATA_DIR / "prompts.jsonl"
TRANSLATE_INPUTS = DATA_DIR / "translate_inputs.jsonl"  # generated, git-ignored
TRANSLATE_FALLBACK = DATA_DIR / "translate_fallback.jsonl"  # ours, committed


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def load_prompts(path: Path = PROMPTS) -> list[list[dict]]:
    """Chat conversations (lists of {"role", "content"}) for the generate and chat scenarios."""
    return [row["messages"] for row in read_jsonl(path)]


def default_test_split() -> Path:
    home = Path(os.environ.get("ATTNSERVE_HOME", Path.home() / ".cache" / "attnserve"))
    return home / "data" / "translate" / "test.tsv"


def build_translate_inputs(test_tsv: Path, out: Path, per_direction: int = 50) -> int:
    """Picks `per_direction` English and as many Chinese sentences of moderate length, spread evenly
    over the test split, and writes them as {"text", "source_lang", "target_lang"} lines. Returns the count."""
    pairs = []
    for line in test_tsv.read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        if len(parts) != 2:
            continue
        en, zh = parts[0].strip(), parts[1].strip()
        if 30 <= len(en) <= 200 and 10 <= len(zh) <= 80:  # skip headings and very long paragraphs
            pairs.append((en, zh))
    if not pairs:
        return 0
    step = max(1, len(pairs) // (2 * per_direction))
    picked = pairs[::step][: 2 * per_direction]
    rows = []
    for i, (en, zh) in enumerate(picked):  # alternate directions so both halves span the split
        if i % 2 == 0:
            rows.append({"text": en, "source_lang": "en", "target_lang": "zh"})
        else:
            rows.append({"text": zh, "source_lang": "zh", "target_lang": "en"})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(out)
    return len(rows)


def load_translate_inputs(test_tsv: Path | None = None, out: Path = TRANSLATE_INPUTS) -> list[dict]:
    """Translation inputs: the generated file, generating it from the test split if needed, else our fallback."""
    if not out.exists():
        split = test_tsv or default_test_split()
        if split.exists():
            build_translate_inputs(split, out)
    if out.exists():
        rows = read_jsonl(out)
        if rows:
            return rows
    return read_jsonl(TRANSLATE_FALLBACK)


def by_direction(rows: list[dict]) -> dict[str, list[str]]:
    """{"zh": [english sentences to translate into Chinese], "en": [Chinese sentences into English]}."""
    out: dict[str, list[str]] = {"zh": [], "en": []}
    for r in rows:
        out[r["target_lang"]].append(r["text"])
    return out
