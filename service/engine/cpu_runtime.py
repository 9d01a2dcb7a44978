"""CPU runtime settings the engine needs to run at speed: OpenMP thread placement and glibc malloc.

libgomp keeps a worker pool per thread that starts parallel regions, and once a second pool exists every
region pays for it. So an engine sets its thread count inside its worker thread (`init_engine_thread`) and
loaders run torch single-threaded (`single_threaded_caller`); two engines in one process with threads > 1
each bring the problem back (the Serve default gives each 1).

A step may borrow more threads (`prefill_threads`, `decode_threads`) only while no other engine on the host
has work (`BusyBoard`): a parallel region waits for its slowest thread, so a busy neighbour keeps its core.

glibc maps allocations above its mmap threshold afresh and unmaps them on free, so a step's multi-MB
activations would page-fault every time: `mallopt` raises the thresholds (off with ATTNSERVE_MALLOPT=0).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import tempfile
import weakref
from pathlib import Path

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_BYTES = 256 * 2**20  # glibc's own ceiling for its dynamic threshold is 32 MB (64-bit)
TRIM_BYTES = 512 * 2**20
BUSY_DIR = Path(os.environ.get("ATTNSERVE_BUSY_DIR", Path(tempfile.gettempdir()) / f"attnserve-busy-{os.getuid()}"))

log = logging.getLogger(__name__)


@functools.cache
def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True when they were set."""
    if os.environ.get("ATTNSERVE_MALLOPT", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    log.info("glibc mallopt: mmap threshold %d MB, trim threshold %d MB: %s", MMAP_BYTES >> 20,
             TRIM_BYTES >> 20, "set" if done else "refused")
    return done


@functools.cache
def default_threads() -> int:
    """torch's thread count as this process started (before anyone set it): the cores torch sees."""
    import torch

    return torch.get_num_threads()


def init_engine_thread(threads: int | None) -> int:
    """Run on an engine's worker thread before its first step: its torch thread count, malloc tuning."""
    import torch

    n = threads or default_threads()
    torch.set_num_threads(n)
    tune_malloc()
    return n


class BusyBoard:
    """Which engines on this host have work: a file per busy engine in one directory (BUSY_DIR), so an
    engine can tell whether another one, in this process or another replica, is stepping."""

    def __init__(self, directory: str | Path | None = None):
        self.dir = Path(directory or BUSY_DIR)
        self.path = self.dir / f"{os.getpid()}-{id(self):x}"
        self.busy = False
        weakref.finalize(self, self.path.unlink, missing_ok=True)

    def set(self, busy: bool) -> None:
        """Mark this engine busy or idle (a file created or removed on each change, not each step)."""
        if busy == self.busy:
            return
        self.busy = busy
        try:
            if busy:
                self.dir.mkdir(parents=True, exist_ok=True)
                self.path.touch()
            else:
                self.path.unlink(missing_ok=True)
        except OSError:  # a read-only or full /tmp: the board then says "nobody else is busy"
            log.debug("busy board %s unavailable", self.dir, exc_info=True)

    def others_busy(self) -> bool:
        """Whether another engine on this host has work (entries of processes that died are dropped; a
        stopped process, e.g. a training job paused with SIGSTOP, takes no core and does not count)."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return False
        for name in names:
            if name == self.path.name:
                continue
            try:
                pid = int(name.split("-")[0])
                os.kill(pid, 0)
            except ProcessLookupError:
                (self.dir / name).unlink(missing_ok=True)
                continue
            except (ValueError, PermissionError):
                return True  # not ours to judge: count it
            if not process_stopped(pid):
                return True
        return False


def process_stopped(pid: int) -> bool:
    """Whether `pid` is stopped (state T or t in /proc/PID/stat); False where /proc cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] in ("T", "t")  # the name in parentheses may hold spaces


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the body with `n` torch threads on this thread (None: unchanged), then restore the count."""
    import torch

    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def single_threaded_caller() -> None:
    """Run torch single-threaded in the calling thread from now on (e.g. before loading a model there);
    never undone: a parallel op here would create the second OpenMP pool that slows the engine thread."""
    import torch

    default_threads()
    torch.set_num_threads(1)
