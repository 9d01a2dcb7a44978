"""The numbers a load test reports, computed exactly from the per-request records.

Throughput is counted over the measured window (first request sent -> last request finished, or the run's
end for requests it cut), from the tokens of successful requests and those cut requests had received. TTFT and
ITL come from streaming requests only; ITL pools every gap between consecutive content chunks of every
request (as vLLM's benchmark does), so long answers weigh more than short ones."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from loadtests.records import RequestRecord


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


@dataclass
class Summary:
    scenario: str
    users: int
    requests: int  # finished requests, ok or not (not those the run's end cut)
    failures: int
    window_s: float
    req_per_s: float  # successful requests per second
    output_tok_per_s: float  # output tokens per second: of successful requests, and what cut ones received
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    ttft_p99_s: float | None = None
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_p95_s: float | None = None
    mean_output_tokens: float = 0.0
    failures_by_status: dict[str, int] = field(default_factory=dict)  # "429" -> n, "0" = no response

    @property
    def error_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0

    def to_row(self) -> dict:
        row = asdict(self)
        row["error_rate"] = self.error_rate
        row["failures_by_status"] = " ".join(f"{k}:{v}" for k, v in sorted(self.failures_by_status.items()))
        return row


def summarize(records: list[RequestRecord], scenario: str = "", users: int = 0) -> Summary:
    """Summary of one run. Raises ValueError when there is nothing to summarise."""
    if not records:
        raise ValueError("no requests were recorded: was the service reachable?")
    ok = [r for r in records if r.ok]
    cut = [r for r in records if r.cut]
    finished = [r for r in records if not r.cut]
    window = max(r.end for r in records) - min(r.start for r in records)
    window = max(window, 1e-9)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [g for r in ok for g in r.itl_s]
    e2es = [r.e2e_s for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    fails = Counter(str(r.status) for r in finished if not r.ok)
    return Summary(
        scenario=scenario or ",".join(sorted({r.scenario for r in records})),
        users=users,
        requests=len(finished),
        failures=len(finished) - len(ok),
        window_s=window,
        req_per_s=len(ok) / window,
        output_tok_per_s=(out_tokens + sum(r.output_tokens for r in cut)) / window,
        ttft_p50_s=_pct(ttfts, 50),
        ttft_p95_s=_pct(ttfts, 95),
        ttft_p99_s=_pct(ttfts, 99),
        itl_p50_s=_pct(itls, 50),
        itl_p95_s=_pct(itls, 95),
        e2e_p50_s=_pct(e2es, 50),
        e2e_p95_s=_pct(e2es, 95),
        mean_output_tokens=out_tokens / len(ok) if ok else 0.0,
        failures_by_status=dict(fails),
    )


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


COLUMNS = [
    ("target", 14),
    ("users", 5),
    ("req/s", 7),
    ("out tok/s", 9),
    ("TTFT p50/p95/p99 ms", 20),
    ("ITL p50/p95 ms", 14),
    ("e2e p50/p95 ms", 15),
    ("errors", 14),
]


def format_table(rows: list[tuple[str, Summary]]) -> str:
    """A fixed-width table, one line per (target label, summary)."""
    head = "  ".join(name.rjust(w) for name, w in COLUMNS)
    lines = [head, "-" * len(head)]
    for label, s in rows:
        errors = f"{s.error_rate:.1%}"
        if s.failures_by_status:
            errors += " (" + ",".join(f"{k}:{v}" for k, v in sorted(s.failures_by_status.items())) + ")"
        cells = [
            label,
            str(s.users),
            f"{s.req_per_s:.2f}",
            f"{s.output_tok_per_s:.1f}",
            f"{_ms(s.ttft_p50_s)}/{_ms(s.ttft_p95_s)}/{_ms(s.ttft_p99_s)}",
            f"{_ms(s.itl_p50_s)}/{_ms(s.itl_p95_s)}",
            f"{_ms(s.e2e_p50_s)}/{_ms(s.e2e_p95_s)}",
            errors,
        ]
        lines.append("  ".join(c.rjust(w) for c, (_, w) in zip(cells, COLUMNS, strict=True)))
    return "\n".join(lines)
