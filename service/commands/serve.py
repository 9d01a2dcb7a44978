"""`attnserve serve`: start Ray and Serve locally in the foreground (loopback), deploy the Serve
config, print the URLs, and shut both down cleanly on Ctrl-C / SIGTERM."""

from __future__ import annotations

import os
import signal
import threading

from model.paths import home


def pid_file():
    return home() / "serve.pid"


def add_arguments(p) -> None:
    from service.ray_local import DEFAULT_CONFIG, OBJECT_STORE_BYTES

    p.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="Serve config (Ray Serve's YAML format)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may schedule (default: all)")
    p.add_argument("--object-store-mb", type=int, default=OBJECT_STORE_BYTES // 2**20)


def run(args) -> int:
    from service import ray_local

    try:
        config = ray_local.read_config(args.config, args.host, args.port)
    except (FileNotFoundError, ValueError) as e:
        print(f"attnserve serve: {e}")
        return 2
    stop = threading.Event()

    def on_stop_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())

    on_stop_signals()
    print(f"starting Ray (loopback, object store {args.object_store_mb} MB) ...", flush=True)
    ray_local.start_ray(args.num_cpus, args.object_store_mb * 2**20)
    try:
        print(f"deploying {args.config} (loading models) ...", flush=True)
        ray_local.deploy(config)
        # Ray's core worker installs its own SIGTERM handler (it logs "SIGTERM received" and aborts the
        # process), so `attnserve stop` ended a serving terminal with "Aborted": take the signals back
        on_stop_signals()
        pid_file().parent.mkdir(parents=True, exist_ok=True)
        pid_file().write_text(str(os.getpid()))
        base = f"http://{config['http_options']['host']}:{config['http_options']['port']}"
        print(f"attnserve is up\n  API      {base}/v1  (OpenAI-compatible; native /v1/generate, /v1/translate)\n"
              f"  docs     {base}/docs\n  metrics  {base}/metrics\n  page     {base}/\n"
              "Ctrl-C to stop.", flush=True)
        while not stop.wait(1.0):
            pass
        print("shutting down Serve and Ray ...", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"attnserve serve: {e}", flush=True)
        return 1
    finally:
        ray_local.shutdown()
        pid_file().unlink(missing_ok=True)
