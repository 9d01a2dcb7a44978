"""One line of JSON per finished request: what the Locust scenarios write and the summary reads.

The Locust process appends a `RequestRecord` per request to a JSONL file; the CLI (another process,
since Locust's gevent and Ray cannot share one) reads the file back to compute exact percentiles,
rather than Locust's rounded response-time buckets."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RequestRecord:
    scenario: str  # the Locust request name, e.g. "chat-stream"
    start: float  # wall clock (time.time()) when the request was sent
    end: float  # wall clock when the last byte was read (or the failure happened)
    ok: bool
    status: int  # HTTP status; 0 = no response (connection error, dropped arrival)
    ttft_s: float | None = None  # time to first content chunk; None for non-streaming requests
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    output_tokens: int = 0  # from the response's usage when present, else counted chunks
    error: str = ""
    # the run ended while it streamed: the tokens it had received count toward throughput; neither a
    # success nor a failure, and not in the latencies
    cut: bool = False

    @property
    def e2e_s(self) -> float:
        return self.end - self.start


class RecordWriter:
    """Appends records to a JSONL file, flushing each line so a killed run keeps what it measured."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, rec: RequestRecord) -> None:
        self._f.write(json.dumps(asdict(rec), ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_records(path: str | Path) -> list[RequestRecord]:
    """Reads a records file; a torn last line (the writer was killed mid-write, maybe inside a character of a
    non-ASCII error text) is skipped."""
    out: list[RequestRecord] = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(RequestRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
    return out
