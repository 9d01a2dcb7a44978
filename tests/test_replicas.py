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


def _router():
    router = ReadyFirstRouter.__new__(ReadyFirstRouter)  # Serve builds it with its own arguments
    router.initialize_state()
    return router


def _replica(n, ready):
    return SimpleNamespace(routing_stats={} if ready is None else {"ready": ready}, replica_id=n)


def test_router_offers_only_ready_replicas_once_one_is_ready():
    router = _router()
    loading = [_replica(i, False) for i in range(3)]
    ready = [_replica(i, True) for i in range(3, 6)]
    ranks = asyncio.run(router.choose_replicas(loading[:2]))
    assert sorted(r.replica_id for (r,) in ranks) == [0, 1]  # none ready: all (healthz answers)
    assert [[r.replica_id for r in rank] for rank in asyncio.run(router.choose_replicas([_replica(9, None)]))] == [[9]]
    for _ in range(20):
        ranks = asyncio.run(router.choose_replicas(loading + ready))
        assert sorted(r.replica_id for (r,) in ranks) == [3, 4, 5]
    assert [r.replica_id for (r,) in asyncio.run(router.choose_replicas(loading + ready[:1]))] == [3]


def test_router_sends_a_burst_to_the_replica_with_fewest_in_flight(monkeypatch):
    """Serve's cached queue lengths go stale when idle; the router counts each request on the replica it
    ranks first as it ranks it (a burst routes concurrently) and uncounts it when it completes."""
    from ray.serve.request_router import RequestRouter

    monkeypatch.setattr(RequestRouter, "on_request_completed", lambda self, replica_id, request_id: None)
    monkeypatch.setattr(RequestRouter, "on_request_routed", lambda self, request, replica_id, result: None)
    router = _router()
    replicas = [_replica(i, True) for i in range(2)]

    def request(rid):
        return SimpleNamespace(metadata=SimpleNamespace(internal_request_id=rid))

    firsts = [asyncio.run(router.choose_replicas(replicas, request(str(i))))[0][0].replica_id for i in range(64)]
    assert router.in_flight == {0: 32, 1: 32} and firsts.count(0) == 32
    asyncio.run(router.choose_replicas(replicas, request("0")))  # chosen again: counted once
    assert router.in_flight == {0: 32, 1: 32}  # ranked without its own count: back where it was
    firsts[0] = router.placed["0"].replica_id
    for i in range(5):  # Serve names the replica too; the count follows where each was placed
        router.on_request_completed(firsts[i], str(i))
    assert [router.in_flight[r] for r in (0, 1)] == [32 - firsts[:5].count(r) for r in (0, 1)]
    (first,), _ = asyncio.run(router.choose_replicas(replicas, request("99")))
    assert router.in_flight[first.replica_id] == min(router.in_flight.values())
    other = 1 - first.replica_id
    router.on_request_routed(request("99"), other, None)  # Serve sent it elsewhere: counted there
    assert router.placed["99"].replica_id == other and router.placed["99"].routed
    before = dict(router.in_flight)
    router.swept_at = -1e9
    for p in router.placed.values():
        p.chosen_at -= 3600  # chosen an hour ago
    asyncio.run(router.choose_replicas(replicas))  # those never routed were cancelled: uncounted
    assert list(router.placed) == ["99"] and sum(router.in_flight.values()) == 1 and before[other] >= 1


def test_light_load_stays_on_one_replica(monkeypatch):
    """One request at a time goes to the same replica (its prefix cache holds what came before); a second
    at once goes to the other."""
    from ray.serve.request_router import RequestRouter

    monkeypatch.setattr(RequestRouter, "on_request_completed", lambda self, replica_id, request_id: None)
    router = _router()
    replicas = [_replica(i, True) for i in (1, 0)]
    request = lambda rid: SimpleNamespace(metadata=SimpleNamespace(internal_request_id=rid))  # noqa: E731
    firsts = []
    for i in range(10):
        firsts.append(asyncio.run(router.choose_replicas(replicas, request(str(i))))[0][0].replica_id)
        router.on_request_completed(firsts[-1], str(i))
    assert len(set(firsts)) == 1
    a = asyncio.run(router.choose_replicas(replicas, request("a")))[0][0].replica_id
    b = asyncio.run(router.choose_replicas(replicas, request("b")))[0][0].replica_id
    assert {a, b} == {0, 1}


def test_deployment_reports_readiness_for_routing():
    """Ready once loaded, where the generator serves: a replica that lost it (a GPU two replicas share ran
    out of memory) answers /readyz and each chat request 503, and must not draw requests from the others."""
    from service.api.backends import Backends
    from service.config import GENERATOR_ID
    from service.deployments import AttnServe
    from service.startup import Startup

    replica = SimpleNamespace(startup=Startup(), backends=Backends(generator=object()))
    stats = AttnServe.func_or_class.record_routing_stats
    assert stats(replica) == {"ready": False}
    replica.startup.done()
    assert stats(replica) == {"ready": True}
    replica.backends = Backends(unavailable={GENERATOR_ID: "CUDA out of memory"})
    assert stats(replica) == {"ready": False}


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


def test_a_lock_held_elsewhere_is_reported_without_waiting(tmp_path):
    with file_lock(tmp_path / "x.lock") as held:
        assert held
        with file_lock(tmp_path / "x.lock", wait=False) as second:  # another open file: another holder
            assert not second
    with file_lock(tmp_path / "x.lock", wait=False) as held:
        assert held


def test_replicas_build_a_steps_packages_side_by_side(tmp_path):
    """Two packages, one being built by another replica: this one builds the other first, then waits."""
    import functools

    import torch

    from service.engine.aot_package import load_or_build, load_or_build_each, package_path

    def double(model, x):
        return (x * 2,)

    x = torch.ones(4)
    other = dict(freezing=False, key=("busy",), threads=1)
    calls = []

    def step(name, wait=True):
        calls.append((name, wait))
        if name == "busy" and not wait:
            return None  # another process holds its lock
        return name

    with file_lock(package_path(tmp_path, "step", other["key"], freezing=False, threads=1).with_suffix(".lock")):
        assert load_or_build(tmp_path, "step", double, torch.nn.Module(), (x,), (None,), wait=False, **other) is None
    assert not list(tmp_path.rglob("*.pt2"))  # nothing built while another process held it
    assert load_or_build_each(functools.partial(step, "busy"), functools.partial(step, "free")) == ["busy", "free"]
    # after building its own it looks again (the other may be done), then waits
    assert calls == [("busy", False), ("free", False), ("busy", False), ("busy", True)]


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
