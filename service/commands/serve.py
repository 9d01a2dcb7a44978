"""`attnserve serve`: start Ray and Serve locally in the foreground (loopback), deploy the Serve
config, report each start-up phase (from the replica's `/readyz`) until it is ready, print the URLs,
and shut both down cleanly on Ctrl-C / SIGTERM."""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

from model.paths import home
from service.commands import CommandError, as_command_error


def pid_file():
    return home() / "serve.pid"


def running_pid() -> int | None:
    """The recorded pid if it is a live `attnserve serve`: a pid file left by a serve that died (killed, a
    reboot) may name another process by now, this one included (a container's serve is pid 1 each run), and
    signalling pid 0 would hit our own process group."""
    import psutil

    try:
        pid = int(pid_file().read_text().strip())
        cmd = psutil.Process(pid).cmdline() if pid > 0 else []
    except (ValueError, OSError, psutil.Error):
        return None
    ours = any("attnserve" in part or part == "service.cli" for part in cmd)
    return pid if ours and "serve" in cmd and pid != os.getpid() else None


def _record_pid() -> None:
    """Write this serve's pid, refused where a live serve has one on record: `attnserve stop` ends the one the
    file names, so a second serve (another port) overwriting it would put the first beyond stop's reach.
    Under a lock: of two serves starting at once, one records and the other is refused."""
    from model.file_lock import file_lock

    with file_lock(pid_file().with_suffix(".lock")):
        if (other := running_pid()) is not None:
            raise CommandError(already_running(other))
        pid_file().write_text(str(os.getpid()))


def already_running(pid: int) -> str:
    return f"attnserve serve is already running (pid {pid}); `attnserve stop` ends it"


def add_arguments(p) -> None:
    from service.ray_local import DEFAULT_CONFIG, OBJECT_STORE_BYTES

    p.add_argument("--host", help="HTTP host (default: the config's http_options.host, else 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default: the config's http_options.port, else 8000)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="Serve config (Ray Serve's YAML format)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may schedule (default: all)")
    p.add_argument("--object-store-mb", type=int, default=OBJECT_STORE_BYTES // 2**20)
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for the deploy and for /readyz to answer 200 before giving up "
                        "(default: 600; inf: for ever)")
    p.add_argument("--access-log", action="store_true",
                   help="print the replicas' logs (one access line per request) here; by default they go "
                        "to Ray's log files only")


def run(args) -> int:
    from service import ray_local
    from service.startup import watch_startup

    if not args.ready_timeout > 0:  # NaN: never given up, as no timeout at all
        raise CommandError(f"--ready-timeout must be > 0 seconds, got {args.ready_timeout}")
    with as_command_error(OSError, ValueError):  # OSError: missing, unreadable, a directory
        config = ray_local.read_config(args.config, args.host, args.port)
    http = config["http_options"]
    if (other := running_pid()) is not None:  # named before the port it may hold (checked again, locked, below)
        raise CommandError(already_running(other))
    with as_command_error(ValueError, OSError):  # a name that does not resolve (socket.gaierror), an address not ours
        free = _port_free(http["host"], http["port"])
    if not free:
        raise CommandError(f"{http['host']}:{http['port']} is already in use (another `attnserve serve`? "
                           f"`attnserve stop` ends it); or choose --port")
    stop = threading.Event()

    def on_stop_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())

    on_stop_signals()
    t0 = time.monotonic()
    # recorded before Ray starts: `attnserve stop` must reach a serve still starting Ray or deploying
    with as_command_error(OSError):  # ATTNSERVE_HOME not writable
        _record_pid()
    print(f"[{0.0:6.1f} s] starting Ray (loopback, object store {args.object_store_mb} MB) ...", flush=True)
    try:
        ray_local.start_ray(args.num_cpus, args.object_store_mb * 2**20, log_to_driver=args.access_log)
    except BaseException as e:  # also a stop (ray.init's SIGTERM handler exits) or Ctrl-C while Ray starts
        pid_file().unlink(missing_ok=True)
        if isinstance(e, (RuntimeError, ValueError, ConnectionError)):  # Ray's refusals (resources, object store)
            raise CommandError(f"Ray did not start: {e}", 1) from e
        raise
    try:
        # ray.init's SIGTERM handler exits at once and Ray's core worker's aborts the process: take the
        # signals back before deploying, so that a stop meanwhile ends the wait for the deploy
        on_stop_signals()
        print(f"[{time.monotonic() - t0:6.1f} s] deploying {args.config} ...", flush=True)
        t_deploy = time.monotonic()
        ray_local.deploy(config, timeout_s=args.ready_timeout, stop=stop)
        on_stop_signals()  # (as above, should deploying have set them again)
        base = ray_local.service_url(config)
        # a replica loaded but not serving (a model that failed to load) answers 503 for ever: the wait ends
        left = max(args.ready_timeout - (time.monotonic() - t_deploy), 1)
        ready = watch_startup(base, stop, t0, timeout_s=left)
        if not ready and not stop.is_set():
            raise CommandError(f"not ready after {args.ready_timeout:.0f} s (--ready-timeout): {_not_ready(base)}", 1)
        if ready:  # else stopped while starting
            print(f"  API      {base}/v1  (OpenAI-compatible; native /v1/generate, /v1/translate)\n"
                  f"  docs     {base}/docs\n  metrics  {base}/metrics\n  page     {base}/\n"
                  f"Ctrl-C to stop.\nattnserve ready in {time.monotonic() - t0:.0f} s", flush=True)
            while not stop.wait(1.0):
                pass
        print("shutting down Serve and Ray ...", flush=True)
        return 0
    except TimeoutError as e:
        raise CommandError(f"{e} (--ready-timeout)", 1) from e
    except RuntimeError as e:
        raise CommandError(str(e), 1) from e
    finally:
        ray_local.shutdown()
        pid_file().unlink(missing_ok=True)


def _not_ready(base: str) -> str:
    """What `/readyz` says did not come up: the phase, and each model not ready."""
    import httpx

    try:
        body = httpx.get(base + "/readyz", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return f"no answer from {base}/readyz (the HTTP proxy did not come up)"
    models = {m: state for m, state in (body.get("models") or {}).items() if not str(state).startswith("ready")}
    waiting = "; ".join(f"{m}: {state}" for m, state in models.items())
    return f"phase {body.get('phase', '?')!r}" + (f"; not up: {waiting}" if waiting else "")


def _port_free(host: str, port: int) -> bool:
    """Whether nothing listens on host:port. Checked before Ray starts: Serve's proxy would fail to bind inside
    its actor, unseen here, and the start-up watch would then poll the other server."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections of a stopped serve in TIME_WAIT
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return True
