"""Free-slot bookkeeping: always hands out the lowest free slots, and can move a sequence to a lower
slot (`move`), so the generator keeps its running sequences in slots [0, n): the KV cache then reads
a view instead of gathering."""

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

    def move(self, src: int, dst: int) -> None:
        """Bookkeeping for a sequence moved from used slot `src` to free slot `dst`."""
        if src not in self._used or dst in self._used:
            raise RuntimeError(f"cannot move slot {src} -> {dst}")
        self._free.remove(dst)
        heapq.heapify(self._free)
        self._used.discard(src)
        self._used.add(dst)
        heapq.heappush(self._free, src)
