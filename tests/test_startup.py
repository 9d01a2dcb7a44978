"""Start-up that tells its phases: `attnserve serve` (a subprocess with its own Ray instance) on tiny
checkpoints whose generator compiles its decode step, as the default config does. While the replica
loads, `/readyz` shows at least two distinct phases and model routes answer 503 + Retry-After within
two seconds; once ready they answer 200, and the console's start-up ends with "ready in N s"."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from serve_fixture import service_args, tiny_checkpoints

from loadtests.ports import free_port
from model.paths import REPO_ROOT
from service.startup import RETRY_AFTER_S, Startup

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_startup_state_snapshot():
    s = Startup()
    assert s.snapshot()["phase"] == "starting" and not s.snapshot()["ready"]
    s.set("loading the generator weights", "m", "loading weights")
    s.model("m", "weights loaded: 1 MB")
    snap = s.snapshot()
    assert snap["phase"] == "loading the generator weights" and snap["models"] == {"m": "weights loaded: 1 MB"}
    s.done()
    assert s.snapshot()["ready"] and s.snapshot()["phase"] == "ready"
    failed = Startup()
    failed.fail("ValueError: x")
    assert failed.snapshot()["error"] == "ValueError: x" and failed.snapshot()["phase"] == "failed"


def test_watch_startup_prints_each_line_once_across_alternating_replicas(monkeypatch):
    """Two replicas answer /readyz in turn, one a phase ahead: each phase and model state is printed
    once (when the first replica reaches it), not again whenever the other replica answers."""
    import threading

    import service.startup as startup_mod

    a = {"phase": "compiling the generator engine", "models": {"m": "compiling"}}
    b = {"phase": "loading the generator weights", "models": {"m": "weights loaded: 1 MB"}}
    ready = {"phase": "ready", "ready": True, "models": {"m": "ready"}}
    answers = iter([(503, b), (503, a), (503, b), (503, a), (503, a), (200, ready)])

    class Reply:
        def __init__(self, code, body):
            self.status_code, self._body = code, body

        def json(self):
            return self._body

    monkeypatch.setattr("httpx.get", lambda url, timeout: Reply(*next(answers)))
    said: list[str] = []
    ok = startup_mod.watch_startup("http://x", threading.Event(), time.monotonic(),
                                   say=lambda text, flush=False: said.append(text.split("] ", 1)[1]),
                                   poll_s=0.0)
    assert ok
    assert said == ["loading the generator weights", "  m: weights loaded: 1 MB",
                    "compiling the generator engine", "  m: compiling", "ready", "  m: ready"]


def test_readiness_waits_for_the_request_router_where_one_reads_it():
    """A replica behind ReadyFirstRouter says ready on /readyz only once a routing report has told the
    router so; without such a router (no reports), as soon as it is loaded."""
    alone = Startup()
    alone.done()
    assert alone.serving and alone.snapshot()["ready"]
    routed = Startup()
    assert routed.routing_report() is False  # the router polls while the models load
    routed.done()
    assert routed.ready and not routed.serving
    snap = routed.snapshot()
    assert not snap["ready"] and "router" in snap["phase"]
    assert routed.routing_report() is True
    assert routed.serving and routed.snapshot() == {**snap, "ready": True, "phase": "ready"}


def test_serve_reports_phases_and_answers_503_until_ready(tmp_path):
    gen, tr = tiny_checkpoints(tmp_path)
    args = service_args(gen, tr)
    args["generator"]["engine"]["compile"] = True  # a start-up long enough to watch, as the default config
    port = free_port()
    config = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
              "applications": [{"name": "attnserve", "route_prefix": "/", "import_path": "service.deployments:build",
                                "args": args, "deployments": [{"name": "AttnServe",
                                                               "ray_actor_options": {"num_cpus": 0.5}}]}]}
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump(config))
    env = dict(os.environ, RAY_ADDRESS="local", PYTHONUNBUFFERED="1")
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--config", str(cfg), "--port",
                                 str(port), "--num-cpus", "2", "--object-store-mb", "128"],
                                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    phases, early = [], []
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"not ready after 300 s; phases {phases}"
            try:
                r = httpx.get(url + "/readyz", timeout=5)
                body = r.json()
            except (httpx.HTTPError, ValueError):  # the proxy is not up, or has no route to the app yet
                time.sleep(0.2)
                continue
            if r.status_code == 200:
                break
            # phases and model states: loading tiny checkpoints can pass between two polls
            for state in [body.get("phase"), *(body.get("models") or {}).values()]:
                if state and state not in phases:
                    phases.append(state)
            assert r.status_code == 503 and r.headers["retry-after"] and "elapsed_s" in body, body
            t = time.monotonic()
            g = httpx.post(url + "/v1/generate", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            if g.status_code != 200:  # (the replica may become ready between the two calls)
                early.append((g.status_code, time.monotonic() - t, g.headers.get("retry-after"), g.json()))
            time.sleep(0.2)
        assert len(set(phases)) >= 2, phases
        assert early, "no request was sent while the replica was loading"
        # a 503 (not a 200 once loaded) shows the request was refused, not queued behind the load
        for status, seconds, retry_after, body in early:
            assert status == 503 and retry_after == str(RETRY_AFTER_S), (status, seconds, body)
            assert "not ready" in body["error"]["message"] and body["startup"]["phase"]
        r = httpx.post(url + "/v1/generate", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        while "ready in" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log.read_text()
    assert "ready in" in text, text[-3000:]
    before, after = text.split("ready in", 1)
    assert re.match(r" \d+(\.\d+)? s", after), after[:200]  # "attnserve ready in N s"
    assert "compiling" in before and "weights loaded" in before, text[-3000:]  # phases reported before it


def test_replica_freezes_the_heap_its_models_built(tmp_path):
    """Serve freezes a replica's heap after `__init__`, before our models load behind it: the replica
    freezes again once ready, so a full collection never walks the weights' and tokenizers' objects
    (~350k of them with SmolLM2) in the middle of a request."""
    import asyncio
    import gc

    from service.deployments import AttnServe

    gen, tr = tiny_checkpoints(tmp_path)
    replica_class = AttnServe.func_or_class

    async def run():
        frozen_before = gc.get_freeze_count()
        replica = replica_class.__new__(replica_class)
        await replica.__init__(service_args(gen, tr))  # Serve awaits an async constructor the same way
        for _ in range(600):
            if replica.startup.ready or replica.startup.error:
                break
            await asyncio.sleep(0.1)
        assert replica.startup.ready, replica.startup.error
        try:
            assert gc.get_freeze_count() > frozen_before
            engine = replica.backends.generator.engine
            assert all(o is not engine for o in gc.get_objects())  # frozen objects are not listed
        finally:
            await replica.backends.generator.stop()
            await replica.backends.translator.stop()

    try:
        asyncio.run(run())
    finally:
        gc.unfreeze()


def test_startup_gate_keeps_ops_paths_open_under_a_route_prefix():
    """Under a Serve route prefix the proxy keeps the full path in the scope and puts the prefix in
    `root_path`: /readyz, /healthz and /metrics must still answer while the replica loads, and /readyz
    must say which phase it is in (not the gate's generic 503)."""
    import asyncio

    from service.api.app import create_app
    from service.api.backends import Backends

    startup = Startup()
    startup.set("loading the generator weights", "m", "loading weights")
    app = create_app(Backends(), startup=startup, api_keys=[])

    async def main():
        transport = httpx.ASGITransport(app=app, root_path="/batched")
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return [await c.get(p) for p in ("/batched/readyz", "/batched/healthz", "/batched/metrics")], \
                await c.post("/batched/v1/generate", json={"prompt": "hi"})

    (ready, health, metrics), gen = asyncio.run(main())
    assert ready.status_code == 503 and ready.json()["phase"] == "loading the generator weights", ready.text
    assert ready.headers["retry-after"] and ready.json()["models"] == {"m": "loading weights"}
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert metrics.status_code == 200
    assert gen.status_code == 503 and gen.headers["retry-after"] == str(RETRY_AFTER_S)
