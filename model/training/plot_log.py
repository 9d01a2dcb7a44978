"""Plot a training log (JSON lines from train_translate): loss and dev BLEU against training hours.

    python -m model.training.plot_log $ATTNSERVE_HOME/runs/translate/translate/train.log docs/translate_training.png
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path


def plot(log_path: str | Path, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for line in Path(log_path).read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line a kill cut short (a resume appends after it)
            rows.append(json.loads(line))
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if r.get("event") == "eval"]
    if not train:  # evaluations are placed by the hours of the training lines
        raise ValueError(f"{log_path}: no training lines (loss) to plot yet")
    hours_at = {r["step"]: r["hours"] for r in train}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["hours"] for r in train], [r["loss"] for r in train], lw=0.8, color="tab:blue")
    ax.set_xlabel("training hours (wall clock, 2-core CPU, shared)")
    ax.set_ylabel("train loss (label-smoothed, nats)", color="tab:blue")
    if evals:
        ax2 = ax.twinx()
        xs = [hours_at.get(r["step"], min(hours_at.items(), key=lambda kv: abs(kv[0] - r["step"]))[1])
              for r in evals]
        keys = sorted({k for r in evals for k in r if "bleu_" in k})  # bleu_zh2en (HK dev), ted_dev_bleu_zh2en, ...
        for key in keys:
            pts = [(x, r[key]) for x, r in zip(xs, evals, strict=True) if key in r]
            label = ("dev " + key).replace("dev ted_dev_", "TED dev ").replace("bleu_", "BLEU ")
            ax2.plot(*zip(*pts, strict=True), "o-" if key.endswith("zh2en") else "s--",
                     color="tab:purple" if key.startswith("ted_") else "tab:red", label=label)
        ax2.set_ylabel("dev BLEU (greedy, 200 sentences)", color="tab:red")
        ax2.legend(loc="upper center")
    ax.set_title("attnserve-zh-en training")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return Path(out)


if __name__ == "__main__":
    print(plot(sys.argv[1], sys.argv[2]))
