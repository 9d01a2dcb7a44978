"""Observation points of an engine's steps, for profilers and benchmarks (no patching of the engine).

Set `engine.hooks` to a `StepHooks` subclass. `on_plan` runs on the event loop; `step_started` /
`step_finished` run on the worker thread around the step (so a torch.profiler window opened there records
the thread that computes); `phase(name)` wraps each named part of a step: "prefill forward", "decode
forward", "sampling" (with "grammar" inside it), "grammar", "slot copies" (generation); "encoder",
"decoder forward", "advance", "slot copies" (translation).
"""

from __future__ import annotations

import contextlib
from typing import Any


class StepHooks:
    """Does nothing: the default."""

    def on_plan(self, plan: Any) -> None:
        pass

    def step_started(self, plan: Any) -> None:
        pass

    def step_finished(self, plan: Any) -> None:
        pass

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()
