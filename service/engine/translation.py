"""Continuous-batching translation engine for the encoder-decoder (greedy and beam search).

Every text of a request is an item that batches independently; a beam-search item's k hypotheses
occupy k cache slots and are reordered with `KVCache.copy_slots` after each step. Each step, in the
worker thread: one batched encoder pass over the newly admitted sources (their cross-attention K/V
go into their slots), then ONE decoder forward over every running hypothesis. Results are put back
in request order when all of a request's items are done.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from model.decoding import BeamState, max_len_for
from model.generate import pad_batch
from model.punctuation import postprocess
from model.seq2seq import EncoderDecoder
from model.translation import TAGS, detect_lang, encode_source, join_sentences, other, split_sentences
from service.config import TRANSLATOR_ID
from service.engine.beam import reassign_slots
from service.engine.compiled import CompiledTranslator
from service.engine.config import EngineConfig
from service.engine.loop import EngineLoop
from service.engine.stats import EngineStats, MetricsSink
from service.engine.types import (
    EngineOverloaded,
    RequestRejected,
    TranslateRequest,
    TranslationResult,
    Usage,
)


@dataclass(eq=False)
class _Job:
    req: TranslateRequest
    future: asyncio.Future
    outputs: list[list[str | None]]  # per text: its sentences' translations
    source_langs: list[str]
    target_langs: list[str]
    t_submit: float
    deadline: float | None
    usage: Usage = field(default_factory=Usage)
    left: int = 0  # items not finished
    cancelled: bool = False


@dataclass(eq=False)
class _Item:
    job: _Job
    index: int  # position of the text in the request
    part: int  # position of the sentence in the text
    beam: BeamState
    slots: list[int] = field(default_factory=list)
    encoded: bool = False


@dataclass(eq=False)
class _Step:
    items: list[_Item]  # every running item; its hypotheses' slots are exactly 0..R-1
    moves: list[tuple[int, int, int]]  # compaction copies (src slot, dst slot, positions), applied first


class TranslationEngine(EngineLoop):
    def __init__(self, model: EncoderDecoder, tokenizer, config: EngineConfig, *,
                 name: str = TRANSLATOR_ID, sink: MetricsSink | None = None):
        super().__init__(config, name, sink)
        self.model = model.to(device=config.device, dtype=config.torch_dtype).eval()
        self.tokenizer = tokenizer
        self.cfg = model.cfg
        self.max_tgt = min(config.max_seq_len, self.cfg.max_tgt_len)
        self.cache = model.new_cache(config.max_slots, self.max_tgt, dtype=config.kv_torch_dtype)
        self.waiting: deque[_Item] = deque()
        self.running: list[_Item] = []

    def _compile(self) -> CompiledTranslator:
        compiled = CompiledTranslator(self.model, self.cache)
        compiled.warm_up()
        return compiled

    @property
    def max_positions(self) -> int:
        return self.max_tgt

    def stats(self) -> EngineStats:
        used = sum(it.beam.k * (it.beam.step + 1) for it in self.running)
        return self._stats(len(self.running), len(self.waiting), used)

    # --- submit ------------------------------------------------------------------------------
    def _items(self, req: TranslateRequest, job: _Job) -> list[_Item]:
        if not req.texts:
            raise RequestRejected("texts is empty")
        if not 1 <= req.beam_size <= self.config.max_slots:
            raise RequestRejected(f"beam_size must be in [1, {self.config.max_slots}], got {req.beam_size}")
        if req.target_lang is not None and req.target_lang not in TAGS:
            raise RequestRejected(f"target_lang must be one of {sorted(TAGS)}, got {req.target_lang!r}")
        if req.max_length is not None and not 1 <= req.max_length <= self.max_tgt - 1:
            raise RequestRejected(f"max_length must be in [1, {self.max_tgt - 1}], got {req.max_length}")
        items = []
        for i, text in enumerate(req.texts):
            src_lang = detect_lang(text)
            tgt = req.target_lang or other(src_lang)
            job.source_langs.append(src_lang)
            job.target_langs.append(tgt)
            if not text.strip():
                job.outputs.append([""])
                continue
            sentences = split_sentences(text)
            job.outputs.append([None] * len(sentences))
            for j, sentence in enumerate(sentences):
                src = encode_source(self.tokenizer, sentence, tgt)
                if len(src) > self.cfg.max_src_len:
                    raise RequestRejected(f"text {i} has a sentence of {len(src) - 2} tokens; the translator takes "
                                          f"at most {self.cfg.max_src_len - 2} tokens per sentence")
                limit = req.max_length or max_len_for(len(src), 1.5, 10, self.max_tgt - 1)
                beam = BeamState(src, req.beam_size, limit, self.cfg.bos_id, self.cfg.eos_id, self.cfg.pad_id,
                                 alpha=req.length_penalty, no_repeat_ngram=req.no_repeat_ngram)
                items.append(_Item(job, i, j, beam))
                job.usage.prompt_tokens += len(src)
        return items

    async def translate(self, req: TranslateRequest) -> TranslationResult:
        """Translate every text of the request (RequestRejected / EngineOverloaded / EngineStopped are
        raised before any work). Cancelling the awaiting task frees the request's slots."""
        self._check_started()
        now = time.monotonic()
        limit = req.deadline_s if req.deadline_s is not None else self.config.default_deadline_s
        job = _Job(req, asyncio.get_running_loop().create_future(), [], [], [], now,
                   now + limit if limit is not None else None)
        items = self._items(req, job)
        if items and len(self.waiting) + len(items) > self.config.max_waiting:
            raise EngineOverloaded(f"{len(self.waiting)} texts waiting (max_waiting={self.config.max_waiting}); "
                                   f"retry later", retry_after=1.0)
        job.left = len(items)
        if not items:
            return self._result(job)
        self.waiting.extend(items)
        self._wake()
        try:
            return await job.future
        finally:
            job.cancelled = True  # no-op once the result is set; frees the slots if we were cancelled
            self._wake()

    def _result(self, job: _Job) -> TranslationResult:
        texts = [join_sentences(parts, lang) for parts, lang in zip(job.outputs, job.target_langs)]
        return TranslationResult(translations=texts, source_langs=job.source_langs,
                                 target_langs=job.target_langs, usage=job.usage)

    # --- schedule (event loop) -----------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self.running or self.waiting)

    async def _before_plan(self) -> None:
        if self.config.mode == "static" and not self.running and 0 < len(self.waiting) < self.config.max_slots:
            await asyncio.sleep(self.config.static_batch_wait_s)

    def _gone(self, job: _Job, now: float) -> bool:
        if job.cancelled or job.future.done():
            return True
        if job.deadline is not None and now > job.deadline:
            job.future.set_exception(TimeoutError(f"translation exceeded its deadline of "
                                                  f"{job.req.deadline_s or self.config.default_deadline_s} s"))
            self.sink.on_finish(self.name, "timeout", job.usage.prompt_tokens, job.usage.completion_tokens,
                                now - job.t_submit)
            return True
        return False

    def _plan(self) -> _Step | None:
        now = time.monotonic()
        keep = []
        for it in self.running:
            if self._gone(it.job, now):
                self._release(it)
            else:
                keep.append(it)
        self.running = keep
        if any(self._gone(it.job, now) for it in self.waiting):
            self.waiting = deque(it for it in self.waiting if not self._gone(it.job, now))
        mode = self.config.mode
        if mode == "continuous" or not self.running:
            cap = 1 if mode == "serial" else len(self.waiting)
            while self.waiting and cap and self.waiting[0].beam.k <= self.slots.n_free:  # FIFO
                it = self.waiting.popleft()
                it.slots = self.slots.take(it.beam.k)
                self.running.append(it)
                cap -= 1
        if not self.running:
            return None
        self.last_batch_size = sum(it.beam.k for it in self.running)
        used = sum(it.beam.k * (it.beam.step + 1) for it in self.running)
        self.sink.on_step(self.name, self.last_batch_size, used / (self.config.max_slots * self.max_tgt),
                          len(self.running), len(self.waiting))
        return _Step(list(self.running), self._compact())

    def _compact(self) -> list[tuple[int, int, int]]:
        """Move hypotheses in slots >= R into the free slots below R (R = running hypotheses), so a step's
        rows are slots [0, R) in order and the cache reads views: gathering K/V of scattered slots was 34 %
        of a 64-client step's CPU time (benchmarks/profile_translate.py). Returns (src, dst, positions)
        copies for the worker thread; hypotheses not yet encoded move without a copy."""
        r = self.last_batch_size
        used = {s for it in self.running for s in it.slots}
        holes = iter(sorted(i for i in range(r) if i not in used))
        moves = []
        for it in self.running:
            for j, slot in enumerate(it.slots):
                if slot >= r:
                    dst = next(holes)
                    self.slots.move(slot, dst)
                    it.slots[j] = dst
                    if it.encoded:
                        moves.append((slot, dst, it.beam.step + 1))
        return moves

    def _release(self, it: _Item) -> None:
        if it.slots:
            self.slots.give(it.slots)
            self.cache.free_slots(it.slots)
            it.slots = []

    # --- one step (worker thread) ------------------------------------------------------------
    @torch.inference_mode()
    def _execute(self, step: _Step) -> list[_Item]:
        dev = self.config.device
        items = step.items
        if step.moves:  # compaction (see _compact): whole hypotheses, cross K/V included
            src, dst, n = zip(*step.moves, strict=True)
            self.cache.copy_slots(list(src), list(dst), length=list(n))
        new = [it for it in items if not it.encoded]
        if new and self.compiled is not None:
            self.compiled.encode([it.beam.src for it in new], [it.beam.k for it in new],
                                 [s for it in new for s in it.slots])
        elif new:
            src, mask = pad_batch([it.beam.src for it in new], self.cfg.pad_id, dev)  # (N, S)
            memory = self.model.encode(src, mask)  # (N, S, d)
            rep = torch.tensor([i for i, it in enumerate(new) for _ in range(it.beam.k)], device=dev)
            self.model.set_cross(memory[rep], mask[rep], self.cache, [s for it in new for s in it.slots])
        for it in new:
            it.encoded = True
        # rows are slots 0..R-1 in order (compacted): the cache reads views, row index == slot
        r = sum(it.beam.k for it in items)
        last, pos = [0] * r, [0] * r
        for it in items:
            for j, slot in enumerate(it.slots):
                last[slot] = it.beam.last[j]
                pos[slot] = it.beam.step
        if self.compiled is not None:
            src_lengths = [0] * r
            for it in items:
                for slot in it.slots:
                    src_lengths[slot] = len(it.beam.src)
            logits = self.compiled.decode(last, pos, src_lengths)  # (R, V)
        else:
            tokens = torch.tensor(last, device=dev)[:, None]  # (R, 1)
            positions = torch.tensor(pos, device=dev)[:, None]  # (R, 1)
            logits = self.model.decode(tokens, positions, self.cache, list(range(r)))[:, -1]  # (R, V)
        # (R,) one op for every greedy row; a float copy + argmax beats argmax over bf16 (docs/decisions.md)
        greedy = logits.float().argmax(-1).tolist() if any(it.beam.k == 1 for it in items) else []
        copies: list[tuple[int, int, int]] = []  # (src slot, dst slot, positions) K/V copies of beam reorders
        for it in items:
            if it.beam.k == 1:
                it.beam.push(greedy[it.slots[0]], logits[it.slots[0]])
                continue
            written = it.beam.step + 1  # positions of the item's K/V so far, this step's included
            parents = it.beam.advance(logits[it.slots])
            if parents:  # hypotheses move between the item's slots: the fewest K/V copies (reassign_slots)
                it.slots, moved = reassign_slots(it.slots, parents)
                copies += [(s, d, written) for s, d in moved]
        if copies:  # beams of one source share cross K/V: copy only the positions each item has written
            src_slots, dst_slots, lengths = zip(*copies, strict=True)
            self.cache.copy_slots(list(src_slots), list(dst_slots), length=list(lengths), cross=False)
        return [it for it in items if it.beam.done]

    # --- after a step (event loop) -------------------------------------------------------------
    def _deliver(self, done: list[_Item]) -> None:
        if not done:
            return
        for it in done:
            self._release(it)
            job = it.job
            tokens = it.beam.best()
            job.outputs[it.index][it.part] = postprocess(self.tokenizer.decode(tokens), job.target_langs[it.index])
            job.usage.completion_tokens += len(tokens)
            job.left -= 1
            if job.left == 0 and not job.future.done():
                job.future.set_result(self._result(job))
                self.requests_finished += 1
                self.sink.on_finish(self.name, "stop", job.usage.prompt_tokens, job.usage.completion_tokens,
                                    time.monotonic() - job.t_submit)
        self.running = [it for it in self.running if it.slots]

    def _fail_plan(self, step: _Step, error: Exception) -> None:
        for it in step.items:
            self._release(it)
            if not it.job.future.done():
                it.job.future.set_exception(error)
        self.running = [it for it in self.running if it.slots]

    def _fail_all(self, error: Exception) -> None:
        for it in list(self.running) + list(self.waiting):
            self._release(it)
            if not it.job.future.done():
                it.job.future.set_exception(error)
        self.running, self.waiting = [], deque()
