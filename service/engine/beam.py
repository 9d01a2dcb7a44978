"""Where a beam step's new hypotheses go in the translation engine's cache slots (the decoding rules
themselves are model/decoding.py's `BeamState`)."""

from __future__ import annotations


def reassign_slots(slots: list[int], parents: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Place a beam step's new hypotheses in the item's slots with as few K/V copies as possible
    -> (slot of each new hypothesis, [(src slot, dst slot)]).

    Hypothesis j continues parents[j], whose K/V sit in slots[parents[j]]. Each parent's first child stays
    in its slot; the others take the slots of hypotheses that left no child, their parent's K/V copied there
    (sorted by score, the new hypotheses are often a permutation of the old, a copy each in a slot-per-rank
    layout). Sources always keep their hypothesis, so no copy reads a slot another overwrites.
    """
    new: list[int | None] = [None] * len(parents)
    kept: set[int] = set()
    for j, p in enumerate(parents):
        if p not in kept:
            kept.add(p)
            new[j] = slots[p]
    free = iter(s for i, s in enumerate(slots) if i not in kept)
    copies = []
    for j, p in enumerate(parents):
        if new[j] is None:
            new[j] = next(free)
            copies.append((slots[p], new[j]))
    return new, copies
