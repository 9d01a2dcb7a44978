"""Runs a `DecoderLM` over its slot cache for the generation engine: prompt chunks (prefill), one token
per running sequence (decode), eager or compiled (service/engine/compiled.py), the choice hidden here."""

from __future__ import annotations

import torch

from model.decoder import DecoderLM
from model.generate import pad_batch
from service.engine.compiled import CompiledDecoder, cache_slots
from service.engine.config import EngineConfig

Chunk = tuple[int, list[int], int]  # (slot, prompt tokens, position of the first)
ONE_BY_ONE_MIN_AVERAGE = 32  # tokens a chunk, on average, for more than two to go one by one


class DecoderRunner:
    def __init__(self, model: DecoderLM, config: EngineConfig):
        self.model = model.to(device=config.device, dtype=config.torch_dtype).eval()
        self.config = config
        self.device = config.device
        self.cache = model.new_cache(cache_slots(config.max_slots, config.compile), config.max_seq_len,
                                     dtype=config.kv_torch_dtype)
        self.compiled: CompiledDecoder | None = None
        # False: `compile` loads the compiled prefill where this host has it and leaves building it to the
        # caller (a replica builds it in a child once ready: service/prebuild.py)
        self.build_prefill = True

    def compile(self) -> None:
        compiled = CompiledDecoder(self.model, self.cache)
        compiled.warm_up(build_prefill=self.build_prefill)
        self.compiled = compiled

    def warm_up(self) -> None:
        """Run each kind of call once on free slots (no request reads their K/V), so that the one-time costs
        (allocations, oneDNN's set-up, first touches of the weights) miss the first request."""
        n = min(3, self.config.max_slots, self.config.max_seq_len - 2)
        if n < 1:  # slots too short for a prompt and a decode: nothing to warm
            return
        self.prefill([(0, [0, 0], 0)])  # one prompt: compiled where built
        self.prefill([(s, [0] * (s + 2), 0) for s in range(n)])  # short prompts together: one eager forward
        self.decode(list(range(n)), [0] * n, [1] * n)

    def prefill(self, chunks: list[Chunk]) -> torch.Tensor:
        """Write the chunks' K/V -> each chunk's last-position logits (len(chunks), V), in order. Chunks
        go in right-padded forwards whose padding stays within `prefill_max_padding` of their tokens."""
        out: list[torch.Tensor | None] = [None] * len(chunks)
        for group in padding_bounded_groups(list(range(len(chunks))), [len(t) for _, t, _ in chunks],
                                            self.config.prefill_max_padding):
            if self.compiled is not None and compiled_one_by_one([len(chunks[i][1]) for i in group]):
                for i in group:
                    out[i] = self.compiled.prefill(*chunks[i])  # (V,), or None: run it eagerly
                group = [i for i in group if out[i] is None]
                if not group:
                    continue
            logits = self._forward([chunks[i] for i in group], last_only=True)  # (P, V)
            for row, i in enumerate(group):
                out[i] = logits[row]
        return torch.stack(out)  # (len(chunks), V)

    def score(self, chunk: Chunk) -> torch.Tensor:
        """Write one chunk's K/V -> the logits at every one of its positions (C, V)."""
        return self._forward([chunk], last_only=False)[0]

    def _forward(self, chunks: list[Chunk], last_only: bool) -> torch.Tensor:
        dev = self.device
        tokens, _ = pad_batch([t for _, t, _ in chunks], 0)  # (P, W) right-padded
        starts = torch.tensor([start for _, _, start in chunks])  # (P,)
        # pad positions go past the chunk (clamped to the last cache row, never a real one)
        positions = (torch.arange(tokens.shape[1]) + starts[:, None]).clamp_(max=self.config.max_seq_len - 1)  # (P, W)
        slots = [slot for slot, _, _ in chunks]
        last = torch.tensor([len(t) - 1 for _, t, _ in chunks], device=dev) if last_only else None
        return self.model(tokens.to(dev), positions.to(dev), self.cache, slots, output_index=last)  # (P, [W,] V)

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token per row (`slots` ascending), its K/V written -> logits (len(slots), V)."""
        if self.compiled is not None:
            return self.compiled.decode(slots, tokens, positions)
        dev = self.device
        tokens_t = torch.tensor(tokens, device=dev)[:, None]  # (D, 1)
        positions_t = torch.tensor(positions, device=dev)[:, None]  # (D, 1)
        return self.model(tokens_t, positions_t, self.cache, slots)[:, -1]  # (D, V)


def compiled_one_by_one(lengths: list[int]) -> bool:
    """Whether a group of prompt chunks of these lengths goes through the compiled prefill one chunk at a
    time rather than in one eager forward: each compiled call streams every weight once, the eager forward
    pays Python per op once for the group, so a few chunks or long ones go one by one."""
    return len(lengths) <= 2 or sum(lengths) >= ONE_BY_ONE_MIN_AVERAGE * len(lengths)


def padding_bounded_groups(items: list, lengths: list[int], max_padding: float = 0.25) -> list[list]:
    """Split items of the given lengths into forwards whose right padding stays within `max_padding` of
    their real tokens: a 16-token prompt batched with a 256-token one would otherwise compute 240 pad
    positions through every layer. Longest first; an item joins the current group while the group's
    padded size stays within bounds."""
    groups: list[list] = []
    width = real = 0  # the current (last) group's: its first item's length, its items' total
    for item, n in sorted(zip(items, lengths, strict=True), key=lambda x: -x[1]):
        if groups and width * (len(groups[-1]) + 1) <= (1 + max_padding) * (real + n):
            groups[-1].append(item)
            real += n
        else:
            groups.append([item])
            width = real = n
    return groups
