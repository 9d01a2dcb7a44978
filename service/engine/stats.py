"""Live engine statistics and the metrics hook the HTTP layer plugs in (Prometheus, Ray metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class MetricsSink(Protocol):
    """Receives engine events; implementations must be cheap (called on the engine's hot path)."""

    def on_step(self, model: str, batch_size: int, kv_usage: float, running: int, waiting: int) -> None: ...

    def on_first_token(self, model: str, queue_s: float, ttft_s: float) -> None: ...

    def on_token_latency(self, model: str, itl_s: float) -> None: ...

    def on_finish(self, model: str, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                  e2e_s: float) -> None: ...


class NullSink:
    """A sink that drops everything."""

    def on_step(self, model, batch_size, kv_usage, running, waiting) -> None:
        pass

    def on_first_token(self, model, queue_s, ttft_s) -> None:
        pass

    def on_token_latency(self, model, itl_s) -> None:
        pass

    def on_finish(self, model, finish_reason, prompt_tokens, generation_tokens, e2e_s) -> None:
        pass


@dataclass
class EngineStats:
    running: int = 0  # requests holding slots
    waiting: int = 0  # requests queued for a slot
    slots_total: int = 0
    slots_used: int = 0
    kv_usage_ratio: float = 0.0  # cache positions in use / total positions
    steps: int = 0  # forward steps run so far
    last_batch_size: int = 0  # rows of the last step
    requests_finished: int = 0
