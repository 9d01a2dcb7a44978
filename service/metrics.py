"""The service's metrics, named after vLLM's set with the `attnserve_` prefix, and where they go.

Every metric is declared once in `SPECS`; a recorder makes them live: `PrometheusRecorder` (the default,
without Ray) or `service.ray_metrics.RayRecorder`, which a Ray replica `install()`s. Defined at import time
in this module, never in the deployment file (Ray pickles that by value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "attnserve_"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class MetricSpec:
    name: str                   # without PREFIX; counters without `_total` (added on export)
    kind: str                   # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[str, ...] = ("model",)
    buckets: tuple[float, ...] = ()
    combine: str = "sum"        # how GET /metrics combines replicas: "sum" or "mean" (ratios)


SPECS: tuple[MetricSpec, ...] = (
    MetricSpec("time_to_first_token_seconds", "histogram", "Time to first token (queue + prefill).",
               buckets=_LATENCY),
    MetricSpec("inter_token_latency_seconds", "histogram", "Time between consecutive output tokens.",
               buckets=_ITL),
    MetricSpec("e2e_request_latency_seconds", "histogram", "End-to-end request latency inside the engine.",
               buckets=_LATENCY),
    MetricSpec("request_queue_time_seconds", "histogram", "Time a request waited for a KV cache slot.",
               buckets=_LATENCY),
    MetricSpec("iteration_batch_size", "histogram", "Sequences in one engine step.", buckets=_BATCH),
    MetricSpec("num_requests_running", "gauge",
               "Sequences holding KV cache slots (each choice of a request, each sentence of a translation)."),
    MetricSpec("num_requests_waiting", "gauge",
               "Work queued for slots (a request with all its choices, each sentence of a translation)."),
    MetricSpec("kv_cache_usage_ratio", "gauge", "Fraction of KV cache positions in use (0..1).", combine="mean"),
    MetricSpec("prompt_tokens", "counter", "Prompt tokens processed."),
    MetricSpec("generation_tokens", "counter", "Tokens generated."),
    MetricSpec("request_success", "counter", "Finished engine requests by finish reason.",
               labels=("model", "finished_reason")),
    MetricSpec("http_requests", "counter", "HTTP responses by model, route and status code.",
               labels=("model", "route", "status")),
)
SPEC_BY_NAME = {s.name: s for s in SPECS}


class Recorder(Protocol):
    """Live metric objects for SPECS. `labels` are the spec's label values, in order."""

    def inc(self, name: str, labels: tuple[str, ...], amount: float = 1.0) -> None: ...

    def set(self, name: str, labels: tuple[str, ...], value: float) -> None: ...

    def observe(self, name: str, labels: tuple[str, ...], value: float) -> None: ...

    async def render(self) -> bytes: ...


REGISTRY = CollectorRegistry(auto_describe=True)


def _prometheus_metric(spec: MetricSpec):
    kind = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[spec.kind]
    extra = {"buckets": spec.buckets} if spec.kind == "histogram" else {}
    return kind(PREFIX + spec.name, spec.help, list(spec.labels), registry=REGISTRY, **extra)


PROMETHEUS = {s.name: _prometheus_metric(s) for s in SPECS}


class PrometheusRecorder:
    """prometheus_client objects in this process's REGISTRY (one per process: per replica under Ray)."""

    def inc(self, name, labels, amount=1.0):
        PROMETHEUS[name].labels(*labels).inc(amount)

    def set(self, name, labels, value):
        PROMETHEUS[name].labels(*labels).set(value)

    def observe(self, name, labels, value):
        PROMETHEUS[name].labels(*labels).observe(value)

    async def render(self) -> bytes:
        return generate_latest(REGISTRY)


_recorder: Recorder = PrometheusRecorder()


def install(recorder: Recorder) -> None:
    """Send every metric of this process to `recorder` from now on (a Ray replica installs RayRecorder)."""
    global _recorder
    _recorder = recorder


def installed() -> Recorder:
    return _recorder


class EngineMetrics:
    """The engine's MetricsSink, writing to the installed recorder (looked up per call)."""

    def on_step(self, model: str, batch_size: int, kv_usage: float, running: int, waiting: int) -> None:
        r = _recorder
        if batch_size:
            r.observe("iteration_batch_size", (model,), batch_size)
        r.set("kv_cache_usage_ratio", (model,), kv_usage)
        r.set("num_requests_running", (model,), running)
        r.set("num_requests_waiting", (model,), waiting)

    def on_first_token(self, model: str, queue_s: float, ttft_s: float) -> None:
        _recorder.observe("request_queue_time_seconds", (model,), queue_s)
        _recorder.observe("time_to_first_token_seconds", (model,), ttft_s)

    def on_token_latency(self, model: str, itl_s: float) -> None:
        _recorder.observe("inter_token_latency_seconds", (model,), itl_s)

    def on_finish(self, model: str, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                  e2e_s: float) -> None:
        r = _recorder
        r.inc("request_success", (model, finish_reason))
        r.inc("prompt_tokens", (model,), prompt_tokens)
        r.inc("generation_tokens", (model,), generation_tokens)
        r.observe("e2e_request_latency_seconds", (model,), e2e_s)


def count_http(model: str, route: str, status: int) -> None:
    _recorder.inc("http_requests", (model or "none", route, str(status)))


async def render() -> tuple[bytes, str]:
    """Prometheus text exposition of every attnserve metric the installed recorder can see."""
    return await _recorder.render(), CONTENT_TYPE_LATEST
