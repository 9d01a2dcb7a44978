"""Continuous-batching translation engine for the encoder-decoder (greedy and beam search).

Every sentence is a unit of work that batches on its own, a beam of k hypotheses holding k cache slots.
Each step encodes the newly admitted sources (their cross K/V into their slots) and runs ONE decoder forward
over every running hypothesis; each sentence's `BeamState` (model/decoding.py) picks its tokens, and beam
reorders copy K/V between the sentence's slots.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field

import torch

from model.decoding import BeamState, advance_all, max_len_for, min_len_for
from model.seq2seq import EncoderDecoder
from model.translation import DecodingOptionError, check_decoding_options
from service.config import TRANSLATOR_ID
from service.engine.beam import reassign_slots
from service.engine.config import EngineConfig
from service.engine.loop import EngineLoop
from service.engine.scheduler import Expiry
from service.engine.seq2seq_runner import Seq2SeqRunner
from service.engine.slot_table import Move
from service.engine.stats import MetricsSink
from service.engine.types import EngineError, RequestRejected, SourceBatch, rejection


@dataclass(eq=False)
class _Request:
    batch: SourceBatch
    future: asyncio.Future
    outputs: list[list[int] | None]  # per source: its best hypothesis (None: not finished)
    t_submit: float
    deadline: float | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cancelled: bool = False
    ended: bool = False  # counted as finished (`_end`)


@dataclass(eq=False)
class _Sentence:
    """One sentence to translate: the scheduler's unit of work, holding a slot per beam hypothesis."""

    request: _Request
    index: int  # position of the source in the request
    beam: BeamState
    slots: list[int] = field(default_factory=list)
    encoded: bool = False

    @property
    def slots_needed(self) -> int:
        return self.beam.k

    @property
    def kv_len(self) -> int:
        return self.beam.step + 1 if self.encoded else 0

    def expired(self, now: float) -> Expiry | None:
        r = self.request
        if r.cancelled or r.future.done():
            return "cancelled"
        return "timeout" if r.deadline is not None and now > r.deadline else None


@dataclass(eq=False)
class _Step:
    sentences: list[_Sentence]  # every running sentence; their hypotheses' slots are exactly 0..R-1
    moves: list[Move]  # compaction copies, applied first


