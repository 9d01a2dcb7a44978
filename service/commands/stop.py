"""`attnserve stop`: stop a local `attnserve serve` (SIGTERM to the pid it recorded) and, with
`--ray`, the local Ray instance started by `ray start` / `attnserve cluster up`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def add_arguments(p) -> None:
    p.add_argument("--ray", action="store_true", help="also run `ray stop` (a cluster started with ray start)")
    p.add_argument("--timeout", type=float, default=30.0)


def run(args) -> int:
    from service.commands.serve import pid_file

    rc = 0
    f = pid_file()
    if f.is_file():
        pid = int(f.read_text().strip() or 0)
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
    else:
        print("no local `attnserve serve` is running")
    if args.ray:
        rc |= subprocess.call([os.path.join(os.path.dirname(sys.executable), "ray"), "stop"])
    return rc
