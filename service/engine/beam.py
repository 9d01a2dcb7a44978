"""Per-source decoding state for the translation engine: greedy or beam search, one step at a time.

The step rules are those of model/generate.py's offline `greedy` and `beam_search` (2k candidates,
EOS or the length limit finishes a hypothesis, GNMT length penalty, early stop when no live beam can
beat the best finished one), applied to one source whose k hypotheses occupy k cache slots, so the
engine's output equals the offline output whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.generate import Hypothesis, length_penalty


@dataclass(eq=False)
class BeamState:
    src: list[int]
    k: int  # beam size (1 = greedy)
    limit: int  # max target tokens
    bos_id: int
    eos_id: int
    pad_id: int
    alpha: float = 0.6
    step: int = 0  # target position of the next decoded token
    seqs: list[list[int]] = field(default_factory=list)  # (k) tokens so far per hypothesis
    scores: list[float] = field(default_factory=list)  # (k) cumulative log-probs, -inf = dead beam
    last: list[int] = field(default_factory=list)  # (k) token each hypothesis feeds next
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False

    def __post_init__(self):
        self.seqs = [[] for _ in range(self.k)]
        self.scores = [0.0] + [float("-inf")] * (self.k - 1)
        self.last = [self.bos_id] * self.k

    def advance(self, logits: torch.Tensor) -> list[int]:
        """logits (k, V) for this step -> parent index of each of the k new hypotheses (for the slot
        copy); sets `done` when decoding has ended."""
        if self.k == 1:
            return self._greedy(logits)
        logp = torch.log_softmax(logits.float(), -1)  # (k, V)
        v = logp.shape[-1]
        cand = (torch.tensor(self.scores, dtype=logp.dtype)[:, None] + logp).view(-1)  # (k*V,)
        top_s, top_i = cand.topk(2 * self.k)  # room for k live after removing EOS
        new_seqs, new_scores, new_last, parents = [], [], [], []
        for s, idx in zip(top_s.tolist(), top_i.tolist(), strict=True):
            parent, tok = divmod(idx, v)
            if s == float("-inf"):
                break
            toks = self.seqs[parent]
            if tok == self.eos_id or self.step >= self.limit:
                if len(self.finished) < self.k:
                    self.finished.append(Hypothesis(toks, s / length_penalty(len(toks) + 1, self.alpha), s))
                continue
            new_seqs.append(toks + [tok])
            new_scores.append(s)
            new_last.append(tok)
            parents.append(parent)
            if len(new_seqs) == self.k:
                break
        best_live = max(new_scores, default=float("-inf"))
        best_done = max((h.score for h in self.finished), default=float("-inf"))
        bound = best_live / length_penalty(self.limit + 1, self.alpha) if self.alpha > 0 else best_live
        if len(self.finished) >= self.k or not new_seqs or best_done >= bound or self.step >= self.limit:
            self.done = True
            return []
        while len(new_seqs) < self.k:  # pad with dead beams
            new_seqs.append([])
            new_scores.append(float("-inf"))
            new_last.append(self.pad_id)
            parents.append(0)
        self.seqs, self.scores, self.last = new_seqs, new_scores, new_last
        self.step += 1
        return parents

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        return self.push(int(logits[0].argmax()))

    def push(self, tok: int) -> list[int]:
        """Greedy (k == 1) step with the argmax token already chosen (the engine takes the argmax of
        every greedy row in one op); same result as `advance`."""
        out = self.seqs[0]
        if tok == self.eos_id or len(out) >= self.limit:
            self.done = True
            return []
        out.append(tok)
        self.last = [tok]
        self.step += 1
        if len(out) >= self.limit:
            self.done = True
        return [0]

    def best(self) -> list[int]:
        """Best target tokens once done."""
        if self.k == 1:
            return self.seqs[0]
        hyps = self.finished or [Hypothesis(self.seqs[0], self.scores[0], self.scores[0])]
        return sorted(hyps, key=lambda h: h.score, reverse=True)[0].tokens

    @property
    def generated(self) -> int:
        return len(self.best()) if self.done else max(len(s) for s in self.seqs)


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

