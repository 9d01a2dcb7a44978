"""Metrics through Ray: `ray.serve.metrics` in each replica, combined across replicas by `GET /metrics`.

Ray ships each replica's series to its node's metrics export (`ray_` prefix, Ray's own labels), which
Prometheus scrapes on a cluster. So that one node needs nothing but the service's port, `GET /metrics` reads
every alive node's export and combines the replicas into what one vLLM server shows (`aggregate`).

Ray's caveats: series reach the export every `metrics_report_interval_ms`, histogram `_sum` is estimated
from bucket midpoints, and a dead replica's series leave the export, so a combined counter can step down
(`rate()` treats that as a reset).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from service.metrics import PREFIX, SPEC_BY_NAME, SPECS

RAY_PREFIX = "ray_" + PREFIX


class RayRecorder:
    """`ray.serve.metrics` objects for SPECS; only constructible inside a Ray worker."""

    def __init__(self):
        from ray import serve
        from ray.serve import metrics as serve_metrics

        kinds = {"counter": serve_metrics.Counter, "gauge": serve_metrics.Gauge, "histogram": serve_metrics.Histogram}
        self._metrics = {}
        for s in SPECS:  # as metrics._prometheus_metric
            extra = {"boundaries": list(s.buckets)} if s.kind == "histogram" else {}
            self._metrics[s.name] = kinds[s.kind](PREFIX + s.name, s.help, tag_keys=s.labels, **extra)
        try:
            self.application = serve.get_replica_context().app_name
        except Exception:  # not inside a replica (a tool that records from a driver)
            self.application = None

    def _tags(self, name, labels):
        return dict(zip(SPEC_BY_NAME[name].labels, labels, strict=True))

    def inc(self, name, labels, amount=1.0):
        if amount > 0:  # Ray's Counter refuses 0
            self._metrics[name].inc(amount, tags=self._tags(name, labels))

    def set(self, name, labels, value):
        self._metrics[name].set(value, tags=self._tags(name, labels))

    def observe(self, name, labels, value):
        self._metrics[name].observe(value, tags=self._tags(name, labels))

    async def render(self) -> bytes:
        import ray

        # the Prometheus endpoint of Ray's metrics export on every alive node; ray.nodes() is a blocking call
        # to the GCS: off the event loop, which streams every request of this replica
        nodes = await asyncio.to_thread(ray.nodes)
        urls = [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics"
                for n in nodes if n.get("Alive") and n.get("MetricsExportPort")]
        texts = await asyncio.gather(*(_fetch(url) for url in urls))
        missing = [u for u, t in zip(urls, texts, strict=True) if t is None]
        body = aggregate([t for t in texts if t is not None], self.application)
        notes = "".join(f"# attnserve: metrics export {u} did not answer\n" for u in missing)
        return (notes + body).encode()


async def _fetch(url: str) -> str | None:
    import httpx

    try:
        async with httpx.AsyncClient(timeout=3.0) as client:
            r = await client.get(url)
            return r.text if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def aggregate(export_texts: list[str], application: str | None = None) -> str:
    """Ray metrics exports (Prometheus text) -> attnserve's series, replicas combined, in Prometheus text.

    Only families whose type matches SPECS count (Ray also exports each counter as a gauge); the `ray_`
    prefix and every label but the spec's own (and `le`) go, and what then shares a name and labels is
    combined per the spec's `combine`. With `application`, only that Serve application's series count.
    """
    values: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))  # one per replica
    for text in export_texts:
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(RAY_PREFIX):
                continue
            spec = SPEC_BY_NAME.get(family.name[len(RAY_PREFIX):])
            if spec is None or family.type != spec.kind:
                continue
            for sample in family.samples:
                if application is not None and sample.labels.get("application", application) != application:
                    continue
                keep = (*spec.labels, "le") if sample.name.endswith("_bucket") else spec.labels
                key = tuple((k, sample.labels.get(k, "")) for k in keep)
                name = PREFIX + sample.name[len(RAY_PREFIX):]
                values[name][key].append(sample.value)
    lines = []
    for spec in SPECS:
        base = PREFIX + spec.name
        suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}[spec.kind]
        names = [base + s for s in suffixes if base + s in values]
        if not names:
            continue
        lines += [f"# HELP {base} {spec.help}", f"# TYPE {base} {spec.kind}"]
        for name in names:
            for key in sorted(values[name], key=_sort_key):
                value = sum(values[name][key]) / (len(values[name][key]) if spec.combine == "mean" else 1)
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in key)
                lines.append(f"{name}{{{labels}}} {float(value)!r}")
    return "\n".join(lines) + ("\n" if lines else "")


def _sort_key(key: tuple) -> tuple:
    d = dict(key)
    le = d.pop("le", None)
    return (tuple(d.items()), float(le) if le is not None else 0.0)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
