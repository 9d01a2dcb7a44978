"""Live engine statistics and the metrics hook the HTTP layer plugs in (Prometheus, Ray metrics)."""

from __future__ import annotations

from dataclasses import dataclass


class MetricsSink:
    """Receives engine events and drops them; a recorder overrides what it records. Called on the engine's
    hot path: implementations must be cheap."""

    def on_step(self, model: str, batch_size: int, kv_usage: float, running: int, waiting: int) -> None:
        pass

    def on_first_token(self, model: str, queue_s: float, ttft_s: float) -> None:
        pass

    def on_token_latency(self, model: str, itl_s: float) -> None:
        pass

    def on_finish(self, model: str, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                  e2e_s: float) -> None:
        pass


@dataclass
class EngineStats:
    running: int = 0  # requests holding slots
    waiting: int = 0  # requests queued for a slot
    slots_used: int = 0
    steps: int = 0  # forward steps run so far
    requests_finished: int = 0
