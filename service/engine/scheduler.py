"""The one scheduler of both engines: which work runs in the next step.

Work comes in groups that are admitted together or not at all (a generation request's n choices; a
sentence to translate, whose beam holds k slots). Between steps, on the event loop, `sweep` drops
cancelled and timed-out work and frees its slots, `admit` moves waiting groups into free slots by the
engine's mode, and `compact` packs the running work into the lowest slots (`SlotTable`). Modes:
`continuous` admits whenever slots are free; `static` admits a new batch only when the last one is done
and waits `static_batch_wait_s` for it to fill (Ray Serve's @serve.batch); `serial` runs one group at a
time.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, Literal, Protocol, TypeVar

from service.engine.config import EngineConfig
from service.engine.slot_table import HoldsSlots, Move, SlotTable
from service.engine.types import EngineOverloaded

Expiry = Literal["cancelled", "timeout"]


class Work(HoldsSlots, Protocol):
    @property
    def slots_needed(self) -> int:
        """Slots it takes when admitted."""

    def expired(self, now: float) -> Expiry | None:
        """Why it must stop now, if it must."""


W = TypeVar("W", bound=Work)


class Scheduler(Generic[W]):
    def __init__(self, config: EngineConfig, table: SlotTable, noun: str):
        self.config = config
        self.table = table
        self.noun = noun  # what a waiting group is, for the overload message ("requests", "sentences")
        self.waiting: deque[list[W]] = deque()  # groups, admitted whole, first come first served
        self.running: list[W] = []  # in admission order

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def check_room(self, needs: list[int]) -> None:
        """A new request's groups need `needs` slots each: EngineOverloaded (HTTP 429) unless the next `admit`
        can take them all, or fewer than `max_waiting` groups wait beyond what it can take. Requests arriving
        together at an idle engine wait only for its next plan and are not refused. A request is queued
        whole, so the queue may pass the bound by one request (a translation of many sentences, bounded by
        the API's text limits): a request is never refused for its size alone while fewer groups wait."""
        # what the next admit takes, by mode: static and serial admit only once the running batch is done
        cap = 0 if self.config.mode != "continuous" and self.running else 1 if self.config.mode == "serial" else None
        free, beyond = self.table.n_free, 0
        for group in self.waiting:
            need = sum(u.slots_needed for u in group)
            if beyond or cap == 0 or need > free:
                beyond += 1
            else:
                free -= need
                cap = None if cap is None else cap - 1
        if not beyond and sum(needs) <= free and (cap is None or len(needs) <= cap):
            return
        if beyond >= self.config.max_waiting:
            raise EngineOverloaded(f"{beyond} {self.noun} waiting for a slot (max_waiting="
                                   f"{self.config.max_waiting}); retry later", retry_after=1.0)

    def add(self, groups: list[list[W]]) -> None:
        """Queue one request's groups, all or none (`check_room` first)."""
        self.check_room([sum(u.slots_needed for u in g) for g in groups])
        self.waiting.extend(groups)

    async def wait_for_batch(self) -> None:
        """Static mode: give a new batch a moment to fill before it is admitted."""
        if (self.config.mode == "static" and not self.running
                and 0 < len(self.waiting) < self.config.max_slots):
            await asyncio.sleep(self.config.static_batch_wait_s)

    def sweep(self, now: float) -> list[tuple[W, Expiry]]:
        """Drop expired work, running (slots freed) and waiting (a group goes whole) -> [(unit, why)]."""
        gone: list[tuple[W, Expiry]] = []
        keep = []
        for unit in self.running:
            why = unit.expired(now)
            if why is None:
                keep.append(unit)
            else:
                self.release(unit)
                gone.append((unit, why))
        self.running = keep
        waiting = deque()
        for group in self.waiting:
            why = next((w for w in (u.expired(now) for u in group) if w is not None), None)
            if why is None:
                waiting.append(group)
            else:
                gone += [(u, why) for u in group]
        self.waiting = waiting
        return gone

    def admit(self) -> list[W]:
        """Admit waiting groups in order while their slots fit (by mode) -> the admitted units."""
        mode = self.config.mode
        if mode != "continuous" and self.running:
            return []  # static / serial: a new batch only when the last one has finished
        cap = 1 if mode == "serial" else len(self.waiting)
        admitted: list[W] = []
        while cap and self.waiting and sum(u.slots_needed for u in self.waiting[0]) <= self.table.n_free:
            for unit in self.waiting.popleft():
                unit.slots = self.table.take(unit.slots_needed)
                admitted.append(unit)
            cap -= 1
        self.running += admitted
        return admitted

    def compact(self) -> list[Move]:
        return self.table.compact(self.running)

    def release(self, unit: W) -> None:
        if unit.slots:
            self.table.give(unit.slots)
            unit.slots = []

    def drop_released(self) -> None:
        """Forget running units whose slots were released (finished)."""
        self.running = [u for u in self.running if u.slots]

    def clear(self) -> list[W]:
        """Release and return every unit, running and waiting (the engine is failing them all)."""
        units = self.running + [u for g in self.waiting for u in g]
        for unit in self.running:
            self.release(unit)
        self.running, self.waiting = [], deque()
        return units
