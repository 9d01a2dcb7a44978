"""Test BLEU of the shipped translator exports against training hours (HK and TED test), with a log-linear trend.

    python -m model.training.plot_progress docs/translate_progress.json docs/translate_bleu_progress.png

The fitted trend `BLEU = a + b ln(hours)` is extended to each goal: an extrapolation of the CPU-hours this
recipe needs, blind to where the model saturates.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

DIRECTIONS = (("zh2en", "zh→en", "o"), ("en2zh", "en→zh", "s"))


def log_fit(hours: list[float], bleu: list[float]) -> tuple[float, float]:
    """Least-squares a, b of bleu = a + b ln(hours)."""
    xs = [math.log(h) for h in hours]
    mx, my = sum(xs) / len(xs), sum(bleu) / len(bleu)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, bleu, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def hours_to(goal: float, a: float, b: float) -> float:
    return math.exp((goal - a) / b) if b > 0 else math.inf


PANELS = (("HK test (1,042 pairs)", ""), ("TED test (1,045 pairs, 16 held-out talks)", "ted_"))


def plot(data_path: str | Path, out: str | Path) -> dict[str, dict[str, float]]:
    """One panel per test set with the points that carry its scores (TED from the mix on)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(data_path).read_text())
    panels = [(t, pre) for t, pre in PANELS if any(pre + d in p for p in data["points"] for d, _, _ in DIRECTIONS)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), sharex=True, squeeze=False)
    summary = {}
    for ax, (title, prefix) in zip(axes[0], panels, strict=True):
        for (direction, label, marker), color in zip(DIRECTIONS, ("tab:blue", "tab:red"), strict=True):
            key = prefix + direction
            pts = [p for p in data["points"] if key in p]
            if len(pts) < 2:
                continue
            hours, ys = [p["hours"] for p in pts], [p[key] for p in pts]
            a, b = log_fit(hours, ys)
            goal = data["goals"][key]
            reach = hours_to(goal, a, b)
            summary[key] = {"a": round(a, 2), "b": round(b, 2), "goal": goal, "hours_to_goal": round(reach, 1)}
            print(f"{title} {label}: BLEU = {a:.2f} + {b:.2f} ln(hours); goal {goal} at ~{reach:.0f} h "
                  f"(measured {min(hours):.1f}-{max(hours):.1f} h, last {ys[-1]:.2f})")
            ax.plot(hours, ys, marker, color=color, label=f"{label} (beam 4)")
            end = min(max(reach * 1.2, max(hours)), 200)
            grid = [min(hours) * (end / min(hours)) ** (i / 100) for i in range(101)]
            ax.plot(grid, [a + b * math.log(h) for h in grid], "--", color=color, lw=0.9,
                    label=f"{label} trend a + b ln(h), extrapolated")
            ax.axhline(goal, color=color, lw=0.6, ls=":")
            ax.annotate(f"goal {goal}", (grid[0], goal), color=color, fontsize=8, va="bottom")
        ax.set_xscale("log")
        ax.set_xlabel("training hours (wall clock, 2-core CPU), log scale")
        ax.set_ylabel("test BLEU")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("attnserve-zh-en: shipped exports vs training time")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    plot(sys.argv[1], sys.argv[2])
