"""Gauges are exported at their value on every scrape: an idle engine reports running/waiting/KV usage
as 0 from its start and keeps re-reporting them while idle (Ray's metrics agent drops a worker's
series once it stops reporting)."""

from __future__ import annotations

import asyncio

from api_util import run

from service.config import GENERATOR_ID
from service.engine import loop as engine_loop
from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.stats import MetricsSink

from engine_util import CharTokenizer, tiny_llama  # isort: skip


class Recording(MetricsSink):
    def __init__(self):
        self.steps = []

    def on_step(self, model, batch_size, kv_usage, running, waiting):
        self.steps.append((batch_size, kv_usage, running, waiting))


def test_idle_engine_keeps_reporting_zero_gauges(monkeypatch):
    monkeypatch.setattr(engine_loop, "IDLE_REPORT_S", 0.02)
    sink = Recording()
    tok = CharTokenizer()
    engine = GenerationEngine(tiny_llama(), tok, EngineConfig(max_slots=2, max_seq_len=32), eos_ids={tok.eos_id},
                              sink=sink)

    async def main():
        await engine.start()
        for _ in range(1000):  # until five idle reports, however slow the host
            if len(sink.steps) >= 5:
                break
            await asyncio.sleep(0.02)
        await engine.stop()

    asyncio.run(main())
    assert len(sink.steps) >= 5 and set(sink.steps) == {(0, 0.0, 0, 0)}, sink.steps[:10]


def test_gauges_are_on_metrics_before_any_request():
    async def main(c):
        await asyncio.sleep(0.05)  # the engine task's first turn reports its idle state
        return (await c.get("/metrics")).text

    text = run(main)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio"):
        assert f'attnserve_{name}{{model="{GENERATOR_ID}"}} 0.0' in text, name
