"""The asyncio driver shared by both engines.

One task runs the schedule: between steps (on the event loop) it cancels, times out and admits
requests; each step's forward pass, sampling and detokenization run in a single worker thread, so
the event loop stays free to accept requests and stream events while the model computes.
Subclasses implement `_has_work`, `_plan` (event loop), `_execute` (worker thread) and `_deliver`.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from service.engine.config import EngineConfig
from service.engine.cpu_runtime import init_engine_thread
from service.engine.slots import SlotAllocator
from service.engine.stats import EngineStats, MetricsSink, NullSink
from service.engine.types import EngineStopped

log = logging.getLogger(__name__)
IDLE_REPORT_S = 2.0  # an idle engine re-reports its gauges this often


class EngineLoop:
    def __init__(self, config: EngineConfig, name: str, sink: MetricsSink | None):
        self.config = config
        self.name = name
        self.sink: MetricsSink = sink or NullSink()
        self.slots = SlotAllocator(config.max_slots)
        self._pool: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._stopping = False
        self.steps = 0
        self.last_batch_size = 0
        self.requests_finished = 0
        self.compiled: Any = None  # the compiled step, once _prepare has built it

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{self.name}")
        if torch.device(self.config.device).type == "cpu":
            # torch's thread count is per OS thread: set it where the steps run (see cpu_runtime)
            self._pool.submit(init_engine_thread, self.config.threads).result()
        await asyncio.get_running_loop().run_in_executor(self._pool, self._prepare)
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-{self.name}")

    async def stop(self) -> None:
        """Finish the step in flight, then fail everything pending with EngineStopped."""
        if self._task is None:
            return
        self._stopping = True
        self._wake()
        try:
            await self._task
        finally:
            self._task = None
            self._fail_all(EngineStopped(f"engine {self.name} stopped"))
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    @property
    def started(self) -> bool:
        return self._task is not None and not self._stopping

    def _check_started(self) -> None:
        if not self.started:
            raise EngineStopped(f"engine {self.name} is not running")

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    # --- schedule ----------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            if not self._has_work():
                # idle: gauges at 0, re-reported while idle so every scrape finds them (Ray's metrics
                # agent stops exporting a worker that has reported nothing for a while)
                self.sink.on_step(self.name, 0, 0.0, 0, 0)
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), IDLE_REPORT_S)
                except TimeoutError:
                    pass
                continue
            # one turn of the event loop first: callers that the last _deliver woke (a finished request's
            # client sending its next one) submit now and are admitted by this plan, not one step later
            await asyncio.sleep(0)
            await self._before_plan()
            plan = self._plan()
            if plan is None:
                await asyncio.sleep(0)  # e.g. only cancelled requests were dropped
                continue
            try:
                result = await loop.run_in_executor(self._pool, self._execute, plan)
            except Exception as e:  # a bug or a model error: fail this step's requests, keep serving
                log.exception("engine %s step failed", self.name)
                self._fail_plan(plan, e)
                continue
            self.steps += 1
            self._deliver(result)

    def _prepare(self) -> None:
        """Run once on the worker thread before the first step: with `compile`, compile the step there
        (service/engine/compiled.py). A failure is logged and the engine runs eagerly."""
        if not self.config.compile or self.compiled is not None:
            return
        try:
            self.compiled = self._compile()
        except Exception:  # no C++ compiler, an unsupported device...: serve eagerly rather than not at all
            log.warning("engine %s: torch.compile failed; running eagerly", self.name, exc_info=True)

    def _compile(self) -> Any:
        """Build and warm up the engine's compiled step (returns an object with `compile_seconds`)."""
        raise NotImplementedError

    async def _before_plan(self) -> None:
        """Hook for policies that wait before admitting (static batching)."""

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _plan(self) -> Any:
        raise NotImplementedError

    def _execute(self, plan: Any) -> Any:
        raise NotImplementedError

    def _deliver(self, result: Any) -> None:
        raise NotImplementedError

    def _fail_plan(self, plan: Any, error: Exception) -> None:
        raise NotImplementedError

    def _fail_all(self, error: Exception) -> None:
        raise NotImplementedError

    def _stats(self, running: int, waiting: int, kv_used: int) -> EngineStats:
        total = self.config.max_slots * self.max_positions
        return EngineStats(running=running, waiting=waiting, slots_total=self.config.max_slots,
                           slots_used=self.slots.n_used, kv_usage_ratio=kv_used / total if total else 0.0,
                           steps=self.steps, last_batch_size=self.last_batch_size,
                           requests_finished=self.requests_finished)

    @property
    def max_positions(self) -> int:
        raise NotImplementedError
