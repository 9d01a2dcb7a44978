"""`attnserve cluster up|down`: a real two-node Ray cluster on loopback — a head and a worker, each a
separate `ray start` process (separate raylets, object stores and node ids) on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys

HEAD_PORT = 6380


def add_arguments(p) -> None:
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--head-cpus", type=int, default=1)
    p.add_argument("--worker-cpus", type=int, default=1)
    p.add_argument("--object-store-mb", type=int, default=256)
    p.add_argument("--port", type=int, default=HEAD_PORT)


def _ray() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


def commands(args) -> list[list[str]]:
    store = str(args.object_store_mb * 2**20)
    common = ["--node-ip-address=127.0.0.1", f"--object-store-memory={store}", "--disable-usage-stats"]
    head = [_ray(), "start", "--head", f"--port={args.port}", f"--num-cpus={args.head_cpus}",
            "--include-dashboard=false", "--dashboard-host=127.0.0.1", *common]
    worker = [_ray(), "start", f"--address=127.0.0.1:{args.port}", f"--num-cpus={args.worker_cpus}",
              "--resources={\"worker_node\": 1}", *common]
    return [head, worker]


def run(args) -> int:
    from service.ray_local import loopback_env

    loopback_env()
    if args.action == "down":
        return subprocess.call([_ray(), "stop", "--force"])
    for cmd in commands(args):
        rc = subprocess.call(cmd)
        if rc:
            print(f"attnserve cluster up: `{' '.join(cmd)}` failed ({rc}); run `attnserve cluster down`")
            return rc
    print(f"cluster up: head + worker on 127.0.0.1:{args.port}; `attnserve deploy` (or `serve deploy "
          f"deploy/serve_config.yaml`), `serve status`, `attnserve cluster down`")
    return 0
