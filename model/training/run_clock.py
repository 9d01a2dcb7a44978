"""The hours a training run has trained, for its logs, its hour limit and the BLEU-vs-hours plots.

Wall time, less the long gaps in which the process barely ran: stopped (SIGSTOP while a benchmark has the
cores), its host suspended, or starved by other work at a lower priority. Those hours bought no training.
"""

from __future__ import annotations

import time
from collections.abc import Callable

STALL_SECONDS = 60.0  # a gap shorter than this always counts (a slow step, an in-training evaluation)
STALL_CPU_SHARE = 0.1  # ...a longer one only where the process used at least this share of one core


class RunClock:
    def __init__(self, seconds: float = 0.0, wall: Callable[[], float] = time.time,
                 cpu: Callable[[], float] = time.process_time):
        self.seconds = seconds  # trained so far, across resumes
        self._wall, self._cpu = wall, cpu
        self._t, self._c = wall(), cpu()

    def tick(self) -> float:
        """Count the time since the last tick -> the seconds left out as stalled (0.0 when none)."""
        t, c = self._wall(), self._cpu()
        dt, dc = t - self._t, c - self._c
        self._t, self._c = t, c
        if dt > STALL_SECONDS and dc < STALL_CPU_SHARE * dt:
            return dt
        self.seconds += dt
        return 0.0
