"""`attnserve cluster up|down`: a real two-node Ray cluster on loopback — a head and a worker, each a
separate `ray start` process (separate raylets, object stores and node ids) on 127.0.0.1.

The head runs Ray's dashboard on 127.0.0.1 (`serve deploy`, `serve status` and `ray list` talk to
it). `down` stops only this cluster's processes (those tied to its GCS port, and their children), so
another Ray instance on the machine (e.g. one started by `attnserve serve`) keeps running.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from service.ray_local import METRICS_REPORT_MS, has_auth_token

HEAD_PORT = 6380
DASHBOARD_PORT = 8265
CLIENT_PORT = 10001


def add_arguments(p) -> None:
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--head-cpus", type=int, default=1)
    p.add_argument("--worker-cpus", type=int, default=1)
    p.add_argument("--object-store-mb", type=int, default=256)
    p.add_argument("--port", type=int, default=HEAD_PORT, help="GCS port of the head (identifies the cluster)")
    p.add_argument("--dashboard-port", type=int, default=DASHBOARD_PORT)
    p.add_argument("--client-port", type=int, default=CLIENT_PORT, help="Ray client server port on the head")


def ray_cli() -> list[str]:
    """The `ray` command of this environment (beside its python), not whichever is on PATH."""
    return [os.path.join(os.path.dirname(sys.executable), "ray")]


def commands(args) -> list[list[str]]:
    store = str(args.object_store_mb * 2**20)
    common = ["--node-ip-address=127.0.0.1", f"--object-store-memory={store}", "--disable-usage-stats"]
    head = [*ray_cli(), "start", "--head", f"--port={args.port}", f"--num-cpus={args.head_cpus}",
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={args.dashboard_port}",
            f"--ray-client-server-port={args.client_port}",
            f"--system-config={json.dumps({'metrics_report_interval_ms': METRICS_REPORT_MS})}", *common]
    worker = [*ray_cli(), "start", f"--address=127.0.0.1:{args.port}", f"--num-cpus={args.worker_cpus}",
              "--resources={\"worker_node\": 1}", *common]
    return [head, worker]


def ensure_auth_token() -> Path | None:
    """With RAY_AUTH_MODE=token, `ray start --head` refuses to start without a token, and a fresh machine
    has none: generate one with Ray's own CLI (saved to ~/.ray/auth_token, readable by this user only
    in practice: the home folder). Returns the new token's path, or None when one was already set up."""
    if os.environ.get("RAY_AUTH_MODE") != "token" or has_auth_token():
        return None
    subprocess.run([*ray_cli(), "get-auth-token", "--generate"], check=True, capture_output=True, text=True)
    return Path.home() / ".ray" / "auth_token"


def cluster_processes(port: int) -> list:
    """This cluster's Ray processes: those naming its GCS address or port, with all their children."""
    import psutil

    mark = re.compile(rf"(gcs[-_]address|--address)=\S*:{port}\b|--gcs[-_]server[-_]port={port}\b")
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            line = " ".join(p.info["cmdline"] or [])
            if p.pid != os.getpid() and mark.search(line):
                for q in [p, *p.children(recursive=True)]:
                    found[q.pid] = q
    return list(found.values())


def down(port: int, timeout_s: float = 15.0) -> int:
    import psutil

    procs = cluster_processes(port)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    # `ray start --head` records its address here; a later bare `ray.init()` would join it (`ray stop` clears it)
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    with contextlib.suppress(OSError):
        if current.read_text().strip().endswith(f":{port}"):
            current.unlink()
    print(f"cluster down: stopped {len(procs)} process(es) of the cluster on 127.0.0.1:{port}")
    return 0


def run(args) -> int:
    from service.ray_local import loopback_env

    loopback_env()
    # loopback_env's 0 makes `ray start --address` refuse to join (Ray's multi-node guard), and a head started with 0
    # requires an auth token a joining node lacks: a real cluster needs 1. Ray then binds some agent ports on the host
    # address / 0.0.0.0 despite --node-ip-address=127.0.0.1 (Ray's own behaviour for multi-node; firewall them).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
    # a head auto-enables token auth when ~/.ray/auth_token exists; a worker joins only if told (clients: set it too)
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if args.action == "down":
        return down(args.port)
    token = ensure_auth_token()
    if token is not None:
        print(f"attnserve cluster up: generated a Ray auth token at {token} (clients of this cluster need it)")
    for cmd in commands(args):
        if rc := subprocess.call(cmd):
            print(f"attnserve cluster up: `{' '.join(cmd)}` failed ({rc}); run `attnserve cluster down`")
            return rc
    print(f"cluster up: head + worker on 127.0.0.1:{args.port}; `attnserve deploy --address 127.0.0.1:{args.port}` "
          f"(or `serve deploy --address http://127.0.0.1:{args.dashboard_port} deploy/serve_config.yaml`), "
          f"`serve status --address http://127.0.0.1:{args.dashboard_port}`, "
          f"`attnserve cluster down --port {args.port}`")
    return 0
