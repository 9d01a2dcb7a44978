"""The scheduler's admission bound: `max_waiting` counts the groups waiting beyond the free slots, so a burst
at an idle engine is queued for its next plan, not refused, and 429 comes only once the queue is full."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from service.engine.config import EngineConfig
from service.engine.scheduler import Scheduler
from service.engine.slot_table import SlotTable
from service.engine.types import EngineOverloaded


class _Cache:  # the slot table's view of a cache: its size, and slots to forget
    def __init__(self, n: int):
        self.n_slots = n

    def free_slots(self, slots) -> None:
        pass


@dataclass
class Unit:
    slots_needed: int = 1
    slots: list[int] = field(default_factory=list)
    kv_len: int = 0
    why: str | None = None  # what `expired` says

    def expired(self, now: float):
        return self.why


def scheduler(slots: int, max_waiting: int, mode: str = "continuous") -> Scheduler:
    return Scheduler(EngineConfig(max_slots=slots, max_waiting=max_waiting, mode=mode), SlotTable(_Cache(slots)),
                     "requests")


def test_a_burst_at_an_idle_engine_fills_the_free_slots_then_the_queue():
    s = scheduler(slots=4, max_waiting=2)
    for _ in range(6):  # 4 for the free slots, 2 waiting beyond them
        s.add([[Unit()]])
    with pytest.raises(EngineOverloaded, match="2 requests waiting for a slot"):
        s.add([[Unit()]])
    assert len(s.admit()) == 4
    with pytest.raises(EngineOverloaded):  # still 2 waiting, no slot free
        s.add([[Unit()]])


def test_max_waiting_zero_means_no_queue_beyond_the_slots():
    s = scheduler(slots=2, max_waiting=0)
    s.add([[Unit()]])
    s.add([[Unit()]])
    with pytest.raises(EngineOverloaded):
        s.add([[Unit()]])
    with pytest.raises(EngineOverloaded):  # a group bigger than the free slots waits: refused too
        scheduler(slots=2, max_waiting=0).add([[Unit(slots_needed=3)]])


def test_a_request_is_queued_whole_while_the_queue_has_room():
    s = scheduler(slots=2, max_waiting=1)
    s.add([[Unit()] for _ in range(5)])  # 2 fit, 3 wait: past the bound by one request, not refused
    with pytest.raises(EngineOverloaded, match="3 requests"):
        s.add([[Unit()]])


@pytest.mark.parametrize("mode", ["static", "serial"])
def test_batched_modes_count_what_their_next_admit_takes(mode):
    s = scheduler(slots=4, max_waiting=1, mode=mode)
    s.add([[Unit()]])
    s.admit()  # a batch runs: nothing is admitted until it is done, so new requests wait whatever is free
    s.add([[Unit()]])
    with pytest.raises(EngineOverloaded):
        s.add([[Unit()]])


def test_sweep_drops_expired_waiting_groups_whole_and_keeps_the_rest_in_order():
    s = scheduler(slots=1, max_waiting=10)
    s.add([[Unit()]])
    s.admit()  # the one slot is taken: the rest wait
    a = [[Unit()], [Unit(why="timeout"), Unit()], [Unit()]]
    b = [[Unit(why="cancelled")]]
    c = [[Unit()], [Unit()]]
    for groups in (a, b, c):
        s.add(groups)
    gone = s.sweep(0.0)
    assert [(id(u), why) for u, why in gone] == [(id(a[1][0]), "timeout"), (id(a[1][1]), "timeout"),
                                                (id(b[0][0]), "cancelled")]
    assert [[[id(u) for u in g] for g in q] for q in s.waiting] == [[[id(u) for u in g] for g in q] for q in
                                                                    ([a[0], a[2]], c)]


def test_static_mode_waits_only_while_the_batch_has_slots_left(monkeypatch):
    """A batch fills slots, not requests: a beam-4 sentence on 4 slots waited static_batch_wait_s for company
    that had no room."""
    import asyncio

    import service.engine.scheduler as scheduler_module

    waits = []

    async def sleep(s):
        waits.append(s)

    monkeypatch.setattr(scheduler_module.asyncio, "sleep", sleep)
    full, part = scheduler(slots=4, max_waiting=4, mode="static"), scheduler(slots=4, max_waiting=4, mode="static")
    full.add([[Unit(), Unit(), Unit(), Unit()]])  # one group of 4 beams
    part.add([[Unit(), Unit()]])
    asyncio.run(full.wait_for_batch())
    assert waits == []
    asyncio.run(part.wait_for_batch())
    assert waits == [part.config.static_batch_wait_s]
