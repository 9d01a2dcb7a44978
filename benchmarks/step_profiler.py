"""A `StepHooks` (service/engine/hooks.py) for the profilers and benchmarks: wall time per named phase of
an engine step and per whole step, rows per step, and a torch.profiler window over chosen steps opened on
the worker thread (torch.profiler records the thread it starts on)."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from service.engine.hooks import StepHooks

WHOLE = "step (whole)"


class StepProfiler(StepHooks):
    def __init__(self, rows_of: Callable[[Any], int] = lambda plan: 0, profile_from: int | None = None,
                 profile_steps: int = 0):
        self.rows_of = rows_of
        self.profile_from, self.profile_steps = profile_from, profile_steps
        self.prof = None
        self.window_on = False
        self.reset()

    def reset(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.rows: list[int] = []

    def on_plan(self, plan: Any) -> None:
        self.rows.append(self.rows_of(plan))

    def step_started(self, plan: Any) -> None:
        n = len(self.rows) - 1  # this step's index
        if self.profile_from is not None:
            if n == self.profile_from and not self.window_on:
                import torch

                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.start()
                self.window_on = True
            elif n == self.profile_from + self.profile_steps and self.window_on:
                self.close()
        self._t0 = time.perf_counter()

    def step_finished(self, plan: Any) -> None:
        self.total[WHOLE] += time.perf_counter() - self._t0
        self.count[WHOLE] += 1

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.total[name] += time.perf_counter() - t0
            self.count[name] += 1

    def close(self) -> None:
        if self.window_on:
            self.prof.stop()
            self.window_on = False

    @property
    def steps(self) -> int:
        return self.count[WHOLE]

    def report(self, names: tuple[str, ...], wall: float) -> None:
        """Markdown table: each phase, the rest of the step, and the time outside steps."""
        print("\n| part of a step | total s | % of wall | calls | ms/call |\n|---|---|---|---|---|")
        whole, steps = self.total[WHOLE], self.steps
        parts = [(k, self.total[k], self.count[k]) for k in names]
        parts.append(("rest of the step (tensors in, tokens out)", whole - sum(v for _, v, _ in parts), steps))
        parts.append(("outside steps (plan, deliver, event loop)", wall - whole, steps))
        for k, v, n in parts:
            print(f"| {k} | {v:.2f} | {100 * v / wall:.1f} | {n} | {1000 * v / max(n, 1):.3f} |")

    def top_ops(self, n: int) -> str | None:
        """torch.profiler's top operators by self CPU time over the window, if it opened."""
        self.close()
        if self.prof is None:
            return None
        return self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=n)
