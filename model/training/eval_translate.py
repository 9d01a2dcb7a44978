"""`attnserve eval translate`: sacreBLEU and chrF on a held-out split, both directions.

Choices between checkpoints are made on the dev splits, so `test` and `ted_test` stay a measurement. The
translations come from the served engine's `translate`, so the scores are those of what `/v1/translate`
answers. Also reports loop rates and, for Chinese, the full-width share of punctuation.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from model.progress import progress, write_line
from model.punctuation import punctuation_counts
from model.training import translate_data

# (texts, target_lang, beam_size, done) -> translations; done(n) says n texts have finished
Translate = Callable[[list[str], str, int, Callable[[int], None]], list[str]]


def loops(text: str, lang: str, n: int = 4, times: int = 3) -> bool:
    """True when some n-gram occurs `times` or more in `text` (words for English, characters for
    Chinese): "各国各国各国各国", "of the Foundation of the Foundation of the Foundation"."""
    units = [c for c in text if not c.isspace()] if lang == "zh" else text.split()
    grams = Counter(tuple(units[i:i + n]) for i in range(len(units) - n + 1))
    return bool(grams) and max(grams.values()) >= times


def loop_rate(texts: list[str], lang: str) -> float:
    return sum(loops(t, lang) for t in texts) / max(len(texts), 1)


def evaluate(checkpoint: str | Path, out: str | Path | None = None, *, translate: Translate, beams=(1, 4),
             limit: int | None = None, split: str = "test", data_dir: Path | None = None) -> dict:
    import sacrebleu

    pairs = translate_data.read_heldout(split, data_dir)[:limit]
    report = {"checkpoint": str(checkpoint), "split": split, f"{split}_pairs": len(pairs), "results": {}, "samples": {}}
    bar = progress(desc=f"eval {split}", total=2 * len(beams) * len(pairs), unit="sentence")
    for direction, tgt in (("zh2en", "en"), ("en2zh", "zh")):
        srcs = [zh if tgt == "en" else en for en, zh in pairs]
        refs = [en if tgt == "en" else zh for en, zh in pairs]
        for beam in beams:
            bar.set_postfix_str(f"{direction} beam {beam}")
            t0, before = time.time(), bar.n
            hyps = translate(srcs, tgt, beam, lambda n, before=before: bar.update(before + n - bar.n))
            bar.update(before + len(srcs) - bar.n)  # whatever `done` did not report
            secs = time.time() - t0
            bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize="zh" if tgt == "zh" else "13a")
            chrf = sacrebleu.corpus_chrf(hyps, [refs])
            key = f"{direction}_beam{beam}"
            loop_share, ref_loop_share = loop_rate(hyps, tgt), loop_rate(refs, tgt)
            report["results"][key] = {"bleu": round(bleu.score, 2), "chrf": round(chrf.score, 2),
                                      "signature": bleu.format(signature=True).split(" = ")[0],
                                      "brevity_penalty": round(bleu.bp, 3),
                                      "length_ratio": round(bleu.ratio, 3),  # hypothesis / reference length
                                      "seconds": round(secs, 1),
                                      "sentences_per_s": round(len(srcs) / max(secs, 1e-6), 2),
                                      "loop_rate": round(loop_share, 4),
                                      "reference_loop_rate": round(ref_loop_share, 4)}
            if tgt == "zh":
                marks = [punctuation_counts(h) for h in hyps]
                full, half = sum(f for f, _ in marks), sum(a for _, a in marks)
                report["results"][key]["fullwidth_punct_share"] = round(full / max(full + half, 1), 4)
            write_line(f"{key:14s} BLEU {bleu.score:6.2f}  chrF {chrf.score:6.2f}  loops {loop_share:.1%} "
                       f"(references {ref_loop_share:.1%})  length ratio {bleu.ratio:.2f}  "
                       f"({secs:.0f} s)")
            if beam == max(beams):
                report["samples"][direction] = [{"source": s, "reference": r, "output": h}
                                                for s, r, h in list(zip(srcs, refs, hyps))[:5]]
    bar.close()
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {out}")
    return report
