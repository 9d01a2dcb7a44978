"""The asyncio driver shared by both engines.

Between steps, on the event loop, one task cancels, times out and admits requests; each step's forward,
sampling and detokenization run in a single worker thread, so the loop stays free to accept requests and
stream events while the model computes. Subclasses implement `_plan` (event loop), `_execute` (worker
thread), `_deliver` (event loop) and the failure paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from service.engine.config import EngineConfig
from service.engine.cpu_runtime import BusyBoard, init_engine_thread
from service.engine.hooks import StepHooks
from service.engine.scheduler import Scheduler
from service.engine.slot_table import SlotTable
from service.engine.stats import EngineStats, MetricsSink
from service.engine.types import EngineError, EngineStopped

log = logging.getLogger(__name__)
IDLE_REPORT_S = 2.0  # an idle engine re-reports its gauges this often


class EngineLoop:
    def __init__(self, config: EngineConfig, name: str, sink: MetricsSink | None, runner: Any, noun: str):
        self.config = config
        self.name = name
        self.sink: MetricsSink = sink or MetricsSink()
        self.runner = runner
        self.model = runner.model
        self.scheduler: Scheduler = Scheduler(config, SlotTable(runner.cache, config.max_slots), noun)
        self.hooks = StepHooks()
        self.busy = BusyBoard()  # this engine's entry on the host's board (service/engine/cpu_runtime.py)
        self._pool: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the engine serves on (set by start)
        self._wakeup: asyncio.Event | None = None
        self._starting: asyncio.Future | None = None  # set while start() prepares (compiles, warms up)
        self._stopped: asyncio.Future | None = None  # set while stop() runs
        self._stopping = False
        self.steps = 0
        self.last_batch_size = 0
        self.requests_finished = 0
        # start without compiling: run eagerly until `compile_deferred` (a replica's first start on a host,
        # while a child builds the packages: service/deployments.py)
        self.compile_later = False

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Prepare (compile, warm up) on the worker thread, then run the schedule. Safe to call again: a call
        during a start waits for it, one during a stop starts again once the stop is done."""
        if self._stopped is not None:
            await asyncio.shield(self._stopped)
        if self._starting is not None:
            await asyncio.shield(self._starting)
            if self._task is None:
                raise EngineStopped(f"engine {self.name} did not start")
            return
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._starting = self._loop.create_future()
        try:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{self.name}")
            if torch.device(self.config.device).type == "cpu":
                # torch's thread count is per OS thread: set it where the steps run (see cpu_runtime)
                self._pool.submit(init_engine_thread, self.config.threads).result()
            await self._loop.run_in_executor(self._pool, self._prepare)
            self._wakeup = asyncio.Event()
            self._stopping = False
            self._task = self._loop.create_task(self._run(), name=f"engine-{self.name}")
            self._task.add_done_callback(self._schedule_ended)
        except BaseException:
            if self._pool is not None:  # a start that failed leaves no worker thread behind
                self._pool.shutdown(wait=False)
                self._pool = None
            raise
        finally:
            self._starting.set_result(None)
            self._starting = None

    async def stop(self) -> None:
        """Finish the step in flight, then fail everything pending with EngineStopped."""
        if self._stopped is not None:
            await asyncio.shield(self._stopped)
            return
        self._stopped = asyncio.get_running_loop().create_future()
        try:
            if self._starting is not None:
                await asyncio.shield(self._starting)
            if self._task is None:
                return
            self._stopping = True
            self._wake()
            try:
                if not self._task.done():  # one that ended by itself was reported by _schedule_ended
                    await self._task
            finally:
                self.busy.set(False)
                self._task = None
                self._fail_all(EngineStopped(f"engine {self.name} stopped"))
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
                    self._pool = None
        finally:
            self._stopped.set_result(None)
            self._stopped = None

    @property
    def compiled(self) -> Any:
        """The runner's compiled step (with `compile_seconds`), None when running eagerly."""
        return self.runner.compiled

    @property
    def started(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping

    def _schedule_ended(self, task: asyncio.Task) -> None:
        """The schedule ended without stop() (cancelled, or a BaseException past _run's handler): nothing would
        serve what is queued. Fail it; `started` is False now, so the health check has the replica restarted."""
        if self._stopping:
            return
        error = None if task.cancelled() else task.exception()
        log.error("engine %s: its schedule ended (%s)", self.name, "cancelled" if error is None else repr(error))
        self.busy.set(False)
        self._fail_all(EngineError(f"engine {self.name} stopped unexpectedly"))

    def _check_started(self) -> None:
        if not self.started:
            raise EngineStopped(f"engine {self.name} is not running")

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _queued(self) -> None:
        """New work was queued: mark this engine busy on the host's board now, not at its loop's next turn,
        so a neighbour starting a step in the same millisecond (a burst spread over replicas) does not
        borrow this engine's core; then wake the loop."""
        self.busy.set(True)
        self._wake()

    # --- schedule ----------------------------------------------------------------------------
    async def _run(self) -> None:
        finished = self.requests_finished
        while not self._stopping:
            try:
                if not self.scheduler.has_work:
                    await self._idle()
                    continue
                self.busy.set(True)
                if self.requests_finished != finished:
                    # one turn of the event loop first, so that a client the last _deliver finished is admitted
                    # by this plan with its next request; else plan at once: the streams' work then overlaps the step
                    finished = self.requests_finished
                    await asyncio.sleep(0)
                await self._turn()
            except Exception as e:  # a bug outside the step (planning, delivery, a hook, a metrics sink):
                # without this the task would end and every request, current or later, would wait forever
                log.exception("engine %s failed between steps", self.name)
                self._fail_all(EngineError(f"engine {self.name} error: {type(e).__name__}: {e}"))
                # a fault that repeats must not spin the event loop (nor fill the log while idle)
                await asyncio.sleep(0.01 if self.scheduler.has_work else 1.0)

    async def _idle(self) -> None:
        self.busy.set(False)
        # gauges at 0, re-reported while idle so every scrape finds them (Ray's metrics agent stops
        # exporting a worker that has reported nothing for a while)
        self.sink.on_step(self.name, 0, 0.0, 0, 0)
        self._wakeup.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), IDLE_REPORT_S)

    async def _turn(self) -> None:
        await self.scheduler.wait_for_batch()
        plan = self._plan()
        if plan is None:
            await asyncio.sleep(0)  # e.g. only cancelled requests were dropped
            return
        sched = self.scheduler
        self.sink.on_step(self.name, self.last_batch_size, self._kv_usage(), len(sched.running), sched.n_waiting)
        self.hooks.on_plan(plan)
        try:
            result = await self._loop.run_in_executor(self._pool, self._step, plan)
        except Exception as e:  # a bug or a model error: fail this step's requests, keep serving
            log.exception("engine %s step failed", self.name)
            self._fail_plan(plan, EngineError(f"engine {self.name} step failed: {type(e).__name__}: {e}"))
        else:
            self.steps += 1
            self._deliver(result)
        sched.drop_released()  # forget the work whose slots either released

    def _step(self, plan: Any) -> Any:
        try:
            self.hooks.step_started(plan)
            try:
                return self._execute(plan)
            finally:
                self.hooks.step_finished(plan)
        except StopIteration as e:  # asyncio cannot pass it through a future: the step would never end
            raise RuntimeError(f"step raised StopIteration: {e}") from e

    def _prepare(self) -> None:
        """Worker thread, before the first step: compile, then warm up so the first request does not pay the
        one-time costs."""
        if not self.compile_later:
            self._compile()
        try:
            self.runner.warm_up()
        except Exception:  # only a cost moved off the first request: serve without it
            log.warning("engine %s: warm-up call failed", self.name, exc_info=True)

    async def compile_deferred(self) -> None:
        """Compile (or load) the step now, on the worker thread between two steps, for an engine started
        with `compile_later`; until it returns, steps run eagerly."""
        self._check_started()
        self.compile_later = False
        await self._loop.run_in_executor(self._pool, self._compile)

    def _compile(self) -> None:
        if not self.config.compile or self.runner.compiled is not None:
            return
        if torch.device(self.config.device).type != "cpu":
            # the compiled steps are built for CPUs (AOTInductor packages, oneDNN-prepacked linears, our C++
            # kernels); on a GPU inductor's build of them hung or crashed (docs/performance.md)
            log.warning("engine %s: compile is for CPU engines; running eagerly on %s", self.name, self.config.device)
            return
        try:
            self.runner.compile()
        except Exception:  # no C++ compiler, an unsupported device...: serve eagerly rather than not at all
            log.warning("engine %s: compiling its steps failed; running eagerly", self.name, exc_info=True)

    def _plan(self) -> Any:
        """The next step's work, its `last_batch_size` set; None when nothing runs."""
        raise NotImplementedError

    def _execute(self, plan: Any) -> Any:
        raise NotImplementedError

    def _deliver(self, result: Any) -> None:
        """Hand out the step's results, releasing the slots of the work that ended."""
        raise NotImplementedError

    def _fail_plan(self, plan: Any, error: EngineError) -> None:
        """Fail the work a failed step touched, releasing its slots."""
        raise NotImplementedError

    def _fail_unit(self, unit: Any, reason: str, error: Exception) -> None:
        """End the request of `unit` (its slots released) for `reason` ("error": `error` raised to its caller),
        counted once however many of its units end."""
        raise NotImplementedError

    def _fail_all(self, error: Exception) -> None:
        """Fail every pending request with `error`, each counted once ("error", or "cancelled" if its client
        left), so a stop or a fault leaves none out of the finished counts."""
        now = time.monotonic()
        for unit in self.scheduler.clear():
            try:
                self._fail_unit(unit, "cancelled" if unit.expired(now) == "cancelled" else "error", error)
            except Exception:  # a sink that raises must not leave the other requests waiting forever
                log.exception("engine %s: failing a request raised", self.name)

    def _limit_s(self, deadline_s: float | None) -> float | None:
        """A request's time limit: its own, else the engine's default (None: none)."""
        return deadline_s if deadline_s is not None else self.config.default_deadline_s

    def _deadline(self, deadline_s: float | None, now: float) -> float | None:
        """When a request submitted at `now` times out."""
        limit = self._limit_s(deadline_s)
        return now + limit if limit is not None else None

    def _kv_used(self) -> int:
        """Cache positions the running work holds."""
        raise NotImplementedError

    def _kv_usage(self) -> float:
        total = self.config.max_slots * self.max_positions
        return self._kv_used() / total if total else 0.0

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.scheduler.running), waiting=self.scheduler.n_waiting,
                           slots_used=self.scheduler.table.n_used, steps=self.steps,
                           requests_finished=self.requests_finished)

    @property
    def max_positions(self) -> int:
        raise NotImplementedError
