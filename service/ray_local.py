"""Starting Ray + Serve on this machine, on loopback only, and deploying a Serve config file.

Ray's defaults listen on 0.0.0.0 and replace `_node_ip_address` with the host IP; the environment
variables below (set before `import ray`) and `http_options.host` keep everything on 127.0.0.1.
Known exception: a replica's internal gRPC server binds `[::]:0` (hard-coded in Ray 2.60's replica.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import yaml

from model.paths import REPO_ROOT

LOOPBACK = "127.0.0.1"
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_SERVE_DEFAULT_HTTP_HOST": LOOPBACK,
                "RAY_USAGE_STATS_ENABLED": "0"}
# Part of Ray Serve's own RAY_SERVE_THROUGHPUT_OPTIMIZED mode, without its topology changes (direct
# ingress, gRPC): user code and the router share the replica's / proxy's event loop instead of a
# thread hop per message (docs/decisions.md). Set before Ray starts: every Ray process reads them at import.
SERVE_TUNING_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
}
DEFAULT_CONFIG = REPO_ROOT / "deploy" / "serve_config.yaml"
METRICS_REPORT_MS = 2000  # Ray's default is 10 s: GET /metrics would lag that long
OBJECT_STORE_BYTES = 256 * 1024**2  # Ray otherwise reserves a large slice of /dev/shm
START_ATTEMPTS = 3
SYSTEM_CONFIG = {
    "metrics_report_interval_ms": METRICS_REPORT_MS,
    # idle workers for the driver's job, which Serve never uses, would start beside Serve's (docs/decisions.md)
    "prestart_worker_first_driver": False,
}


def loopback_env() -> None:
    """Set in this process before Ray starts: its GCS and raylet inherit the environment, and every worker
    the raylet's, with no wait on Ray's runtime-env agent as a job runtime_env has (docs/decisions.md)."""
    for k, v in {**LOOPBACK_ENV, **SERVE_TUNING_ENV}.items():
        os.environ.setdefault(k, v)
    # replicas must import `model` and `service` from this checkout
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])


def load_yaml(path: str | Path):
    """A Serve config file's YAML document; a missing file or bad YAML raises an error naming the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"Serve config not found: {p}")
    try:
        return yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"{p} is not valid YAML: {e}") from None


def has_auth_token() -> bool:
    """Whether this user has a Ray auth token where Ray looks for one: the environment, or the file Ray's
    `get-auth-token --generate` writes."""
    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
                or (Path.home() / ".ray" / "auth_token").is_file())


def read_config(path: str | Path, host: str | None = None, port: int | None = None) -> dict:
    """The Serve config (Ray's format) with http_options overridden by the command line."""
    p = Path(path)
    config = load_yaml(p) or {}
    if not isinstance(config, dict) or not isinstance(config.get("http_options") or {}, dict):
        raise ValueError(f"{p}: a Serve config is a mapping (applications, http_options, ...), with "
                         f"http_options a mapping too")
    http = config["http_options"] = config.get("http_options") or {}
    http["host"] = host or http.get("host") or LOOPBACK
    http["port"] = port if port is not None else http.get("port", 8000)
    if not isinstance(http["port"], int) or isinstance(http["port"], bool) or not 1 <= http["port"] <= 65535:
        raise ValueError(f"port must be in 1..65535, got {http['port']!r}")
    loopback_env()  # Ray reads its environment when imported: set ours first (deploy sets token auth first too)
    from ray.serve.schema import ServeDeploySchema

    try:  # the schema's errors before Ray starts, not after
        schema = ServeDeploySchema.model_validate(config)
    except Exception as e:  # pydantic's ValidationError
        raise ValueError(f"{p} is not a valid Serve config: {e}") from None
    if schema.proxy_location == "Disabled":  # the start-up watch would wait on it for ever
        raise ValueError(f"{p}: proxy_location Disabled starts no HTTP proxy, so nothing would serve the API")
    check_apps(config, p)  # the application's own settings too, before Ray starts
    return config


ATTNSERVE_APP = "service.deployments:build"


