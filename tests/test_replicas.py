"""Replicas side by side (the CPU default runs two): requests go to replicas that are ready, and
cacheable start-up work (weights conversion, compiled steps, the `auto` quantization choice) is done
once and shared."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from model.file_lock import file_lock
from service.routing import ReadyFirstRouter


def _choose(candidates):
    return asyncio.run(ReadyFirstRouter.choose_replicas(None, candidates))


def test_router_offers_only_ready_replicas_once_one_is_ready():
    loading = [SimpleNamespace(routing_stats={"ready": False}, n=i) for i in range(3)]
    ready = [SimpleNamespace(routing_stats={"ready": True}, n=i) for i in range(3, 6)]
    assert [r.n for r in _choose(loading[:2])[0]] == [0, 1]  # none ready: all (healthz answers)
    assert {r.n for r in _choose([SimpleNamespace(routing_stats={}, n=9)])[0]} == {9}  # no stats yet
    for _ in range(20):
        (rank,) = _choose(loading + ready)
        assert len(rank) == 2 and all(r.routing_stats["ready"] for r in rank)
    (rank,) = _choose(loading + ready[:1])
    assert [r.n for r in rank] == [3]


def test_deployment_reports_readiness_for_routing():
    from service.deployments import AttnServe
    from service.startup import Startup

    replica = SimpleNamespace(startup=Startup())
    stats = AttnServe.func_or_class.record_routing_stats
    assert stats(replica) == {"ready": False}
    replica.startup.done()
    assert stats(replica) == {"ready": True}


def test_file_lock_makes_the_second_holder_wait(tmp_path):
    order = []
    held = threading.Event()

    def first():
        with file_lock(tmp_path / "x.lock"):
            held.set()
            time.sleep(0.3)
            order.append("first done")

    t = threading.Thread(target=first)
    t.start()
    held.wait()
    with file_lock(tmp_path / "x.lock"):
        order.append("second in")
    t.join()
    assert order == ["first done", "second in"]


def test_auto_quantization_is_measured_once_per_host(tmp_path, monkeypatch):
    import model.quantize
    from service.engine.config import EngineConfig
    from service.models import resolve_quantization

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the per-host folder
    calls = []
    monkeypatch.setattr(model.quantize, "choose_quantization",
                        lambda dtype, compiled=False: calls.append(dtype) or "int4")
    cfg = EngineConfig(dtype="bfloat16")
    assert resolve_quantization("auto", cfg) == "int4"
    (kept,) = tmp_path.glob("quantization-auto-bfloat16-*.txt")  # keyed by the kernels' code too
    assert kept.read_text() == "int4"
    kept.write_text("int8")  # what another replica measured
    assert resolve_quantization("auto", cfg) == "int8"
    assert len(calls) == 1
    assert resolve_quantization("none", cfg) == "none"
