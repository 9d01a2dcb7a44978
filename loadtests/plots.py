"""PNG plots of a concurrency sweep, drawn from its sweep.csv (one row per target and user count):
throughput vs concurrency, TTFT percentiles vs concurrency, ITL percentiles vs concurrency."""

from __future__ import annotations

import csv
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

TEXT_FIELDS = ("target", "scenario", "failures_by_status")


def _num(v: str) -> float | None:
    return float(v) if v not in ("", "None", None) else None


def read_sweep(csv_path: str | Path) -> dict[str, list[dict]]:
    """sweep.csv -> {target: rows sorted by users}, numeric fields as floats (None when absent)."""
    by_target: dict[str, list[dict]] = {}
    with open(csv_path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            parsed = {k: (v if k in TEXT_FIELDS else _num(v)) for k, v in row.items()}
            by_target.setdefault(row["target"], []).append(parsed)
    for rows in by_target.values():
        rows.sort(key=lambda r: r["users"])
    return by_target


def _line(ax, rows, key, label, style="-o", scale=1.0):
    pts = [(r["users"], r[key] * scale) for r in rows if r.get(key) is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)


def plot_sweep(csv_path: str | Path, out_dir: str | Path | None = None, title: str = "") -> list[Path]:
    """Draws throughput.png, ttft.png and itl.png next to the CSV (or in out_dir); returns their paths."""
    csv_path = Path(csv_path)
    out = Path(out_dir) if out_dir else csv_path.parent
    out.mkdir(parents=True, exist_ok=True)
    data = read_sweep(csv_path)
    if not data:
        raise ValueError(f"{csv_path}: no rows to plot")
    multi = len(data) > 1
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for target, rows in data.items():
        _line(ax, rows, "output_tok_per_s", target)
    ax.set(xlabel="concurrent users", ylabel="output tokens/s")
    # a long title (peers, host, CPU flags) wraps instead of running off the figure
    ax.set_title(textwrap.fill(title or "Throughput vs concurrency", 70), fontsize=9 if title else None)
    paths.append(_finish(fig, ax, out / "throughput.png"))

    latencies = (("ttft", "Time to first token", ("p50", "p95", "p99")), ("itl", "Inter-token latency", ("p50", "p95")))
    for key, name, pcts in latencies:
        fig, ax = plt.subplots(figsize=(6, 4))
        for target, rows in data.items():
            for pct, style in zip(pcts, ("-o", "--s", ":^"), strict=False):
                _line(ax, rows, f"{key}_{pct}_s", f"{target} {pct}" if multi else pct, style, scale=1000.0)
        ax.set(xlabel="concurrent users", ylabel="ms", title=f"{name} vs concurrency")
        paths.append(_finish(fig, ax, out / f"{key}.png"))
    return paths


def _finish(fig, ax, path: Path) -> Path:
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
