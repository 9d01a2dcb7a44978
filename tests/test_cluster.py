"""A real two-node Ray cluster on 127.0.0.1 (`attnserve cluster up`: head + worker `ray start`), the tiny
service deployed with `serve deploy` (2 replicas, at most one per node), HEALTHY in `serve status`,
answered over HTTP, replicas on both nodes, and `attnserve cluster down` leaving no process behind.

Everything runs in subprocesses on ports of its own, so it coexists with the in-process Serve fixture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from api_util import metric
from serve_fixture import tiny_checkpoints

from loadtests.ports import free_port
from loadtests.reliability.tiny_service import TinyServiceConfig, serve_config
from service.commands.cluster import cluster_processes

pytestmark = pytest.mark.cluster
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=ROOT, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_AUTH_MODE="token",
               RAY_USAGE_STATS_ENABLED="0")
    return env


def _run(*cmd: str, timeout: float = 120) -> str:
    r = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}: {r.stdout[-2000:]}{r.stderr[-2000:]}"
    return r.stdout


def test_two_node_cluster(tmp_path):
    gcs, dash, client, http = (free_port() for _ in range(4))
    ports = [f"--port={gcs}", f"--dashboard-port={dash}", f"--client-port={client}"]
    gen, tr = tiny_checkpoints(tmp_path)
    config = serve_config(TinyServiceConfig(num_replicas=2, replica_cpus=0.5), gen, tr, http)
    config["applications"][0]["deployments"][0]["max_replicas_per_node"] = 1
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    dashboard = f"http://127.0.0.1:{dash}"
    cli = [sys.executable, "-m", "service.cli", "cluster"]
    try:
        _run(*cli, "up", *ports, timeout=180)
        _run(f"{BIN}/serve", "deploy", "--address", dashboard, str(tmp_path / "serve.yaml"))
        deadline = time.monotonic() + 240
        while True:
            status = yaml.safe_load(_run(f"{BIN}/serve", "status", "--address", dashboard))
            app = status["applications"].get("attnserve", {})
            if app.get("status") == "RUNNING":
                break
            assert app.get("status") != "DEPLOY_FAILED", status
            assert time.monotonic() < deadline, f"not RUNNING: {status}"
            time.sleep(2)
        assert app["deployments"]["AttnServe"]["status"] == "HEALTHY"
        assert app["deployments"]["AttnServe"]["replica_states"] == {"RUNNING": 2}

        with httpx.Client(base_url=f"http://127.0.0.1:{http}", timeout=60) as c:
            deadline = time.monotonic() + 120  # each replica loads its models behind /readyz (503 meanwhile)
            while sum(c.get("/readyz").status_code == 200 for _ in range(8)) < 8:
                assert time.monotonic() < deadline, c.get("/readyz").text
                time.sleep(1)
            for _ in range(4):
                r = c.post("/v1/generate", json={"prompt": "hello world", "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4, r.text
                r = c.post("/v1/translate", json={"text": "hello world", "beam_size": 2, "max_length": 4})
                assert r.status_code == 200 and r.json()["target_langs"] == ["zh"], r.text
            # GET /metrics combines both replicas' series from both nodes' Ray metrics exports (~2 s lag)
            deadline, generated = time.monotonic() + 60, 0.0
            while generated < 4 and time.monotonic() < deadline:
                time.sleep(1)
                generated = metric(c.get("/metrics").text, "attnserve_http_requests_total",
                                   route="/v1/generate", status="200")
            assert generated == 4

        nodes = json.loads(_run(f"{BIN}/ray", "list", "nodes", "--address", dashboard, "--format", "json",
                                "--filter", "state=ALIVE"))
        actors = json.loads(_run(f"{BIN}/ray", "list", "actors", "--address", dashboard, "--format", "json",
                                 "--filter", "class_name=ServeReplica:attnserve:AttnServe", "--filter", "state=ALIVE"))
        assert len(nodes) == 2
        assert {a["node_id"] for a in actors} == {n["node_id"] for n in nodes}
    finally:
        _run(*cli, "down", f"--port={gcs}", timeout=60)
    assert cluster_processes(gcs) == []


def test_fresh_machine_gets_an_auth_token(tmp_path, monkeypatch):
    """`ray start --head` with token auth fails without ~/.ray/auth_token (a clean machine has none)."""
    from service.commands.cluster import ensure_auth_token

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    path = ensure_auth_token()
    assert path == tmp_path / ".ray" / "auth_token" and len(path.read_text().strip()) >= 32
    first = path.read_text()
    assert ensure_auth_token() is None and path.read_text() == first  # kept, not regenerated
