"""GET /metrics under Ray: Ray's metrics exports (one per node) -> one series per attnserve label set."""

from __future__ import annotations

from api_util import metric

from service.ray_metrics import aggregate

_COMMON = 'Component="core_worker",NodeAddress="127.0.0.1",SessionName="s1",Version="2.60.0"'


def _export(worker: str, replica: str, app: str, tokens: float, kv: float, ttft_buckets: list[float]) -> str:
    """A Ray metrics export as Ray writes it: `ray_` prefix, bookkeeping labels, counters also as gauges."""
    tags = f'{_COMMON},WorkerId="{worker}",application="{app}",deployment="AttnServe",replica="{replica}"'
    m = 'model="smollm2-135m-instruct"'
    lines = [
        "# HELP ray_attnserve_generation_tokens_total Tokens generated.",
        "# TYPE ray_attnserve_generation_tokens_total counter",
        f"ray_attnserve_generation_tokens_total{{{tags},{m}}} {tokens}",
        "# HELP ray_attnserve_generation_tokens Tokens generated.",
        "# TYPE ray_attnserve_generation_tokens gauge",
        f"ray_attnserve_generation_tokens{{{tags},{m}}} {tokens}",
        "# HELP ray_attnserve_kv_cache_usage_ratio Fraction of KV cache positions in use (0..1).",
        "# TYPE ray_attnserve_kv_cache_usage_ratio gauge",
        f"ray_attnserve_kv_cache_usage_ratio{{{tags},{m}}} {kv}",
        "# HELP ray_attnserve_time_to_first_token_seconds Time to first token (queue + prefill).",
        "# TYPE ray_attnserve_time_to_first_token_seconds histogram",
    ]
    for le, v in zip(["0.5", "1.0", "+Inf"], ttft_buckets, strict=True):
        lines.append(f'ray_attnserve_time_to_first_token_seconds_bucket{{{tags},le="{le}",{m}}} {v}')
    lines += [f"ray_attnserve_time_to_first_token_seconds_count{{{tags},{m}}} {ttft_buckets[-1]}",
              f"ray_attnserve_time_to_first_token_seconds_sum{{{tags},{m}}} {0.4 * ttft_buckets[-1]}",
              "# HELP ray_serve_num_http_requests_total Ray's own.",
              "# TYPE ray_serve_num_http_requests_total counter",
              f"ray_serve_num_http_requests_total{{{tags}}} 99"]
    return "\n".join(lines) + "\n"


def test_replicas_and_nodes_combine_into_one_series_per_label_set():
    node1 = _export("w1", "r1", "attnserve", 10, 0.2, [1, 2, 3]) + _export("w2", "r2", "attnserve", 5, 0.6, [0, 1, 1])
    node2 = _export("w3", "r3", "attnserve", 7, 0.4, [2, 2, 2]) + _export("w4", "r4", "batched", 1000, 1.0, [9, 9, 9])
    text = aggregate([node1, node2], application="attnserve")
    m = {"model": "smollm2-135m-instruct"}
    assert metric(text, "attnserve_generation_tokens_total", **m) == 22  # summed, counter kept, gauge twin dropped
    assert abs(metric(text, "attnserve_kv_cache_usage_ratio", **m) - 0.4) < 1e-9  # a ratio: averaged
    assert metric(text, "attnserve_time_to_first_token_seconds_bucket", le="0.5", **m) == 3
    assert metric(text, "attnserve_time_to_first_token_seconds_bucket", le="+Inf", **m) == 6
    assert metric(text, "attnserve_time_to_first_token_seconds_count", **m) == 6
    for ray_label in ("WorkerId", "replica", "NodeAddress", "application", "ray_"):
        assert ray_label not in text
    assert text.count("# TYPE attnserve_generation_tokens counter") == 1
    # without an application filter every application counts
    assert metric(aggregate([node1, node2]), "attnserve_generation_tokens_total", **m) == 1022


def test_no_exports_render_empty():
    assert aggregate([]) == ""
