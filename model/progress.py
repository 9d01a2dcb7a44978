"""Progress of long jobs, one look for the whole project: a tqdm bar on a terminal, plain lines off one.

Off a terminal, redraws would fill a log with carriage returns, so `progress(...)` returns a `PlainProgress`:
tqdm's interface, printing a line at most every `interval_s` seconds and one at the end. Progress goes to
stderr, leaving stdout to results that callers pipe. ATTNSERVE_PROGRESS=bar|lines forces either way.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from numbers import Number

from tqdm import tqdm

MODE_ENV = "ATTNSERVE_PROGRESS"  # "bar" or "lines"; unset (or anything else): by whether the stream is a tty
INTERVAL_ENV = "ATTNSERVE_PROGRESS_INTERVAL_S"
DEFAULT_INTERVAL_S = 10.0

LINE_FORMAT = "{n_fmt}/{total_fmt} ({percentage:.0f}%) {rate_fmt}, elapsed {elapsed}, ETA {remaining}{postfix}"
LINE_FORMAT_NO_TOTAL = "{n_fmt}{sep}{unit} {rate_fmt}, elapsed {elapsed}{postfix}"


def wants_bar(file=None, tty: bool | None = None) -> bool:
    """Bar or plain lines: `tty` if given, else $ATTNSERVE_PROGRESS, else whether `file` is a terminal."""
    if tty is not None:
        return tty
    mode = os.environ.get(MODE_ENV, "").strip().lower()
    if mode in ("bar", "lines"):
        return mode == "bar"
    isatty = getattr(file if file is not None else sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def line_interval_s(interval_s: float | None = None) -> float:
    if interval_s is not None:
        return interval_s
    try:
        return float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S


def progress(iterable: Iterable | None = None, *, desc: str = "", total: float | None = None, unit: str = "it",
             unit_scale: bool = False, initial: float = 0, tty: bool | None = None,
             interval_s: float | None = None, file=None, disable: bool = False):
    """A tqdm bar on a terminal, else a `PlainProgress`; both on stderr unless `file` says otherwise.
    `disable` gives tqdm's silent stand-in (iterates, ignores updates)."""
    file = file if file is not None else sys.stderr  # looked up per call: tests swap sys.stderr
    if disable:
        return tqdm(iterable, total=total, disable=True)
    if wants_bar(file, tty):
        return tqdm(iterable, desc=desc or None, total=total, unit=unit, unit_scale=unit_scale, initial=initial,
                    file=file, dynamic_ncols=True)
    return PlainProgress(iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale, initial=initial,
                         file=file, interval_s=line_interval_s(interval_s))


def write_line(text: str, file=None) -> None:
    """Print a line (to stdout by default) without tearing a bar being drawn: tqdm clears its bars first."""
    out = file if file is not None else sys.stdout
    tqdm.write(text, file=out)
    out.flush()


class PlainProgress:
    """tqdm's interface as plain lines: one at most every `interval_s` seconds (on update), one at close."""

    def __init__(self, iterable: Iterable | None = None, *, desc: str = "", total: float | None = None,
                 unit: str = "it", unit_scale: bool = False, initial: float = 0, file=None,
                 interval_s: float = DEFAULT_INTERVAL_S):
        if total is None and iterable is not None:
            with contextlib.suppress(TypeError, AttributeError):  # an iterable without a length
                total = len(iterable)  # type: ignore[arg-type]
        self.iterable, self.desc, self.total, self.unit, self.unit_scale = iterable, desc, total, unit, unit_scale
        self.n = self.initial = initial
        self.file = file if file is not None else sys.stderr
        self.interval_s = interval_s
        self.postfix = ""
        self.start_t = self.last_print_t = time.monotonic()
        self.printed_n: float | None = None
        self.closed = False

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        self.refresh()

    def set_postfix(self, ordered_dict: Mapping) -> None:
        """tqdm's text: key=value pairs, numbers in tqdm's short form."""
        self.set_postfix_str(", ".join(f"{k}={tqdm.format_num(v) if isinstance(v, Number) else str(v).strip()}"
                                       for k, v in ordered_dict.items()))

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s
        self.refresh()

    def refresh(self) -> None:
        """A line if one is due: callers that wait without updating (a subprocess) still show they live."""
        now = time.monotonic()
        if now - self.last_print_t >= self.interval_s:
            self._print(now)

    def close(self) -> None:
        """The final line, unless the last periodic line already showed where it ended."""
        if not self.closed:
            self.closed = True
            if self.printed_n != self.n:
                self._print(time.monotonic())

    def line(self, now: float) -> str:
        elapsed = now - self.start_t
        known = bool(self.total) and self.n < self.total + 0.5
        fmt = ("{desc}: " if self.desc else "") + (LINE_FORMAT if known else LINE_FORMAT_NO_TOTAL)
        text = tqdm.format_meter(self.n, self.total if known else None, elapsed, prefix=self.desc, unit=self.unit,
                                 unit_scale=self.unit_scale, initial=self.initial, postfix=self.postfix,
                                 bar_format=fmt, sep="" if self.unit_scale else " ")
        return re.sub(r"(?<=\S)  +", " ", text)  # format_meter pads the rate for bars; no use in a line

    def _print(self, now: float) -> None:
        self.last_print_t, self.printed_n = now, self.n
        print(self.line(now), file=self.file, flush=True)
