"""Per-source decoding rules for the encoder-decoder: greedy or beam search, one step at a time.

The offline loops (model/generate.py) and the serving engine both step a `BeamState` per source through
`advance_all`, which runs the tensor work once for the whole batch and leaves each state its own choice, so
a source gets the same tokens whatever shares its batch. `no_repeat_ngram` (fairseq's) cures the
"各国各国各国…" loops of an undertrained model; `min_len` bans EOS before that many target tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    tokens: list[int]
    score: float  # length-penalised log-probability


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + len) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


def max_len_for(src_len: int, max_len_a: float, max_len_b: int, cap: int) -> int:
    """Target length limit a * source + b, within [1, cap]."""
    return max(1, min(cap, int(max_len_a * src_len + max_len_b)))


def min_len_for(src_len: int, ratio: float, limit: int) -> int:
    """Fewest target tokens before EOS: ratio x the source's pieces (its tag and end token not counted),
    at most the length limit."""
    return min(limit, int(ratio * max(src_len - 2, 0)))


def banned_tokens(seq: list[int], n: int) -> list[int]:
    """Tokens that would complete an n-gram already in `seq` (empty when n <= 0)."""
    if n <= 0 or len(seq) < n - 1:
        return []
    if n == 1:
        return list(set(seq))
    m = len(seq) - n + 1  # n-grams start at [0, m)
    prefix, out, i = seq[m:], [], 0
    while True:  # list.index scans in C: only the prefix's first token's occurrences cost Python work
        try:
            i = seq.index(prefix[0], i, m)
        except ValueError:
            return out
        if seq[i:i + n - 1] == prefix:
            out.append(seq[i + n - 1])
        i += 1


def advance_all(states: list[BeamState], logits: torch.Tensor, rows: list[list[int]]) -> list[list[int]]:
    """One step of every state: logits (R, V), rows[i] the rows of states[i]'s hypotheses -> for each state
    the parent index of each of its new hypotheses (for the slot copies; empty once it is done)."""
    out: list[list[int]] = [[] for _ in states]
    greedy = [i for i, st in enumerate(states) if st.k == 1]
    if greedy:  # one argmax for every greedy row; a float copy + argmax beats argmax over bf16
        picks = logits[[rows[i][0] for i in greedy]].float().argmax(-1).tolist()
        for i, tok in zip(greedy, picks, strict=True):
            out[i] = states[i].push(tok, logits[rows[i][0]])
    beams = [i for i, st in enumerate(states) if st.k > 1]
    if beams:
        cands = beam_candidates([states[i] for i in beams], logits, [rows[i] for i in beams])
        for i, (top_s, top_i) in zip(beams, cands, strict=True):
            out[i] = states[i].choose(top_s, top_i, logits.shape[-1])
    return out


def beam_candidates(states: list[BeamState], logits: torch.Tensor,
                    rows: list[list[int]]) -> list[tuple[list[float], list[int]]]:
    """logits (R, V), rows[i] the rows of states[i]'s hypotheses -> each state's 2k best candidates (scores,
    indices into its flattened (k, V)): room for k live ones after EOS. Batched per beam size, as per-state
    log_softmax and topk cost more than the rest of a beam step."""
    v, out = logits.shape[-1], [None] * len(states)
    for k in sorted({st.k for st in states}):
        mine = [i for i, st in enumerate(states) if st.k == k]
        logp = torch.log_softmax(logits[[r for i in mine for r in rows[i]]].float(), -1)  # (n k, V)
        bans = [(a * k + j, tok) for a, i in enumerate(mine) for j, seq in enumerate(states[i].seqs)
                for tok in states[i].banned(seq)]
        if bans:
            logp[[r for r, _ in bans], [t for _, t in bans]] = NEG_INF
        for a, i in enumerate(mine):  # at the length limit a hypothesis can only end, as fairseq forces EOS:
            st = states[i]  # else it was finished with the score of a token it does not hold, once per token
            if st.step >= st.limit:
                eos = logp[a * k:(a + 1) * k, st.eos_id].clone()
                logp[a * k:(a + 1) * k] = NEG_INF
                logp[a * k:(a + 1) * k, st.eos_id] = eos
        scores = torch.tensor([x for i in mine for x in states[i].scores], dtype=logp.dtype,
                              device=logp.device)[:, None]  # (n k, 1)
        # a source's best 2k lie among its rows' own best 2k: select per row, then per source over k x 2k
        row_s, row_tok = row_topk(logp, 2 * k)  # (n k, 2k)
        top_s, pos = (scores + row_s).view(len(mine), k * 2 * k).topk(2 * k)  # (n, 2k)
        top_i = pos.div(2 * k, rounding_mode="floor") * v + row_tok.view(len(mine), k * 2 * k).gather(1, pos)
        for i, s_, i_ in zip(mine, top_s.tolist(), top_i.tolist(), strict=True):
            out[i] = (s_, i_)
    return out


def row_topk(x: torch.Tensor, n: int, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """topk(n) of each row of x (R, V), values then indices, faster than a full-row topk: a row's n best lie
    in the n chunks with the highest maxima."""
    r, v = x.shape
    if v % chunk or v // chunk < n:
        return x.topk(n, -1)
    blocks = x.view(r, v // chunk, chunk)  # (R, V/c, c)
    best = blocks.amax(-1).topk(n, -1).indices  # (R, n) chunks holding the row's n best
    cand = blocks.gather(1, best[:, :, None].expand(-1, -1, chunk)).view(r, n * chunk)  # (R, n c)
    vals, pos = cand.topk(n, -1)  # (R, n)
    return vals, best.gather(1, pos.div(chunk, rounding_mode="floor")) * chunk + pos % chunk


@dataclass(eq=False)
class BeamState:
    src: list[int]
    k: int  # beam size (1 = greedy)
    limit: int  # max target tokens
    bos_id: int
    eos_id: int
    pad_id: int
    alpha: float = 0.6
    no_repeat_ngram: int = 0
    min_len: int = 0  # EOS is banned before this many target tokens
    step: int = 0  # target position of the next decoded token
    seqs: list[list[int]] = field(default_factory=list)  # (k) tokens so far per hypothesis
    scores: list[float] = field(default_factory=list)  # (k) cumulative log-probs, -inf = dead beam
    last: list[int] = field(default_factory=list)  # (k) token each hypothesis feeds next
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False

    def __post_init__(self):
        self.seqs = [[] for _ in range(self.k)]
        self.scores = [0.0] + [NEG_INF] * (self.k - 1)
        self.last = [self.bos_id] * self.k

    def banned(self, seq: list[int]) -> list[int]:
        """Tokens hypothesis `seq` may not take next: n-gram repeats, and EOS while it is too short."""
        out = banned_tokens(seq, self.no_repeat_ngram)
        return out + [self.eos_id] if len(seq) < self.min_len else out

    def choose(self, top_s: list[float], top_i: list[int], v: int) -> list[int]:
        """The step's 2k best candidates (scores, indices into the flattened (k, V)) -> parent index of each
        of the k new hypotheses; sets `done` when decoding has ended."""
        new_seqs, new_scores, parents = [], [], []
        for s, idx in zip(top_s, top_i, strict=True):
            parent, tok = divmod(idx, v)
            if s == NEG_INF:
                break
            toks = self.seqs[parent]
            if tok == self.eos_id or self.step >= self.limit:
                if len(self.finished) < self.k:
                    self.finished.append(Hypothesis(toks, s / length_penalty(len(toks) + 1, self.alpha)))
                continue
            new_seqs.append(toks + [tok])
            new_scores.append(s)
            parents.append(parent)
            if len(new_seqs) == self.k:
                break
        best_live = max(new_scores, default=NEG_INF)
        best_done = max((h.score for h in self.finished), default=NEG_INF)
        bound = best_live / length_penalty(self.limit + 1, self.alpha) if self.alpha > 0 else best_live
        if len(self.finished) >= self.k or not new_seqs or best_done >= bound or self.step >= self.limit:
            self.done = True
            return []
        dead = self.k - len(new_seqs)  # padding beams
        self.seqs, self.scores = new_seqs + [[] for _ in range(dead)], new_scores + [NEG_INF] * dead
        self.last = [seq[-1] if seq else self.pad_id for seq in self.seqs]  # a live hypothesis is never empty
        self.step += 1
        return parents + [0] * dead

    def push(self, tok: int, logits: torch.Tensor) -> list[int]:
        """Greedy (k == 1) step with the argmax `tok` already chosen for the whole batch; `logits` (V,)
        are read only when it is banned."""
        out = self.seqs[0]
        if self.no_repeat_ngram or self.min_len:
            banned = self.banned(out)
            if tok in banned:
                row = logits.float().clone()
                row[banned] = NEG_INF
                tok = int(row.argmax())
        if tok == self.eos_id or len(out) >= self.limit:
            self.done = True
            return []
        out.append(tok)
        self.last = [tok]
        self.step += 1
        if len(out) >= self.limit:
            self.done = True
        return [0]

    def hypotheses(self) -> list[Hypothesis]:
        """Finished hypotheses, best first (the best live one if none finished: always so greedy, k == 1)."""
        hyps = self.finished or [Hypothesis(self.seqs[0], self.scores[0])]
        return sorted(hyps, key=lambda h: h.score, reverse=True)

    def best(self) -> list[int]:
        return self.hypotheses()[0].tokens
