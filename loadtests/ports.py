"""The servers that tests and load tests start: free loopback ports for them, and stopping them."""

from __future__ import annotations

import random
import socket
import subprocess

# Below the kernel's ephemeral range (32768+ by default) and above Ray's worker ports (10002-19999): a port
# picked here cannot be taken by the ephemeral binds of Ray processes starting meanwhile, which a port picked
# by binding port 0 can (several Ray instances start at once in the test suite).
_LOW, _HIGH = 20000, 32000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, outside the ephemeral range."""
    rng = random.SystemRandom()
    high = max(_LOW + 1000, min(_HIGH, _ephemeral_low()))
    for _ in range(200):
        port = rng.randrange(_LOW, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_LOW}-{high} on 127.0.0.1")


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Terminate a server process, killing it if it has not exited after `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
