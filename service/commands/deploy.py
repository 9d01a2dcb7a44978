"""`attnserve deploy`: deploy the Serve config to a running Ray cluster (e.g. `attnserve cluster up`)
and wait until its applications are RUNNING."""

from __future__ import annotations


def add_arguments(p) -> None:
    from service.ray_local import DEFAULT_CONFIG

    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--address", default="auto", help="Ray address (default: the local cluster)")
    p.add_argument("--timeout", type=float, default=600.0)


def run(args) -> int:
    from service import ray_local

    ray_local.loopback_env()
    import ray

    config = ray_local.read_config(args.config)
    ray.init(address=args.address, namespace="serve")
    try:
        ray_local.deploy(config, args.timeout)
    except (RuntimeError, TimeoutError) as e:
        print(f"attnserve deploy: {e}")
        return 1
    h = config["http_options"]
    print(f"deployed; API at http://{h['host']}:{h['port']}/v1 (`serve status` for details)")
    return 0
