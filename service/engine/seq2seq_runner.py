"""Runs an `EncoderDecoder` over its slot cache for the translation engine: encoding newly admitted
sources (their cross K/V into their slots) and one decoder token per running hypothesis, eager or
compiled (service/engine/compiled.py), the choice hidden here."""

from __future__ import annotations

import torch

from model.generate import pad_batch
from model.seq2seq import EncoderDecoder
from service.engine.compiled import CompiledTranslator, cache_slots
from service.engine.config import EngineConfig
from service.engine.cpu_runtime import default_threads


class Seq2SeqRunner:
    def __init__(self, model: EncoderDecoder, config: EngineConfig):
        self.model = model.to(device=config.device, dtype=config.torch_dtype).eval()
        self.device = config.device
        self.max_tgt = min(config.max_seq_len, model.cfg.max_tgt_len)
        # one spare source position: the compiled step's views of the sources never span a whole dimension
        self.cache = model.new_cache(cache_slots(config.max_slots, config.compile), self.max_tgt,
                                     dtype=config.kv_torch_dtype, cross_len=model.cfg.max_src_len + 1)
        self.compiled: CompiledTranslator | None = None
        self._steps_key: tuple | None = None  # the packages' key: the weights never change once served

    def _compiled_translator(self) -> CompiledTranslator:
        compiled = CompiledTranslator(self.model, self.cache, self._steps_key)
        self._steps_key = compiled.key
        return compiled

    def compile(self) -> None:
        compiled = self._compiled_translator()
        compiled.warm_up()
        self.compiled = compiled

    def compiled_steps_built(self, threads: int | None) -> bool:
        """Whether `compile` has nothing to build for an engine of `threads` (None: the default): this host's
        packages exist, or the sizes are ones the compiled step cannot take (the engine then runs eagerly)."""
        try:
            return self._compiled_translator().built(threads or default_threads())
        except ValueError:
            return True

    def warm_up(self) -> None:
        """Encode and decode once on free slots (their K/V no request reads): the first call's one-time costs
        stay out of the first request's latency."""
        cfg, n = self.model.cfg, min(2, self.cache.n_slots)
        self.encode([[cfg.eos_id, cfg.eos_id]], [n], list(range(n)))
        self.decode([cfg.bos_id] * n, [0] * n, [2] * n)

    def encode(self, sources: list[list[int]], copies: list[int], slots: list[int]) -> None:
        """Encode `sources` and store their cross K/V in `slots`: source i fills the next copies[i] slots
        (a beam's hypotheses share their source)."""
        if self.compiled is not None:
            self.compiled.encode(sources, copies, slots)
            return
        src, mask = pad_batch(sources, self.model.cfg.pad_id, self.device)  # (N, S)
        memory = self.model.encode(src, mask)  # (N, S, d)
        rep = torch.tensor([i for i, c in enumerate(copies) for _ in range(c)], device=self.device)
        self.model.set_cross(memory[rep], mask[rep], self.cache, slots)

    def decode(self, tokens: list[int], positions: list[int], src_lengths: list[int]) -> torch.Tensor:
        """Rows are slots [0, R): each takes its token at its position -> logits (R, V); K/V written."""
        if self.compiled is not None:
            return self.compiled.decode(tokens, positions, src_lengths)
        tokens_t = torch.tensor(tokens, device=self.device)[:, None]  # (R, 1)
        positions_t = torch.tensor(positions, device=self.device)[:, None]  # (R, 1)
        return self.model.decode(tokens_t, positions_t, self.cache, list(range(len(tokens))))[:, -1]  # (R, V)
