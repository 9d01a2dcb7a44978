"""`attnserve stop`: stop a local `attnserve serve` (SIGTERM to the pid it recorded) and, with
`--ray`, the local Ray instance started by `ray start` / `attnserve cluster up`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from service.commands import CommandError


def add_arguments(p) -> None:
    p.add_argument("--ray", action="store_true", help="also run `ray stop` (a cluster started with ray start)")
    p.add_argument("--timeout", type=float, default=30.0)


def run(args) -> int:
    from service.commands.cluster import ray_cli
    from service.commands.serve import pid_file, running_pid

    if not args.timeout > 0:
        raise CommandError(f"--timeout must be > 0 seconds, got {args.timeout}")
    rc = 0
    f = pid_file()
    pid = running_pid()
    if pid is None:
        print("no local `attnserve serve` is running")
        f.unlink(missing_ok=True)  # a stale or unreadable record
    else:
        try:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + args.timeout
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                time.sleep(0.5)
            print(f"attnserve serve (pid {pid}) did not exit within {args.timeout:.0f} s")
            rc = 1
        except ProcessLookupError:
            print(f"stopped attnserve serve (pid {pid})")
            f.unlink(missing_ok=True)
        except PermissionError:
            print(f"attnserve stop: not allowed to signal pid {pid}", file=sys.stderr)
            rc = 1
    if args.ray:
        rc |= subprocess.call([*ray_cli(), "stop"])
    return rc
