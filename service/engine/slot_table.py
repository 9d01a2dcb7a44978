"""An engine's KV-cache slots: who holds which slot, compaction, and the K/V copies that go with them.

Slots are handed out lowest first, and `compact` moves the units holding slots >= R (R = slots held)
into the free slots below R, so a step's rows are slots [0, R) and the cache reads a view of them
instead of gathering (docs/decisions.md). The bookkeeping runs on the event loop; the K/V copies it
decides (`Move`s, forks) run on the worker thread, through `copy`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Protocol

from model.kv_cache import KVCache

Move = tuple[int, int, int]  # (src slot, dst slot, K/V positions to copy)


class HoldsSlots(Protocol):
    slots: list[int]  # the slots it holds, in its own order (a beam's hypotheses)

    @property
    def kv_len(self) -> int:
        """Positions of K/V its slots hold (copied when it moves; 0 = nothing written yet)."""


class SlotTable:
    def __init__(self, cache: KVCache, n_slots: int | None = None):
        """Hands out slots [0, n_slots) of `cache` (default: all of them); the cache may hold spares."""
        self.cache = cache
        self._free = list(range(cache.n_slots if n_slots is None else n_slots))  # a heap: lowest slot first
        self._used: set[int] = set()

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return len(self._used)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} slots, {len(self._free)} free")
        got = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(got)
        return got

    def give(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        for s in slots:
            if s not in self._used:
                raise RuntimeError(f"slot {s} freed twice")
            self._used.discard(s)
            heapq.heappush(self._free, s)
        if slots:
            self.cache.free_slots(slots)

    def compact(self, units: Iterable[HoldsSlots]) -> list[Move]:
        """Move every slot >= R of `units` (R = the slots they hold) into the free slots below R, lowest
        first; update the units' slots and return the K/V copies for the worker thread (`copy`)."""
        held = [(slot, unit, j) for unit in units for j, slot in enumerate(unit.slots)]
        r = len(held)
        holes = iter([i for i in range(r) if i not in self._used])
        moves = []
        for slot, unit, j in sorted((h for h in held if h[0] >= r), key=lambda h: h[0]):
            dst = next(holes)
            self._free[self._free.index(dst)] = slot  # dst is taken, slot is free
            heapq.heapify(self._free)
            self._used.discard(slot)
            self._used.add(dst)
            unit.slots[j] = dst
            if unit.kv_len > 0:
                moves.append((slot, dst, unit.kv_len))
        return moves

    def copy(self, moves: list[Move], *, cross: bool = True) -> None:
        """Worker thread: copy K/V for `moves` (compaction, forks of a prompt, beam reorders).
        `cross=False` keeps the destinations' cross-attention K/V (beams of one source share them)."""
        if moves:
            src, dst, n = zip(*moves, strict=True)
            self.cache.copy_slots(list(src), list(dst), length=list(n), cross=cross)
