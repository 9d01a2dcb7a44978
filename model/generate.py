"""Offline decoding over the slot KV cache: greedy and batched beam search for the encoder-decoder.

The model computes logits, model/decoding.py's rules choose tokens, as the serving engine does inside its
continuous batch; this static loop serves training-time evaluation and tests.
"""

from __future__ import annotations

import torch

from model.decoding import BeamState, Hypothesis, advance_all, max_len_for, min_len_for
from model.seq2seq import EncoderDecoder
from model.translation import DEFAULT_LENGTH_PENALTY, DEFAULT_MIN_LENGTH_RATIO, DEFAULT_NO_REPEAT_NGRAM


def pad_batch(seqs: list[list[int]], pad_id: int, device=None, width: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists (to `width`, default the longest) -> ids (B, S), mask (B, S) True for real tokens."""
    s = width or max(len(x) for x in seqs)
    ids = torch.full((len(seqs), s), pad_id, dtype=torch.long, device=device)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.long)
    return ids, ids != pad_id


@torch.inference_mode()
def beam_search(model: EncoderDecoder, sources: list[list[int]], *, beam_size: int = 4,
                alpha: float = DEFAULT_LENGTH_PENALTY, max_len_a: float = 1.5, max_len_b: int = 10,
                no_repeat_ngram: int = DEFAULT_NO_REPEAT_NGRAM,
                min_length_ratio: float = DEFAULT_MIN_LENGTH_RATIO) -> list[list[Hypothesis]]:
    """Batched beam search (greedy when beam_size is 1) -> per source, hypotheses best first. Each source
    owns `beam_size` cache slots; after each step the chosen parents' slots are copied into place."""
    cfg = model.cfg
    dev = model.embed.weight.device
    b, k = len(sources), beam_size
    src, src_mask = pad_batch(sources, cfg.pad_id, dev)
    memory = model.encode(src, src_mask)  # (B, S, d)
    cache = model.new_cache(b * k, max_len=cfg.max_tgt_len)
    # each source's cross K/V go to all k of its slots
    model.set_cross(memory.repeat_interleave(k, 0), src_mask.repeat_interleave(k, 0), cache,
                    torch.arange(b * k, device=dev))
    limits = [max_len_for(len(s), max_len_a, max_len_b, cfg.max_tgt_len - 1) for s in sources]
    beams = [BeamState(s, k, limit, cfg.bos_id, cfg.eos_id, cfg.pad_id, alpha=alpha, no_repeat_ngram=no_repeat_ngram,
                       min_len=min_len_for(len(s), min_length_ratio, limit))
             for s, limit in zip(sources, limits, strict=True)]
    step = 0
    while active := [i for i in range(b) if not beams[i].done]:
        slots = [i * k + j for i in active for j in range(k)]
        last = torch.tensor([[t] for i in active for t in beams[i].last], device=dev)  # (A*k, 1)
        pos = torch.full((len(slots), 1), step, dtype=torch.long, device=dev)
        logits = model.decode(last, pos, cache, slots)[:, -1]  # (A*k, V)
        src_slots, dst_slots = [], []
        rows = [list(range(a * k, (a + 1) * k)) for a in range(len(active))]  # (A*k) logits rows, source by source
        steps = advance_all([beams[i] for i in active], logits, rows)
        for i, parents in zip(active, steps, strict=True):
            src_slots += [i * k + p for p in parents]
            dst_slots += [i * k + j for j in range(len(parents))]
        if dst_slots and k > 1:  # within one source's beams: same cross K/V, positions 0..step written
            cache.copy_slots(src_slots, dst_slots, length=step + 1, cross=False)
        step += 1
    return [beam.hypotheses()[:k] for beam in beams]


def greedy(model: EncoderDecoder, sources: list[list[int]], *, max_len_a: float = 1.5, max_len_b: int = 10,
           no_repeat_ngram: int = DEFAULT_NO_REPEAT_NGRAM,
           min_length_ratio: float = DEFAULT_MIN_LENGTH_RATIO) -> list[list[int]]:
    """Batched greedy decoding; returns target ids (without bos/eos) per source."""
    hyps = beam_search(model, sources, beam_size=1, max_len_a=max_len_a, max_len_b=max_len_b,
                       no_repeat_ngram=no_repeat_ngram, min_length_ratio=min_length_ratio)
    return [h[0].tokens for h in hyps]
