"""Continuous-batching generation engine for decoder-only models (SmolLM2 shape).

Each step, on the worker thread, prefills prompt chunks (`prefill_chunk` per choice, `prefill_budget` per
step, so running streams keep decoding) and decodes one token for every running choice. A request's first
choice prefills the prompt, the others copy its K/V. Log-probabilities and JSON-schema masks cost only the
rows that ask.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from model.decoder import DecoderLM
from model.tokenizer import IncrementalDetokenizer, check_vocabularies
from service.config import GENERATOR_ID
from service.engine.config import EngineConfig
from service.engine.cpu_runtime import torch_threads
from service.engine.decoder_runner import DecoderRunner
from service.engine.generation_output import OutputProcessor
from service.engine.logprobs import prompt_logprobs, sampled_logprobs
from service.engine.loop import EngineLoop
from service.engine.prefix_reuse import PrefixIndex
from service.engine.sampling import make_generator, sample_next
from service.engine.sequence import Sequence
from service.engine.slot_table import Move
from service.engine.stats import MetricsSink
from service.engine.stopping import StopMatcher
from service.engine.structured import GrammarError, Grammars, apply_bitmask
from service.engine.types import EngineError, GenerateRequest, GenerationEvent, RequestRejected, TokenLogprob, rejection


@dataclass
class _Step:
    prefill: list[tuple[Sequence, int]]  # (sequence, chunk length)
    decode: list[Sequence]  # sorted by slot
    moves: list[Move] = field(default_factory=list)  # compaction copies, applied first
    reuse: list[Move] = field(default_factory=list)  # cached prompt prefixes copied to new sequences, next
    copied: bool = False  # set by the worker once both kinds of copy are done


# A decode step borrows threads only this small (one or two streams), where a second core speeds streaming
# the weights; fuller steps keep their tail latency better without (docs/decisions.md)
BORROW_DECODE_ROWS = 2


class GenerationEngine(EngineLoop):
    def __init__(self, model: DecoderLM, tokenizer, config: EngineConfig, *, eos_ids: set[int],
                 name: str = GENERATOR_ID, sink: MetricsSink | None = None):
        # a slot can never hold more than the model; the caller's config stays as given
        config = dataclasses.replace(config, max_seq_len=min(config.max_seq_len, model.cfg.max_seq_len))
        super().__init__(config, name, sink, DecoderRunner(model, config), "requests")
        self.tokenizer = tokenizer
        check_vocabularies(tokenizer, model.cfg.vocab_size)
        self.eos_ids = set(eos_ids)
        # left out of the text (token_ids keep them), as vLLM's skip_special_tokens does by default
        self.hidden_ids = self.eos_ids | set(getattr(tokenizer, "special_ids", ()))
        # ids past the tokenizer's pad the embedding (to a multiple of 64, say): never text, never sampled,
        # as vLLM trims them
        self.vocab_size = min(model.cfg.vocab_size, getattr(tokenizer, "vocab_size", model.cfg.vocab_size))
        self.grammars = Grammars(tokenizer, model.cfg.vocab_size, self.eos_ids)
        self.output = OutputProcessor(self.eos_ids, self.sink, name)
        self.prefixes = PrefixIndex()
        self.prefix_tokens_reused = 0  # prompt tokens whose K/V were copied, not prefilled

    def _prepare(self) -> None:
        # the start's warm-up writes over free slots: what they held before a restart is gone
        self.prefixes = PrefixIndex()
        super()._prepare()

    @property
    def max_context(self) -> int:
        """Longest prompt + output a request may have."""
        return self.config.max_seq_len

    max_positions = max_context  # a slot's positions: the context

    @property
    def max_choices(self) -> int:
        """Most choices (n) one request may ask for: each holds a slot."""
        return self.config.max_slots

    def _kv_used(self) -> int:
        return sum(s.n_cached for s in self.scheduler.running)

    # --- submit ------------------------------------------------------------------------------
    def validate(self, req: GenerateRequest) -> None:
        """The one check of a request: RequestRejected naming the field (as the client named it) unless it
        can run here, its prompt and output within the context."""
        p, n = req.params, len(req.prompt_ids)

        reject = functools.partial(rejection, req.field_names)
        if n == 0:
            raise reject("prompt_ids", "{} is empty")
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= self.vocab_size:
            raise reject("prompt_ids", f"{{}}: token ids must be in [0, {self.vocab_size})")
        if p.max_new_tokens < (0 if p.prompt_logprobs is not None else 1):
            raise reject("max_new_tokens", f"{{}} must be >= 1 (0 only to score the prompt with prompt_logprobs), "
                                           f"got {p.max_new_tokens}")
        ctx = self.max_context
        if n > ctx or n == ctx and p.max_new_tokens:  # a prompt only scored may fill the context
            raise reject("prompt_ids", f"{{}} is {n} tokens; the context holds {ctx} tokens including the output")
        if n + p.max_new_tokens > ctx:
            raise reject("max_new_tokens", f"{{}}={p.max_new_tokens} does not fit: the prompt is {n} tokens and the "
                                           f"context holds {ctx}; use {{}} <= {ctx - n}")
        if p.temperature < 0:
            raise reject("temperature", f"{{}} must be >= 0, got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise reject("top_p", f"{{}} must be in (0, 1], got {p.top_p}")
        if p.top_k < 0:
            raise reject("top_k", f"{{}} must be >= 0, got {p.top_k}")
        if not 0 <= p.min_p <= 1:
            raise reject("min_p", f"{{}} must be in [0, 1], got {p.min_p}")
        if not p.repetition_penalty > 0:  # NaN too: the command line passes floats unchecked
            raise reject("repetition_penalty", f"{{}} must be > 0, got {p.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(p, name) <= 2.0:
                raise reject(name, f"{{}} must be in [-2, 2], got {getattr(p, name)}")
        if bad := [t for t in p.logit_bias if not 0 <= t < self.vocab_size]:
            raise reject("logit_bias", f"{{}}: token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if k is not None and not 0 <= k <= self.vocab_size:
                raise reject(name, f"{{}} must be in [0, {self.vocab_size}], got {k}")
        if not 1 <= req.n <= self.max_choices:
            raise reject("n", f"{{}}={req.n}: each choice needs a KV slot; this engine has {self.max_choices}")
        if p.json_schema is not None and p.ignore_eos:
            schema = req.field_names.get("json_schema", "json_schema")
            raise reject("ignore_eos", f"{{}} cannot be combined with {schema}: the output ends when the JSON "
                                       f"is complete; remove one of them")

    def submit_all(self, reqs: list[GenerateRequest]) -> list[AsyncIterator[GenerationEvent]]:
        """Queue several requests (the prompts of one completions call) all or none, their room checked
        together as one request's groups are: a list longer than the queue runs in turns on an idle engine
        rather than a 429 that every retry would get too."""
        self._check_started()
        for req in reqs:
            self.validate(req)
        self.scheduler.check_room([req.n for req in reqs])
        return [self.submit(req, checked=True) for req in reqs]

    def submit(self, req: GenerateRequest, checked: bool = False) -> AsyncIterator[GenerationEvent]:
        """Queue a request (raises RequestRejected / EngineOverloaded / EngineStopped right here)
        and return its event stream. Closing the stream early cancels the request. `checked`: the caller
        (submit_all) has validated it and made room."""
        self._check_started()
        if not checked:
            self.validate(req)
            self.scheduler.check_room([req.n])  # before compiling grammars for a request refused anyway
        now = time.monotonic()
        deadline = self._deadline(req.deadline_s, now)
        p, queue, prompt = req.params, asyncio.Queue(), list(req.prompt_ids)
        group = [Sequence(prompt=prompt, params=p, queue=queue,
                          detok=IncrementalDetokenizer(self.tokenizer, self.hidden_ids, context=prompt),
                          stopper=StopMatcher(p.stop), generator=make_generator(None if p.seed is None else p.seed + i),
                          deadline=deadline, t_submit=now, index=i, pending_fork=i > 0,
                          prompt_lp=[None] if p.prompt_logprobs is not None else None,
                          matcher=None if p.json_schema is None else self.grammars.compile(p.json_schema),
                          schema_field=req.field_names.get("json_schema", "json_schema"))
                 for i in range(req.n)]
        for seq in group:
            seq.group = group
        group[0].forks = group[1:]
        self.scheduler.add([group], check=False)  # room checked above, or by submit_all
        self._queued()
        stream = self._stream(group[0])
        # a stream never iterated (its client gone before the response began) runs no `finally`
        weakref.finalize(stream, _abandon, group)
        return stream

    async def _stream(self, seq: Sequence) -> AsyncIterator[GenerationEvent]:
        try:
            while True:
                ev = await seq.queue.get()
                if isinstance(ev, Exception):
                    raise ev
                yield ev
                if ev.finished:
                    return
        finally:
            _abandon(seq.group)
            self._wake()

    # --- schedule (event loop) -----------------------------------------------------------------
    def _finish(self, seq: Sequence, reason: str, text: str = "", token_ids: list[int] | None = None,
                logprobs: list[TokenLogprob] | None = None) -> None:
        # an "error" choice carries its error (set where it failed): raised to the reader, no text
        done = self.output.fail(seq, seq.error) if reason == "error" else \
            self.output.finish(seq, reason, text, token_ids, logprobs)
        if done:
            self.requests_finished += 1

    def _plan(self) -> _Step | None:
        now = time.monotonic()
        sched = self.scheduler
        for seq, why in sched.sweep(now):
            # a choice past its deadline keeps the text it held back (a stop string's prefix, part of a
            # character); a cancelled one has nobody to read it
            self._finish(seq, why, self.output.tail(seq)[0] if why == "timeout" else "")
        admitted = sched.admit()
        for seq in admitted:
            seq.t_admit = now
        if not sched.running:
            return None
        moves = sched.compact()
        reuse = self._reuse_prefixes(admitted, moves)
        budget = self.config.prefill_budget
        prefill, decode = [], []
        for seq in sched.running:  # admission order: the oldest prompts prefill first
            if seq.pending_fork:
                continue
            left = len(seq.prompt) - seq.n_cached
            if left <= 0:
                decode.append(seq)
            elif budget > 0:
                chunk = min(left, self.config.prefill_chunk, budget)
                budget -= chunk
                prefill.append((seq, chunk))
        decode.sort(key=lambda s: s.slot)
        self.last_batch_size = len(prefill) + len(decode)
        return _Step(prefill, decode, moves, reuse)

    def _reuse_prefixes(self, admitted: list[Sequence], moves: list[Move]) -> list[Move]:
        """Start each new prompt's `n_cached` at the longest prefix already cached -> the copies, to run after
        compaction's."""
        index = self.prefixes
        index.forget(dst for _, dst, _ in moves)
        reuse: list[Move] = []
        new = [s for s in admitted if not s.pending_fork and s.params.prompt_logprobs is None]
        if self.config.prefix_reuse and new:
            # sources: what the running sequences have cached, and freed slots; not the new prompts' slots
            # (each is written this step), except a prompt's own slot, which it reads in place
            mine = {s.slot for s in admitted}
            running = [(s.slot, s.cached_ids) for s in self.scheduler.running
                       if s.n_cached > 0 and s.slot not in mine]
            for seq in new:
                freed = [(slot, t) for slot, t in index.freed.items() if slot not in mine or slot == seq.slot]
                src, n = index.longest(seq.prompt, running + freed)
                if n:
                    seq.n_cached = seq.n_reused = n
                    self.prefix_tokens_reused += n
                    if src != seq.slot:
                        reuse.append((src, seq.slot, n))
        index.forget(s.slot for s in self.scheduler.running)  # every held slot is written from now on
        return reuse

    # --- one step (worker thread) ------------------------------------------------------------
    @torch.inference_mode()
    def _execute(self, step: _Step) -> list[Sequence]:
        """One step; returns the sequences with events to deliver."""
        hooks = self.hooks
        with hooks.phase("slot copies"):
            self.scheduler.table.copy(step.moves)
            self.scheduler.table.copy(step.reuse)  # reads slots the compaction copies may have filled
        step.copied = True
        rows: list[Sequence] = []  # sampled this step, in the order of `logits`
        scored: list[Sequence] = []  # prompts scored without generating (max_new_tokens 0)
        logits = []
        chunks = [(seq, c) for seq, c in step.prefill if seq.params.prompt_logprobs is None]
        borrowed = self._borrowed_threads(step)
        if chunks:
            with hooks.phase("prefill forward"), torch_threads(borrowed):
                out = self.runner.prefill([(s.slot, s.prompt[s.n_cached: s.n_cached + c], s.n_cached)
                                           for s, c in chunks])  # (P, V)
            self._prefilled(chunks, out, rows, scored, logits)
        # a prompt to score prefills alone: it needs every position's logits, the others only the last
        for seq, c in [sc for sc in step.prefill if sc[0].params.prompt_logprobs is not None]:
            with hooks.phase("prefill forward"):
                full = self.runner.score((seq.slot, seq.prompt[seq.n_cached: seq.n_cached + c], seq.n_cached))
            full[:, self.vocab_size:] = float("-inf")  # padding ids, as in _sample
            targets = seq.prompt[seq.n_cached + 1: seq.n_cached + c + 1]
            seq.prompt_lp.extend(prompt_logprobs(full, targets, seq.params.prompt_logprobs))
            self._prefilled([(seq, c)], full[c - 1:], rows, scored, logits)
        if rows and step.decode:
            # the new prompts' first tokens go out now, not after the running rows' decode forward
            self._emit(rows, logits)
            self._loop.call_soon_threadsafe(self._flush_first_tokens, list(rows))
            scored, rows, logits = scored + rows, [], []
        if d := step.decode:
            with hooks.phase("decode forward"), torch_threads(borrowed):
                out = self.runner.decode([s.slot for s in d], [s.output[-1] for s in d], [s.n_cached for s in d])
            for s in d:
                s.n_cached += 1
            logits.append(out)
            rows.extend(d)
        if rows:
            self._emit(rows, logits)
        return scored + rows

    def _flush_first_tokens(self, rows: list[Sequence]) -> None:
        """Event loop, while the step's decode forward runs: stream the staged first tokens (a choice that
        already ended waits for `_deliver`, which also frees its slot)."""
        for seq in rows:
            if seq.done is None:
                self.output.flush(seq)

    def _emit(self, rows: list[Sequence], logits: list[torch.Tensor]) -> None:
        """Sample each row's token from its logits (pieces of (N, V) in row order) and stage its event
        (worker thread)."""
        with self.hooks.phase("sampling"):
            toks, lps = self._sample(torch.cat(logits) if len(logits) > 1 else logits[0], rows)
        now = time.monotonic()
        for seq, tok, lp in zip(rows, toks, lps, strict=True):
            complete = False
            if seq.matcher is not None:
                try:
                    with self.hooks.phase("grammar"):
                        complete = self.grammars.advance(seq.matcher, tok)
                except GrammarError as e:  # the schema cannot be followed from here
                    seq.error = RequestRejected(f"{seq.schema_field}: output cannot follow the schema ({e})",
                                                seq.schema_field)
                    seq.done = ("error", "", [], None)
                    continue
            self.output.token(seq, tok, now, lp, complete)

    def _borrowed_threads(self, step: _Step) -> int | None:
        """The threads a step may borrow while no other engine on the host is busy: `decode_threads` for a
        step that decodes, `prefill_threads` for one that only prefills; None = the engine's own."""
        want = self.config.decode_threads if step.decode else self.config.prefill_threads
        if (want is None or len(step.decode) > BORROW_DECODE_ROWS or want <= torch.get_num_threads()
                or self.busy.others_busy()):
            return None
        return want

    def _prefilled(self, chunks: list[tuple[Sequence, int]], last: torch.Tensor, rows: list[Sequence],
                   scored: list[Sequence], logits: list[torch.Tensor]) -> None:
        """Count the chunks as cached; the choices whose prompt is now complete join `rows` (to sample) or
        `scored`. `last` (len(chunks), V): each chunk's last-position logits; the new rows' join `logits`."""
        take = []
        for i, (seq, c) in enumerate(chunks):
            seq.n_cached += c
            if seq.n_cached == len(seq.prompt):
                for choice in self._prompt_done(seq):
                    if choice.params.max_new_tokens > 0:
                        take.append(i)
                        rows.append(choice)
                    else:
                        scored.append(choice)
        if take:
            logits.append(last[take])  # (new rows, V)

    def _sample(self, logits: torch.Tensor, rows: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits (N, V) of `rows` -> each row's token and, where asked, its logprobs."""
        x = logits.float()  # (N, V)
        if self.vocab_size < x.shape[-1]:
            x[:, self.vocab_size:] = float("-inf")  # padding ids
        params = [s.params for s in rows]
        ask = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = x[ask] if ask else None  # (A, V) a copy: sampling changes x in place
        if constrained := [i for i, s in enumerate(rows) if s.matcher is not None]:
            with self.hooks.phase("grammar"):
                apply_bitmask(x, constrained, self.grammars.fill([rows[i].matcher for i in constrained]))
        hist = [s.prompt + s.output if s.params.repetition_penalty != 1.0 else [] for s in rows]
        outs = [s.output if s.params.presence_penalty or s.params.frequency_penalty else [] for s in rows]
        toks = sample_next(x, params, [s.generator for s in rows], hist, outs)
        got = dict(zip(ask, sampled_logprobs(raw, [toks[i] for i in ask], [params[i].logprobs for i in ask]),
                       strict=True))
        return toks, [got.get(i) for i in range(len(rows))]

    def _prompt_done(self, seq: Sequence) -> list[Sequence]:
        """`seq` has prefilled its prompt: fork its K/V to the request's other choices (worker thread);
        returns every live choice, each with its prompt logprobs staged when asked."""
        choices = [seq] + [c for c in seq.forks if c.slot >= 0 and c.finish_reason is None]
        forks, seq.forks = choices[1:], []
        copied = seq.params.max_new_tokens > 0  # a scored prompt's choices generate nothing: no copy
        if forks and copied:
            self.scheduler.table.copy([(seq.slot, c.slot, len(seq.prompt)) for c in forks])
        for c in forks:  # n_cached: what the slot holds, which prefix reuse trusts once it is freed
            c.n_cached, c.pending_fork, c.prompt_lp = len(seq.prompt) if copied else 0, False, seq.prompt_lp
        for c in choices:
            if c.prompt_lp is not None:
                c.outbox.append(GenerationEvent(index=c.index, prompt_logprobs=c.prompt_lp))
            if c.params.max_new_tokens == 0:
                c.done = ("length", "", [], None)
        return choices

    # --- after a step (event loop) -------------------------------------------------------------
    def _deliver(self, rows: list[Sequence]) -> None:
        for seq in rows:
            self.output.flush(seq)
            if seq.done is not None:
                self._finish(seq, *seq.done)
                self.prefixes.freed_slot(seq.slot, seq.cached_ids)
                self.scheduler.release(seq)

    def _fail_plan(self, step: _Step, error: EngineError) -> None:
        """Fail every request the step touched, all its choices, and, if it failed before its copies were
        done, those whose slots the copies were to fill: they lack the K/V their `n_cached` counts."""
        touched = [s for s, _ in step.prefill] + step.decode
        if not step.copied:
            dst = {d for _, d, _ in step.moves + step.reuse}
            touched += [s for s in self.scheduler.running if s.slot in dst]
        for seq in touched:
            for s in seq.group:
                self._fail_unit(s, "error", error)
                self.scheduler.release(s)

    def _fail_unit(self, seq: Sequence, reason: str, error: Exception) -> None:
        if seq.finish_reason is None:  # a choice already ended was counted then
            seq.error = error
            self._finish(seq, reason)


def _abandon(group: list[Sequence]) -> None:
    """Cancel a request whose stream ended before it did (closed, or dropped unread); the loop's next sweep
    frees its slots."""
    if any(s.finish_reason is None for s in group):
        for s in group:
            s.cancelled = True
