"""Per-request token sampling over a batch of logits (B, V).

Each row draws ONE uniform number from its request's own generator and samples by inverse CDF, so a
row's token depends only on its logits and its generator: a seeded request gives the same text whatever
the batch company.
"""

from __future__ import annotations

from collections import Counter

import torch

from service.engine.types import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, params: list[SamplingParams],
                             histories: list[list[int]]) -> None:
    """CTRL-style penalty in place: seen tokens' positive logits / p, negative logits * p."""
    entries = []
    for i, (p, h) in enumerate(zip(params, histories, strict=True)):
        if p.repetition_penalty != 1.0:
            entries += [(i, tok, p.repetition_penalty) for tok in set(h)]
    _update_at(logits, entries, lambda x, pen: torch.where(x > 0, x / pen, x * pen))


def _update_at(logits: torch.Tensor, entries: list[tuple[int, int, float]], update) -> None:
    """logits (N, V) in place: each (row, token, value) of `entries` (a token at most once per row) sets that
    logit to update(logit, value), over tensors of all the entries at once."""
    if entries:
        rows, cols, values = zip(*entries, strict=True)
        r, c = torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)
        logits[r, c] = update(logits[r, c], torch.tensor(values, device=logits.device, dtype=logits.dtype))


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """OpenAI's logit_bias in place: each listed token's logit plus its bias (-100 all but bans it)."""
    _update_at(logits, [(i, tok, b) for i, p in enumerate(params) for tok, b in p.logit_bias.items()], torch.add)


def apply_output_penalties(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]]) -> None:
    """OpenAI's presence and frequency penalties in place, over the tokens generated so far:
    logit - count * frequency_penalty - (count > 0) * presence_penalty."""
    entries = []
    for i, (p, out) in enumerate(zip(params, outputs, strict=True)):
        if p.presence_penalty or p.frequency_penalty:
            entries += [(i, tok, -(n * p.frequency_penalty + p.presence_penalty)) for tok, n in Counter(out).items()]
    _update_at(logits, entries, torch.add)


# Temperatures below this sample greedily (as vLLM): dividing by them overflows float32 logits to inf.
GREEDY_BELOW = 1e-5


def _filter_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """Mask (-inf) sorted (N, V) logits beyond each row's top_k (0 = off), below min_p times the top
    probability, and beyond the top_p nucleus of what is left."""
    v = sorted_logits.shape[1]
    rank = torch.arange(v, device=sorted_logits.device)[None, :]  # (1, V)
    k = torch.where(top_k > 0, top_k, v)[:, None]  # (N, 1)
    drop = rank >= k
    drop |= sorted_logits < sorted_logits[:, :1] + torch.log(min_p)[:, None]  # log 0 = -inf: off
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), -1)
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    drop |= (before >= top_p[:, None]) & (rank > 0)  # the smallest prefix reaching top_p, never empty
    return sorted_logits.masked_fill(drop, float("-inf"))


def sample_next(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None], histories: list[list[int]],
                outputs: list[list[int]] | None = None) -> list[int]:
    """logits (B, V) float32 -> one token id per row. temperature 0 (below `GREEDY_BELOW`) = greedy (argmax).
    `histories`: prompt + output per row, for the repetition penalty; `outputs`: the output so far,
    for the presence and frequency penalties (rows without them may pass []). Modifies `logits` in place."""
    if logits.shape[0] == 0:
        return []
    apply_logit_bias(logits, params)
    apply_repetition_penalty(logits, params, histories)
    if outputs is not None:
        apply_output_penalties(logits, params, outputs)
    out = logits.argmax(-1)  # (B,) greedy for every row; sampled rows overwritten below
    rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
    if not rows:
        return out.tolist()
    dev = logits.device
    sp = [params[i] for i in rows]
    temp = torch.tensor([p.temperature for p in sp], device=dev, dtype=logits.dtype)
    x = logits[rows] / temp[:, None]  # (N, V)
    # drawn on the CPU, where the per-request generators live: a seed gives the same draws on any device
    u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows]).to(dev)  # (N,)
    # top-k / top-p / min-p rows are filtered in sorted order, then drawn in vocabulary order as the
    # others are: two near-tied logits that swap ranks under another batch's rounding then move the CDF
    # by that rounding only, instead of swapping which token one u picks
    if filt := [j for j, p in enumerate(sp) if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0]:
        xs, idx = x[filt].sort(-1, descending=True)  # (F, V)
        top_k = torch.tensor([sp[j].top_k for j in filt], device=dev)
        top_p = torch.tensor([sp[j].top_p for j in filt], device=dev, dtype=logits.dtype)
        min_p = torch.tensor([sp[j].min_p for j in filt], device=dev, dtype=logits.dtype)
        x[filt] = torch.empty_like(xs).scatter_(1, idx, _filter_sorted(xs, top_k, top_p, min_p))  # (F, V)
    out[rows] = _inverse_cdf(x, u)
    return out.tolist()


def _inverse_cdf(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Logits (N, V) and one uniform number per row (N,) -> the sampled column per row (N,)."""
    cdf = torch.softmax(x, -1).cumsum(-1)  # (N, V)
    total = cdf[:, -1]
    u = torch.minimum(u.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))  # < total
    return torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=cdf.shape[1] - 1)[:, 0]


def make_generator(seed: int | None) -> torch.Generator | None:
    """A per-request (CPU) generator; None (the global RNG) when the request has no seed."""
    return None if seed is None else torch.Generator().manual_seed(int(seed))
