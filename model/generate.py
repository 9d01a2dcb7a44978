"""Offline decoding over the slot KV cache: greedy and batched beam search for the encoder-decoder.

Kept outside the model classes (as gpt-fast's generate.py): the model computes logits, this file
chooses tokens. The serving engine has its own continuous-batching scheduler; this is for the CLI,
evaluation and tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.seq2seq import EncoderDecoder


def pad_batch(seqs: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists -> ids (B, S), mask (B, S) True for real tokens."""
    s = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), s), pad_id, dtype=torch.long, device=device)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    return ids, ids != pad_id


def max_len_for(src_len: int, max_len_a: float, max_len_b: int, cap: int) -> int:
    return max(1, min(cap, int(max_len_a * src_len + max_len_b)))


@torch.inference_mode()
def greedy(model: EncoderDecoder, sources: list[list[int]], *, max_len_a: float = 1.5,
           max_len_b: int = 10) -> list[list[int]]:
    """Batched greedy decoding; returns target ids (without bos/eos) per source."""
    cfg = model.cfg
    dev = model.embed.weight.device
    b = len(sources)
    src, src_mask = pad_batch(sources, cfg.pad_id, dev)
    cache = model.new_cache(b, max_len=cfg.max_tgt_len)
    slots = torch.arange(b, device=dev)
    model.set_cross(model.encode(src, src_mask), src_mask, cache, slots)
    limits = [max_len_for(len(s), max_len_a, max_len_b, cfg.max_tgt_len - 1) for s in sources]
    tokens = torch.full((b, 1), cfg.bos_id, dtype=torch.long, device=dev)
    out: list[list[int]] = [[] for _ in range(b)]
    alive = list(range(b))
    for step in range(max(limits)):
        rows = torch.tensor(alive, device=dev)
        logits = model.decode(tokens[rows], torch.full((len(alive), 1), step, device=dev), cache, rows)
        nxt = logits[:, -1].argmax(-1).tolist()
        still = []
        for i, t in zip(alive, nxt):
            if t == cfg.eos_id or len(out[i]) >= limits[i]:
                continue
            out[i].append(t)
            tokens[i, 0] = t
            still.append(i)
        alive = still
        if not alive:
            break
    return out


@dataclass
class Hypothesis:
    tokens: list[int]
    score: float  # length-penalised log-probability
    logprob: float


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + len) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


@torch.inference_mode()
def beam_search(model: EncoderDecoder, sources: list[list[int]], *, beam_size: int = 4,
                alpha: float = 0.6, max_len_a: float = 1.5, max_len_b: int = 10,
                n_best: int | None = None) -> list[list[Hypothesis]]:
    """Batched beam search: every source's hypotheses occupy `beam_size` cache slots; after each
    step the chosen parents' slots are copied into place (KVCache.copy_slots).
    Returns, per source, hypotheses sorted by score (best first)."""
    cfg = model.cfg
    dev = model.embed.weight.device
    b, k = len(sources), beam_size
    n_best = n_best or k
    src, src_mask = pad_batch(sources, cfg.pad_id, dev)
    memory = model.encode(src, src_mask)  # (B, S, d)
    cache = model.new_cache(b * k, max_len=cfg.max_tgt_len)
    # each source's cross K/V go to all k of its slots
    model.set_cross(memory.repeat_interleave(k, 0), src_mask.repeat_interleave(k, 0), cache,
                    torch.arange(b * k, device=dev))
    limits = [max_len_for(len(s), max_len_a, max_len_b, cfg.max_tgt_len - 1) for s in sources]
    # per-source beams: tokens so far and cumulative log-probs; only beam 0 alive at the start
    seqs = [[[] for _ in range(k)] for _ in range(b)]
    scores = torch.full((b, k), float("-inf"), device=dev)
    scores[:, 0] = 0.0
    last = torch.full((b * k, 1), cfg.bos_id, dtype=torch.long, device=dev)
    finished: list[list[Hypothesis]] = [[] for _ in range(b)]
    active = list(range(b))
    for step in range(max(limits) + 1):
        slots = torch.tensor([i * k + j for i in active for j in range(k)], device=dev)
        pos = torch.full((len(slots), 1), step, dtype=torch.long, device=dev)
        logp = F.log_softmax(model.decode(last[slots], pos, cache, slots)[:, -1].float(), -1)
        v = logp.shape[-1]
        logp = logp.view(len(active), k, v)  # (A, k, V)
        cand = (scores[active].unsqueeze(-1) + logp).view(len(active), k * v)  # (A, k*V)
        top_s, top_i = cand.topk(2 * k, dim=-1)  # room for k live after removing EOS
        src_slots, dst_slots, still = [], [], []
        for a, i in enumerate(active):
            new_seqs, new_scores, new_last = [], [], []
            for s, idx in zip(top_s[a].tolist(), top_i[a].tolist()):
                parent, tok = divmod(idx, v)
                if s == float("-inf"):
                    break
                toks = seqs[i][parent]
                if tok == cfg.eos_id or step >= limits[i]:
                    if len(finished[i]) < k:
                        finished[i].append(Hypothesis(toks, s / length_penalty(len(toks) + 1, alpha), s))
                    continue
                new_seqs.append(toks + [tok])
                new_scores.append(s)
                new_last.append(tok)
                src_slots.append(i * k + parent)
                if len(new_seqs) == k:
                    break
            # done when k finished, or no live beam could beat the best finished one
            best_live = max(new_scores, default=float("-inf"))
            best_done = max((h.score for h in finished[i]), default=float("-inf"))
            bound = best_live / length_penalty(limits[i] + 1, alpha) if alpha > 0 else best_live
            if len(finished[i]) >= k or not new_seqs or best_done >= bound or step >= limits[i]:
                src_slots = src_slots[: len(src_slots) - len(new_seqs)]
                continue
            while len(new_seqs) < k:  # pad with dead beams
                new_seqs.append([])
                new_scores.append(float("-inf"))
                new_last.append(cfg.pad_id)
                src_slots.append(i * k)
            seqs[i] = new_seqs
            scores[i] = torch.tensor(new_scores, device=dev)
            dst_slots.extend(i * k + j for j in range(k))
            last[i * k: (i + 1) * k, 0] = torch.tensor(new_last, device=dev)
            still.append(i)
        if dst_slots:  # within one source's beams: same cross K/V, positions 0..step written
            cache.copy_slots(src_slots, dst_slots, length=step + 1, cross=False)
        active = still
        if not active:
            break
    results = []
    for i in range(b):
        hyps = finished[i] or [Hypothesis(seqs[i][0], float(scores[i, 0]), float(scores[i, 0]))]
        results.append(sorted(hyps, key=lambda h: h.score, reverse=True)[:n_best])
    return results