def attnserve_apps(config: dict, where: str | Path = "the Serve config") -> list[dict]:
    """The config's attnserve applications (ValueError if there is none: nothing would serve the API)."""
    listed = config.get("applications") or []
    if not isinstance(listed, list):
        raise ValueError(f"{where}: applications must be a list, got {type(listed).__name__}")
    apps = [a for a in listed if isinstance(a, dict) and a.get("import_path") == ATTNSERVE_APP]
    if not apps:
        raise ValueError(f"{where}: no application imports {ATTNSERVE_APP}, so nothing would serve the API")
    return apps


def check_apps(config: dict, where: str | Path) -> None:
    """The checks a replica makes of each attnserve application's args and user_config, before Ray starts."""
    from service.config import ApiLimits, ServiceConfig, limits_from_user_config

    for app in attnserve_apps(config, where):
        try:
            ServiceConfig.from_dict(app.get("args"))
            for d in app.get("deployments") or []:
                limits_from_user_config(d.get("user_config"), ApiLimits())
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: application {app.get('name')!r}: {e}") from None


def service_url(config: dict) -> str:
    """The service's URL from the config's http_options (an IPv6 literal host goes in brackets) and its attnserve
    application's route prefix ("/" adds nothing)."""
    host, port = config["http_options"]["host"], config["http_options"]["port"]
    base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return base + (attnserve_apps(config)[0].get("route_prefix") or "/").rstrip("/")


def start_ray(num_cpus: int | None = None, object_store_bytes: int = OBJECT_STORE_BYTES,
              log_to_driver: bool = True) -> None:
    """`log_to_driver`: stream the workers' logs (Serve's per-request access lines among them) to this
    process's console; they always go to Ray's log files."""
    loopback_env()
    import ray

    if ray.is_initialized():
        return
    for attempt in range(1, START_ATTEMPTS + 1):
        before = descendants(os.getpid())
        try:
            # address "local": a new instance of our own, even where RAY_ADDRESS or a running cluster could be joined
            ray.init(address="local", _node_ip_address=LOOPBACK, include_dashboard=False, num_cpus=num_cpus,
                     object_store_memory=object_store_bytes, namespace="serve", log_to_driver=log_to_driver,
                     _system_config=SYSTEM_CONFIG)
            return
        except Exception as e:
            # Ray gives its raylet a fixed 30 s to register; on two busy cores it can miss that, more than once
            # where other Ray instances boot beside it
            if "timed out during startup" not in str(e):
                raise
            if attempt == START_ATTEMPTS:  # Ray raises a bare Exception: one the caller reports in a line
                raise RuntimeError(f"Ray's node missed its start-up deadline {START_ATTEMPTS} times ({e})") from e
            print(f"attnserve: Ray's node missed its start-up deadline ({e}); starting it again", file=sys.stderr)
            ray.shutdown()
            # the failed node's processes (GCS, raylet, its workers) are not the shutdown's to stop: Ray
            # records them only once its node has started
            for pid in descendants(os.getpid()) - before:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> set[int]:
    """The processes below `pid` (children, theirs, ...)."""
    import psutil

    return {p.pid for p in psutil.Process(pid).children(recursive=True)}


def deploy(config: dict, timeout_s: float = 600.0, stop: threading.Event | None = None) -> None:
    """Start Serve with the config's http_options and deploy its applications; wait until RUNNING (or until
    `stop` is set: Ctrl-C while deploying)."""
    from ray.serve._private import api as serve_private
    from ray.serve.config import ProxyLocation
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    client = serve_private.serve_start(http_options=schema.http_options.model_dump(),
                                       proxy_location=schema.proxy_location or ProxyLocation.HeadOnly)
    client.deploy_apps(schema, _blocking=False)
    wait_running([a.name for a in schema.applications], timeout_s, stop)


def wait_running(names: list[str], timeout_s: float, stop: threading.Event | None = None) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    stop = stop or threading.Event()
    while not stop.is_set():
        apps = serve.status().applications
        states = {n: (apps[n].status if n in apps else "NOT_STARTED") for n in names}
        if all(s == "RUNNING" for s in states.values()):
            return
        if failed := {n: apps[n].message for n, s in states.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")}:
            raise RuntimeError(f"Serve application(s) failed: {failed}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve applications not RUNNING after {timeout_s:.0f} s: {states}")
        stop.wait(0.5)


def shutdown() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
