"""Prometheus metrics for the service, named after vLLM's set with the `attnserve_` prefix.

Defined once at import time in this module (never in the deployment file, which Ray pickles by
value). `PrometheusSink` implements the engine's `MetricsSink`; the HTTP layer counts responses by
status. Each replica process holds its own registry; `GET /metrics` on the ingress renders it.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)
PREFIX = "attnserve_"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
            10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)

TTFT = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token (queue + prefill).",
                 ["model"], buckets=_LATENCY, registry=REGISTRY)
ITL = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens.",
                ["model"], buckets=_ITL, registry=REGISTRY)
E2E = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency inside the engine.",
                ["model"], buckets=_LATENCY, registry=REGISTRY)
QUEUE = Histogram(PREFIX + "request_queue_time_seconds", "Time a request waited for a KV cache slot.",
                  ["model"], buckets=_LATENCY, registry=REGISTRY)
BATCH = Histogram(PREFIX + "iteration_batch_size", "Sequences in one engine step.",
                  ["model"], buckets=_BATCH, registry=REGISTRY)
RUNNING = Gauge(PREFIX + "num_requests_running", "Requests holding KV cache slots.", ["model"],
                registry=REGISTRY)
WAITING = Gauge(PREFIX + "num_requests_waiting", "Requests queued for a slot.", ["model"], registry=REGISTRY)
KV_USAGE = Gauge(PREFIX + "kv_cache_usage_ratio", "Fraction of KV cache positions in use (0..1).", ["model"],
                 registry=REGISTRY)
PROMPT_TOKENS = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed.", ["model"], registry=REGISTRY)
GENERATION_TOKENS = Counter(PREFIX + "generation_tokens", "Tokens generated.", ["model"], registry=REGISTRY)
REQUEST_SUCCESS = Counter(PREFIX + "request_success", "Finished engine requests by finish reason.",
                          ["model", "finished_reason"], registry=REGISTRY)
HTTP_REQUESTS = Counter(PREFIX + "http_requests", "HTTP responses by model, route and status code.",
                        ["model", "route", "status"], registry=REGISTRY)


class PrometheusSink:
    """The engine's MetricsSink, writing to the module-level Prometheus metrics."""

    def on_step(self, model: str, batch_size: int, kv_usage: float, running: int, waiting: int) -> None:
        if batch_size:
            BATCH.labels(model).observe(batch_size)
        KV_USAGE.labels(model).set(kv_usage)
        RUNNING.labels(model).set(running)
        WAITING.labels(model).set(waiting)

    def on_first_token(self, model: str, queue_s: float, ttft_s: float) -> None:
        QUEUE.labels(model).observe(queue_s)
        TTFT.labels(model).observe(ttft_s)

    def on_token_latency(self, model: str, itl_s: float) -> None:
        ITL.labels(model).observe(itl_s)

    def on_finish(self, model: str, finish_reason: str, prompt_tokens: int, generation_tokens: int,
                  e2e_s: float) -> None:
        REQUEST_SUCCESS.labels(model, finish_reason).inc()
        PROMPT_TOKENS.labels(model).inc(prompt_tokens)
        GENERATION_TOKENS.labels(model).inc(generation_tokens)
        E2E.labels(model).observe(e2e_s)


def count_http(model: str, route: str, status: int) -> None:
    HTTP_REQUESTS.labels(model or "none", route, str(status)).inc()


def render() -> tuple[bytes, str]:
    """Prometheus text exposition of every attnserve metric in this process, and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
