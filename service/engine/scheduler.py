"""The one scheduler of both engines: which work runs in the next step (on the event loop, between steps).

Work comes in groups admitted together or not at all (a request's n choices; a sentence's k beams). Waiting
requests take turns, one group each, so a translation of many sentences shares the slots with the requests
after it. Modes: `continuous` admits whenever slots are free; `static` admits a new batch only once the last
is done, after `static_batch_wait_s` for it to fill (like @serve.batch); `serial` runs one group at a time.
"""

from __future__ import annotations

import asyncio
from collections import deque
from itertools import zip_longest
from typing import Literal, Protocol

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


class Scheduler:
    def __init__(self, config: EngineConfig, table: SlotTable, noun: str):
        self.config = config
        self.table = table
        self.noun = noun  # what a waiting group is, for the overload message ("requests", "sentences")
        # per waiting request its groups in order (each admitted whole); the head request's turn is next
        self.waiting: deque[deque[list[Work]]] = deque()
        self.running: list[Work] = []  # in admission order

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def n_waiting(self) -> int:
        """Groups waiting for slots."""
        return sum(len(q) for q in self.waiting)

    def _admit_cap(self) -> int | None:
        """Groups the next `admit` may take (None: any): static and serial admit only once the running batch
        is done, serial one group at a time."""
        if self.config.mode != "continuous" and self.running:
            return 0
        return 1 if self.config.mode == "serial" else None

    def check_room(self, needs: list[int]) -> None:
        """EngineOverloaded (429) unless the next `admit` takes all of a new request's groups (`needs` slots
        each) or fewer than `max_waiting` groups wait beyond it. A request is queued whole, so the queue may
        pass the bound by one request: none is refused for its size alone."""
        # idle: even with max_waiting 0, a request of more groups than slots runs in turns (refused, its retries
        # would be refused forever); a group that can never fit still is
        if not self.running and not any(self.waiting) and all(n <= self.config.max_slots for n in needs):
            return
        cap, free, beyond = self._admit_cap(), self.table.n_free, 0
        # the waiting groups in the order `admit` takes them: requests in turn, one group each
        for group in (g for turn in zip_longest(*self.waiting) for g in turn if g is not None):
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
                                   f"{self.config.max_waiting}); retry later")

    def add(self, groups: list[list[Work]], check: bool = True) -> None:
        """Queue one request's groups, all or none (`check_room` first, unless the caller has checked)."""
        if check:
            self.check_room([sum(u.slots_needed for u in g) for g in groups])
        if groups:
            self.waiting.append(deque(groups))

    async def wait_for_batch(self) -> None:
        """Static mode: give a new batch a moment to fill before it is admitted."""
        waiting_slots = sum(u.slots_needed for q in self.waiting for g in q for u in g)  # beams take k each
        if self.config.mode == "static" and not self.running and 0 < waiting_slots < self.config.max_slots:
            await asyncio.sleep(self.config.static_batch_wait_s)

    def sweep(self, now: float) -> list[tuple[Work, Expiry]]:
        """Drop expired work, running (slots freed) and waiting (a group goes whole) -> [(unit, why)]."""
        gone = [(unit, why) for unit in self.running if (why := unit.expired(now)) is not None]
        for unit, _ in gone:
            self.release(unit)
        self.drop_released()
        for queue in self.waiting:
            for _ in range(len(queue)):  # one turn round the queue: the groups kept stay in order
                group = queue.popleft()
                if why := next(filter(None, (u.expired(now) for u in group)), None):
                    gone += [(u, why) for u in group]
                else:
                    queue.append(group)
        self.waiting = deque(q for q in self.waiting if q)
        return gone

    def admit(self) -> list[Work]:
        """Admit waiting groups in turn while the next one's slots fit (by mode) -> the admitted units."""
        cap = self._admit_cap()
        admitted: list[Work] = []
        while cap != 0 and self.waiting and sum(u.slots_needed for u in self.waiting[0][0]) <= self.table.n_free:
            queue = self.waiting.popleft()
            for unit in queue.popleft():
                unit.slots = self.table.take(unit.slots_needed)
                admitted.append(unit)
            if queue:  # its next group waits behind the other requests' turns
                self.waiting.append(queue)
            cap = None if cap is None else cap - 1
        self.running += admitted
        return admitted

    def compact(self) -> list[Move]:
        return self.table.compact(self.running)

    def release(self, unit: Work) -> None:
        if unit.slots:
            self.table.give(unit.slots)
            unit.slots = []

    def drop_released(self) -> None:
        """Forget running units whose slots were released (finished)."""
        self.running = [u for u in self.running if u.slots]

    def clear(self) -> list[Work]:
        """Release and return every unit, running and waiting (the engine is failing them all)."""
        units = self.running + [u for q in self.waiting for g in q for u in g]
        for unit in self.running:
            self.release(unit)
        self.running, self.waiting = [], deque()
        return units
