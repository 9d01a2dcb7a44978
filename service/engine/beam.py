"""Where a beam step's new hypotheses go in the translation engine's cache slots (the decoding rules
themselves are model/decoding.py's `BeamState`)."""

from __future__ import annotations


def reassign_slots(slots: list[int], parents: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Place a beam step's new hypotheses in the item's slots with as few K/V copies as possible.

    Hypothesis j continues hypothesis parents[j], whose K/V sit in slots[parents[j]]. The first child of
    each parent stays in its parent's slot (no copy); the other children take the slots of hypotheses
    that left no child, and their parent's K/V are copied there. Sorted by score, the new hypotheses are
    often a permutation of the old ones, which a slot-per-rank layout pays for with a copy each.
    Sources are always slots that keep their hypothesis, so the copies never read a slot they overwrite.
    -> (slot of each new hypothesis, [(src slot, dst slot)])
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

