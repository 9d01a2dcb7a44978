"""Log-probabilities of sampled and prompt tokens, for the requests that ask.

Values are the model's own distribution (log_softmax of the raw logits, before penalties, logit
bias and temperature), as vLLM reports by default, so they equal a full forward of the model. Only
the rows that asked pay the log_softmax over the vocabulary.
"""

from __future__ import annotations

import torch

from service.engine.types import TokenLogprob

FLOOR = -9999.0  # JSON has no -inf; vLLM reports this floor too


def sampled_logprobs(raw: torch.Tensor, chosen: list[int], ks: list[int]) -> list[TokenLogprob]:
    """raw (R, V) float32 logits of the rows that asked, chosen: the token each row sampled, ks: alternatives
    wanted per row."""
    if not chosen:
        return []
    lp = torch.log_softmax(raw, -1)  # (R, V)
    picked = lp.gather(1, torch.tensor(chosen, device=raw.device)[:, None])[:, 0].clamp(min=FLOOR).tolist()  # (R,)
    top = lp.topk(min(max(ks, default=0), lp.shape[1]), -1)  # (R, k) values and ids; k may be 0
    top_v, top_i = top.values.clamp(min=FLOOR).tolist(), top.indices.tolist()
    return [TokenLogprob(int(t), p, list(zip(ids[:kr], vals[:kr], strict=True)))
            for t, p, ids, vals, kr in zip(chosen, picked, top_i, top_v, ks, strict=True)]


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
    """logits (C, V) of a prompt chunk's positions; targets: the token after each position (C or C - 1:
    the last position of a prompt predicts the first output token, not a prompt token)."""
    return sampled_logprobs(logits[: len(targets)].float(), targets, [k] * len(targets))