class TranslationEngine(EngineLoop):
    def __init__(self, model: EncoderDecoder, config: EngineConfig, *, name: str = TRANSLATOR_ID,
                 sink: MetricsSink | None = None):
        super().__init__(config, name, sink, Seq2SeqRunner(model, config), "sentences")
        self.cfg = model.cfg
        if self.max_length < 1:  # else every beam would step past the cache and fail, a greedy one not
            raise ValueError(f"a translator needs >= 2 target positions (its start token and one output token); "
                             f"EngineConfig.max_seq_len {config.max_seq_len} and the model's max_tgt_len "
                             f"{model.cfg.max_tgt_len} leave {self.runner.max_tgt}")

    @property
    def max_positions(self) -> int:
        return self.runner.max_tgt

    @property
    def max_beam_size(self) -> int:
        """A beam's hypotheses each hold a slot."""
        return self.config.max_slots

    @property
    def max_length(self) -> int:
        """Most target tokens per sentence (the cache's positions, one for the start token)."""
        return self.runner.max_tgt - 1

    @property
    def max_source_len(self) -> int:
        """Longest source, its tag and end token included."""
        return self.cfg.max_src_len

    def _kv_used(self) -> int:
        return sum(s.beam.k * (s.beam.step + 1) for s in self.scheduler.running)

    # --- submit ------------------------------------------------------------------------------
    def _sentences(self, batch: SourceBatch, request: _Request) -> list[_Sentence]:
        reject = functools.partial(rejection, batch.field_names)
        if not 1 <= batch.beam_size <= self.max_beam_size:
            raise reject("beam_size", f"{{}} must be in [1, {self.max_beam_size}], got {batch.beam_size}")
        try:
            check_decoding_options(batch.field_names, length_penalty=batch.length_penalty,
                                   no_repeat_ngram=batch.no_repeat_ngram, min_length_ratio=batch.min_length_ratio)
        except DecodingOptionError as e:
            raise RequestRejected(str(e), e.field) from None
        if batch.max_length is not None and not 1 <= batch.max_length <= self.max_length:
            raise reject("max_length", f"{{}} must be in [1, {self.max_length}], got {batch.max_length}")
        out = []
        for i, src in enumerate(batch.sources):
            if not 2 <= len(src) <= self.max_source_len:
                raise reject("text", f"source {i} has {len(src)} tokens; the translator takes 2 to "
                                     f"{self.max_source_len} (tag and end token included)")
            limit = batch.max_length or max_len_for(len(src), 1.5, 10, self.max_length)
            beam = BeamState(src, batch.beam_size, limit, self.cfg.bos_id, self.cfg.eos_id, self.cfg.pad_id,
                             alpha=batch.length_penalty, no_repeat_ngram=batch.no_repeat_ngram,
                             min_len=min_len_for(len(src), batch.min_length_ratio, limit))
            out.append(_Sentence(request, i, beam))
            request.prompt_tokens += len(src)
        return out

    async def run(self, batch: SourceBatch) -> list[list[int]]:
        """Each source's best hypothesis, in order (RequestRejected / EngineOverloaded / EngineStopped are
        raised before any work; TimeoutError past the deadline). Cancelling the awaiting task frees the
        request's slots."""
        self._check_started()
        now = time.monotonic()
        request = _Request(batch, asyncio.get_running_loop().create_future(), [None] * len(batch.sources), now,
                           self._deadline(batch.deadline_s, now))
        sentences = self._sentences(batch, request)
        if not sentences:
            return []
        self.scheduler.add([[s] for s in sentences])
        self._queued()
        try:
            return await request.future
        finally:
            request.cancelled = True  # no-op once the result is set; frees the slots if we were cancelled
            self._wake()

    # --- schedule (event loop) -----------------------------------------------------------------
    def _plan(self) -> _Step | None:
        now = time.monotonic()
        sched = self.scheduler
        for sentence, why in sched.sweep(now):
            request = sentence.request
            if why == "timeout":
                limit = self._limit_s(request.batch.deadline_s)
                self._end(request, "timeout", error=TimeoutError(f"translation exceeded its deadline of {limit} s"))
            else:  # its client went away (its future cancelled), or another sentence of it failed (counted then)
                self._end(request, "cancelled")
        sched.admit()
        if not sched.running:
            return None
        self.last_batch_size = sum(s.beam.k for s in sched.running)
        return _Step(list(sched.running), sched.compact())

    # --- one step (worker thread) ------------------------------------------------------------
    @torch.inference_mode()
    def _execute(self, step: _Step) -> list[_Sentence]:
        hooks, table = self.hooks, self.scheduler.table
        sentences = step.sentences
        with hooks.phase("slot copies"):  # compaction: whole hypotheses, cross K/V included
            table.copy(step.moves)
        if new := [s for s in sentences if not s.encoded]:
            with hooks.phase("encoder"):
                self.runner.encode([s.beam.src for s in new], [s.beam.k for s in new],
                                   [slot for s in new for slot in s.slots])
            for s in new:
                s.encoded = True
        # rows are slots 0..R-1 in order (compacted): the cache reads views, row index == slot
        r = sum(s.beam.k for s in sentences)
        last, pos, src_lengths = [0] * r, [0] * r, [0] * r
        for s in sentences:
            for j, slot in enumerate(s.slots):
                last[slot], pos[slot], src_lengths[slot] = s.beam.last[j], s.beam.step, len(s.beam.src)
        with hooks.phase("decoder forward"):
            logits = self.runner.decode(last, pos, src_lengths)  # (R, V)
        copies: list[Move] = []  # K/V copies of beam reorders
        with hooks.phase("advance"):
            steps = advance_all([s.beam for s in sentences], logits, [s.slots for s in sentences])
            for s, parents in zip(sentences, steps, strict=True):
                if parents and s.beam.k > 1:  # hypotheses move between the sentence's slots: fewest copies
                    s.slots, moved = reassign_slots(s.slots, parents)
                    copies += [(a, b, s.beam.step) for a, b in moved]  # positions written, this step's included
        with hooks.phase("slot copies"):  # beams of one source share cross K/V: self-attention K/V only
            table.copy(copies, cross=False)
        return [s for s in sentences if s.beam.done]

    # --- after a step (event loop) -------------------------------------------------------------
    def _deliver(self, done: list[_Sentence]) -> None:
        for s in done:
            self.scheduler.release(s)
            request = s.request
            tokens = s.beam.best()
            request.outputs[s.index] = tokens
            request.completion_tokens += len(tokens)
            if None not in request.outputs:
                self._end(request, "stop", result=request.outputs)

    def _end(self, request: _Request, reason: str, result: list | None = None, error: Exception | None = None):
        """Settle a request's future (unless its client cancelled it) and count it, once, as finished for
        `reason`."""
        if request.ended:
            return
        request.ended = True
        if not request.future.done():
            if error is None:
                request.future.set_result(result)
            else:
                request.future.set_exception(error)
        self.requests_finished += 1
        self.sink.on_finish(self.name, reason, request.prompt_tokens, request.completion_tokens,
                            time.monotonic() - request.t_submit)

    def _fail_plan(self, step: _Step, error: EngineError) -> None:
        for s in step.sentences:
            self.scheduler.release(s)
            self._end(s.request, "error", error=error)

    def _fail_unit(self, sentence: _Sentence, reason: str, error: Exception) -> None:
        self._end(sentence.request, reason, error=error)
