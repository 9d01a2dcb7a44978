"""Free-slot bookkeeping: always hands out the lowest free slots, so a batch's slots are often
contiguous and the KV cache can read a view instead of gathering."""

from __future__ import annotations

import heapq


class SlotAllocator:
    def __init__(self, n_slots: int):
        self.n_slots = n_slots
        self._free = list(range(n_slots))  # a heap: lowest slot first
        self._used: set[int] = set()

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return len(self._used)

    def take(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} slots, {len(self._free)} free")
        got = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(got)
        return got

    def give(self, slots: list[int]) -> None:
        for s in slots:
            if s not in self._used:
                raise RuntimeError(f"slot {s} freed twice")
            self._used.discard(s)
            heapq.heappush(self._free, s)
