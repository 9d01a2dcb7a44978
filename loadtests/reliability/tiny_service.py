"""A throwaway Ray Serve deployment of the real service on random tiny checkpoints, on 127.0.0.1,
for the reliability scripts; plus the probes they share (replica PIDs, RSS, Prometheus samples).

Tiny models keep the scripts light on a shared 2-core machine: what is measured is the service's
behaviour (shedding, cancellation, restarts), not model speed. It refuses to run when another Ray
instance is up on this machine, so it never attaches to (and shuts down) someone else's cluster; with
ATTNSERVE_ALLOW_OTHER_RAY=1 it starts a separate local instance beside it instead (RAY_ADDRESS=local: never
attaches), e.g. in the test suite, whose own Serve instance is up. The probes below only see processes of
this process's own Ray instance (its descendants), never another instance's replicas.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from loadtests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


@dataclass
class TinyServiceConfig:
    num_replicas: int = 1
    max_slots: int = 4  # engine KV slots per replica
    max_waiting: int = 8  # engine queue per replica: beyond it, 429 + Retry-After
    max_ongoing_requests: int = 16  # Serve: requests a replica accepts at once
    max_queued_requests: int = 16  # Serve: requests queued in the proxy beyond that (-1 = unbounded)
    retry_after_s: float = 1.0  # Serve's backpressure answer: 429 + Retry-After (Ray's default: 503, no header)
    replica_cpus: float = 0.5
    env: dict[str, str] = field(default_factory=dict)  # extra environment for Ray's workers



ALLOW_OTHER_RAY = "ATTNSERVE_ALLOW_OTHER_RAY"


def allow_other_ray() -> bool:
    return os.environ.get(ALLOW_OTHER_RAY) == "1"


def other_ray_running() -> bool:
    me = os.getpid()
    for p in psutil.process_iter(["name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if p.pid != me and (p.info["name"] in ("raylet", "gcs_server")
                                or "raylet" in " ".join(p.info["cmdline"] or [])[:200]):
                return True
    return False


def serve_config(cfg: TinyServiceConfig, gen_dir: Path, tr_dir: Path, port: int) -> dict:
    from serve_fixture import service_args

    args = service_args(gen_dir, tr_dir)
    args["generator"]["engine"].update(max_slots=cfg.max_slots, max_waiting=cfg.max_waiting)
    deployment = {"name": "AttnServe", "num_replicas": cfg.num_replicas,
                  "max_ongoing_requests": cfg.max_ongoing_requests, "max_queued_requests": cfg.max_queued_requests,
                  "backpressure_config": {"status_code": 429, "retry_after_s": cfg.retry_after_s},
                  "ray_actor_options": {"num_cpus": cfg.replica_cpus}, "health_check_period_s": 2,
                  "health_check_timeout_s": 10}
    return {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "attnserve", "route_prefix": "/", "import_path": "service.deployments:build",
                              "args": args, "deployments": [deployment]}]}


@contextlib.contextmanager
def tiny_service(cfg: TinyServiceConfig, deploy_timeout_s: float = 240.0):
    """Start Ray + Serve with the tiny app; yield its base URL; shut everything down on exit."""
    if other_ray_running():
        if not allow_other_ray():
            raise SystemExit(f"another Ray instance is running on this machine; not touching it ({ALLOW_OTHER_RAY}=1 "
                             "starts a separate one beside it)")
        os.environ["RAY_ADDRESS"] = "local"  # ray.init starts a new instance, never joins the other one
    from serve_fixture import tiny_checkpoints

    from service import ray_local

    os.environ.update(cfg.env)
    with tempfile.TemporaryDirectory(prefix="attnserve-rel-") as tmp:
        gen, tr = tiny_checkpoints(Path(tmp))
        port = free_port()
        ray_local.start_ray(num_cpus=2)
        try:
            ray_local.deploy(serve_config(cfg, gen, tr, port), timeout_s=deploy_timeout_s)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while httpx.get(url + "/readyz", timeout=10).status_code != 200:
                if time.monotonic() > deadline:
                    raise TimeoutError("service never became ready")
                time.sleep(0.5)
            yield url
        finally:
            ray_local.shutdown()


def own_processes() -> list[psutil.Process]:
    """This process's descendants: `tiny_service` starts Ray in this process, so its GCS, raylet and every
    worker (replicas too, restarted ones included) are among them; another Ray instance's processes are not."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process().children(recursive=True)
    return []


def replica_pids() -> list[int]:
    """PIDs of this Ray instance's live AttnServe replicas (Ray titles them `ray::ServeReplica:<app>:AttnServe`;
    the state API would need the dashboard, which `ray_local` leaves off)."""
    out = []
    for p in own_processes():
        with contextlib.suppress(psutil.Error):
            line = " ".join(p.cmdline())
            if line.startswith("ray::ServeReplica") and "AttnServe" in line:
                out.append(p.pid)
    return out


def serve_pids() -> list[int]:
    """Every Ray process of this session (replicas, proxy, controller, raylet, GCS)."""
    out = []
    for p in own_processes():
        with contextlib.suppress(psutil.Error):
            line = " ".join(p.cmdline())[:300]
            if p.name() in ("raylet", "gcs_server") or line.startswith("ray::") or "ray/_private" in line:
                out.append(p.pid)
    return out


def ray_logs_dir() -> Path:
    """This process's Ray session logs (/tmp/ray/session_latest is the newest session on the machine, which
    may be another instance's)."""
    import ray

    if ray.is_initialized():
        return Path(ray._private.worker._global_node.get_logs_dir_path())
    return Path(tempfile.gettempdir()) / "ray" / "session_latest" / "logs"


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total / 2**20


def scrape(url: str, name: str, headers: dict | None = None, **labels) -> float:
    """Sum of the Prometheus samples `name` (with `labels`) on the service's GET /metrics."""
    from api_util import metric

    return metric(httpx.get(url + "/metrics", timeout=10, headers=headers).text, name, **labels)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def report(result: dict, out: Path | None) -> None:
    """Print a script's result as JSON and, with --out, write it to a file too."""
    import json

    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
