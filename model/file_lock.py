"""A cross-process lock on a file: replicas starting side by side do a cacheable job (convert weights,
build a compiled step) once; the others wait for it and then load the result."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive `flock` on `path` (created if missing) for the block; released if the process dies.
    Yields whether it is held: without `wait`, False at once where another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        held = False
        with contextlib.suppress(BlockingIOError):  # without `wait`: another process holds it
            fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = True
        try:
            yield held
        finally:
            if held:
                fcntl.flock(f, fcntl.LOCK_UN)
