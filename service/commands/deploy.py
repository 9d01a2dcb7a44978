"""`attnserve deploy`: deploy the Serve config to a running Ray cluster (e.g. `attnserve cluster up`)
wait until its applications are RUNNING, then report the replica's start-up phases until it is ready."""

from __future__ import annotations

import os
import threading
import time

from service.commands import CommandError, as_command_error
from service.startup import watch_startup


def add_arguments(p) -> None:
    from service.ray_local import DEFAULT_CONFIG

    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--address", default="auto", help="Ray address (default: the local cluster)")
    p.add_argument("--timeout", type=float, default=600.0)


def token_auth_if_available() -> None:
    """Ray sends a client's token only when it finds the cluster itself (address "auto"), not for an explicit
    --address: send it whenever this user has one (a cluster without auth accepts it too); an explicit
    RAY_AUTH_MODE wins."""
    from service.ray_local import has_auth_token

    if "RAY_AUTH_MODE" not in os.environ and has_auth_token():
        os.environ["RAY_AUTH_MODE"] = "token"


def run(args) -> int:
    from service import ray_local

    if not args.timeout > 0:  # NaN: the wait for RUNNING never timed out, the one for /readyz never began
        raise CommandError(f"--timeout must be > 0 seconds, got {args.timeout}")
    ray_local.loopback_env()
    token_auth_if_available()  # before anything imports ray, which reads RAY_AUTH_MODE once
    with as_command_error(OSError, ValueError):  # OSError: missing, unreadable, a directory
        config = ray_local.read_config(args.config)
    if not _reachable(args.address, min(args.timeout, 10.0)):
        raise CommandError(f"no Ray cluster answers at {args.address} (`attnserve cluster up` starts one)", 1)
    import ray

    try:
        ray.init(address=args.address, namespace="serve")
    except ConnectionError as e:
        raise CommandError(f"no Ray cluster to deploy to at {args.address} ({e})", 1) from e
    t0 = time.monotonic()
    try:
        ray_local.deploy(config, args.timeout)
    except (RuntimeError, TimeoutError, ray.exceptions.RayError) as e:  # e.g. Serve's proxy died starting
        raise CommandError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", 1) from e
    base = ray_local.service_url(config)
    # the replicas load their models behind /readyz: report the phases until one is ready
    if not watch_startup(base, threading.Event(), t0, timeout_s=max(args.timeout - (time.monotonic() - t0), 1)):
        raise CommandError(f"{base}/readyz not ready after {args.timeout:.0f} s (`serve status` for details)", 1)
    print(f"deployed; API at {base}/v1 (`serve status` for details)")
    return 0


def _reachable(address: str, timeout_s: float) -> bool:
    """Whether an explicit host:port (or ray://host:port) accepts a TCP connection: ray.init retries an
    unreachable address for minutes, past any --timeout. "auto" finds a local cluster or fails at once."""
    import socket

    if address in ("auto", "local"):
        return True
    address = address.removeprefix("ray://")
    host, sep, port = address.rpartition(":")
    if not sep or "]" in port or (":" in host and not host.endswith("]")):  # no port, or a bare IPv6 address
        host, port = address, "6379"
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
