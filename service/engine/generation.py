"""Continuous-batching generation engine for decoder-only models (SmolLM2 shape).

Each step, on the event loop: cancelled / timed-out requests leave and their slots are freed;
waiting requests are admitted into the lowest free slots (`continuous`), or only when the batch is
empty (`static`: request-level batches, like Ray Serve's @serve.batch; `serial`: one at a time).
Then, in the worker thread: one padded forward over prompt chunks being prefilled (at most
`prefill_chunk` tokens per request, `prefill_budget` per step, so running streams keep decoding),
one forward that decodes a token for every running sequence, per-request sampling, incremental
detokenization and stop-string matching. Events go to each request's asyncio queue.

A request for n choices is admitted with n slots at once; its first sequence prefills the prompt and
the others get a copy of that K/V and sample their first token from the same logits (`_prompt_done`).
Requests that ask for log-probabilities get them here, computed only for their rows
(service/engine/logprobs.py); a request scoring its prompt prefills alone with every position's logits.
A request with a JSON schema has a grammar matcher per choice: its rows' logits are masked before
sampling and it stops when the JSON is complete (service/engine/structured.py); other rows pay nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from model.decoder import DecoderLM
from model.tokenizer import IncrementalDetokenizer
from service.config import GENERATOR_ID
from service.engine.compiled import CompiledDecoder
from service.engine.config import EngineConfig
from service.engine.logprobs import prompt_logprobs, sampled_logprobs
from service.engine.loop import EngineLoop
from service.engine.sampling import make_generator, sample_next
from service.engine.stats import EngineStats, MetricsSink
from service.engine.stopping import StopMatcher
from service.engine.structured import GrammarError, Grammars, apply_bitmask
from service.engine.types import (
    EngineOverloaded,
    GenerateRequest,
    GenerationEvent,
    RequestRejected,
    SamplingParams,
    TokenLogprob,
    Usage,
)


@dataclass(eq=False)
class _Seq:
    """A request's state while queued or running."""

    req: GenerateRequest
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    detok: IncrementalDetokenizer
    stopper: StopMatcher
    generator: torch.Generator | None
    deadline: float | None  # time.monotonic() limit
    t_submit: float
    slot: int = -1
    n_cached: int = 0  # tokens whose K/V are in the cache
    output: list[int] = field(default_factory=list)
    t_admit: float = 0.0
    t_last: float = 0.0
    cancelled: bool = False
    outbox: list[GenerationEvent] = field(default_factory=list)  # staged by the worker thread
    # (finish reason, last text, last ids, their logprobs), set by the worker
    done: tuple[str, str, list[int], list[TokenLogprob] | None] | None = None
    finish_reason: str | None = None  # set on the event loop when the final event is queued
    index: int = 0  # which of the request's choices
    group: list[_Seq] = field(default_factory=list)  # every choice of the request, this one included
    forks: list[_Seq] = field(default_factory=list)  # choices waiting for this one's prefill
    pending_fork: bool = False  # holds a slot, waiting for the K/V of the choice that prefills
    prompt_lp: list[TokenLogprob | None] | None = None  # with params.prompt_logprobs: filled by prefill
    cum_logprob: float = 0.0  # with params.logprobs: sum over the sampled tokens
    matcher: object | None = None  # with params.json_schema: this choice's grammar state


@dataclass
class _Plan:
    prefill: list[tuple[_Seq, int]]  # (sequence, chunk length)
    decode: list[_Seq]
    moves: list[tuple[int, int, int]] = field(default_factory=list)  # (src slot, dst slot, positions)


class GenerationEngine(EngineLoop):
    def __init__(self, model: DecoderLM, tokenizer, config: EngineConfig, *, eos_ids: set[int],
                 name: str = GENERATOR_ID, sink: MetricsSink | None = None):
        super().__init__(config, name, sink)
        if config.max_seq_len > model.cfg.max_seq_len:
            config.max_seq_len = model.cfg.max_seq_len  # a slot can never hold more than the model
        self.model = model.to(device=config.device, dtype=config.torch_dtype).eval()
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.vocab_size = model.cfg.vocab_size
        self.cache = model.new_cache(config.max_slots, config.max_seq_len, dtype=config.kv_torch_dtype)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.grammars = Grammars(tokenizer, self.vocab_size, self.eos_ids)

    def _compile(self) -> CompiledDecoder:
        compiled = CompiledDecoder(self.model, self.cache)
        compiled.warm_up()
        return compiled

    @property
    def max_context(self) -> int:
        """Longest prompt + output a request may have."""
        return self.config.max_seq_len

    @property
    def max_positions(self) -> int:
        return self.config.max_seq_len

    @property
    def max_choices(self) -> int:
        """Most choices (n) one request may ask for: each holds a slot."""
        return self.config.max_slots

    def stats(self) -> EngineStats:
        return self._stats(len(self.running), len(self.waiting), sum(s.n_cached for s in self.running))

    # --- submit ------------------------------------------------------------------------------
    def _validate(self, req: GenerateRequest) -> None:
        p, n = req.params, len(req.prompt_ids)
        if n == 0:
            raise RequestRejected("prompt is empty")
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= self.vocab_size:
            raise RequestRejected(f"prompt token ids must be in [0, {self.vocab_size})")
        if p.max_new_tokens < (0 if p.prompt_logprobs is not None else 1):
            raise RequestRejected(f"max_new_tokens must be >= 1 (0 only to score the prompt with prompt_logprobs), "
                                  f"got {p.max_new_tokens}")
        if n >= self.max_context:
            raise RequestRejected(f"prompt has {n} tokens; the model context is {self.max_context} tokens "
                                  f"(max prompt {self.max_context - 1})")
        if n + p.max_new_tokens > self.max_context:
            raise RequestRejected(f"prompt ({n} tokens) + max_new_tokens ({p.max_new_tokens}) exceeds the "
                                  f"model context of {self.max_context} tokens; max_new_tokens can be at most "
                                  f"{self.max_context - n}")
        if p.temperature < 0:
            raise RequestRejected(f"temperature must be >= 0, got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise RequestRejected(f"top_p must be in (0, 1], got {p.top_p}")
        if p.top_k < 0:
            raise RequestRejected(f"top_k must be >= 0, got {p.top_k}")
        if p.repetition_penalty <= 0:
            raise RequestRejected(f"repetition_penalty must be > 0, got {p.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(p, name) <= 2.0:
                raise RequestRejected(f"{name} must be in [-2, 2], got {getattr(p, name)}")
        bad = [t for t in p.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejected(f"logit_bias token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(p, name)
            if k is not None and not 0 <= k <= self.vocab_size:
                raise RequestRejected(f"{name} must be in [0, {self.vocab_size}], got {k}")
        if not 1 <= req.n <= self.max_choices:
            raise RequestRejected(f"n={req.n}: each choice needs a KV slot; this engine has {self.max_choices}")
        if p.json_schema is not None and p.ignore_eos:
            raise RequestRejected("ignore_eos cannot be combined with a JSON schema: the output ends when the "
                                  "JSON is complete")

    def submit(self, req: GenerateRequest) -> AsyncIterator[GenerationEvent]:
        """Queue a request (raises RequestRejected / EngineOverloaded / EngineStopped right here)
        and return its event stream. Closing the stream early cancels the request."""
        self._check_started()
        self._validate(req)
        if len(self.waiting) >= self.config.max_waiting:
            raise EngineOverloaded(f"{len(self.waiting)} requests waiting (max_waiting="
                                   f"{self.config.max_waiting}); retry later", retry_after=1.0)
        now = time.monotonic()
        limit = req.deadline_s if req.deadline_s is not None else self.config.default_deadline_s
        p, queue, prompt = req.params, asyncio.Queue(), list(req.prompt_ids)
        matchers = [self.grammars.compile(p.json_schema) if p.json_schema is not None else None
                    for _ in range(req.n)]
        group = [_Seq(req=req, prompt=prompt, params=p, queue=queue,
                      detok=IncrementalDetokenizer(self.tokenizer, skip_ids=self.eos_ids),
                      stopper=StopMatcher(p.stop), generator=make_generator(None if p.seed is None else p.seed + i),
                      deadline=now + limit if limit is not None else None, t_submit=now, index=i,
                      pending_fork=i > 0, prompt_lp=[None] if p.prompt_logprobs is not None else None,
                      matcher=matchers[i])
                 for i in range(req.n)]
        for seq in group:
            seq.group = group
        group[0].forks = group[1:]
        self.waiting.append(group[0])
        self._wake()
        return self._stream(group[0])

    async def _stream(self, seq: _Seq) -> AsyncIterator[GenerationEvent]:
        try:
            while True:
                ev = await seq.queue.get()
                if isinstance(ev, Exception):
                    raise ev
                yield ev
                if ev.finished:
                    return
        finally:
            if any(s.finish_reason is None for s in seq.group):
                for s in seq.group:
                    s.cancelled = True
                self._wake()

    # --- schedule (event loop) -----------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self.running or self.waiting)

    async def _before_plan(self) -> None:
        if (self.config.mode == "static" and not self.running
                and 0 < len(self.waiting) < self.config.max_slots):
            await asyncio.sleep(self.config.static_batch_wait_s)  # let a batch gather

    def _finish(self, seq: _Seq, reason: str, text: str = "", token_ids: list[int] | None = None,
                logprobs: list[TokenLogprob] | None = None) -> None:
        seq.finish_reason = reason
        more = any(s.finish_reason is None for s in seq.group)
        usage = Usage(prompt_tokens=len(seq.prompt), completion_tokens=len(seq.output))
        cum = seq.cum_logprob if seq.params.logprobs is not None else None
        seq.queue.put_nowait(GenerationEvent(text=text, token_ids=token_ids or [], finish_reason=reason,
                                             usage=usage, index=seq.index, logprobs=logprobs,
                                             cumulative_logprob=cum, more=more))
        if not more:
            self.requests_finished += 1
        # the prompt was computed once for all choices: count it once
        self.sink.on_finish(self.name, reason, len(seq.prompt) if seq.index == 0 else 0, len(seq.output),
                            time.monotonic() - seq.t_submit)

    def _release(self, seq: _Seq) -> None:
        if seq.slot >= 0:
            self.slots.give([seq.slot])
            seq.slot = -1

    def _plan(self) -> _Plan | None:
        now = time.monotonic()
        keep = []
        for seq in self.running:
            if seq.cancelled or (seq.deadline is not None and now > seq.deadline):
                self._finish(seq, "cancelled" if seq.cancelled else "timeout")
                self._release(seq)
            else:
                keep.append(seq)
        self.running = keep
        moves = self._compact()
        if any(s.cancelled or (s.deadline is not None and now > s.deadline) for s in self.waiting):
            for seq in [s for s in self.waiting if s.cancelled or (s.deadline is not None and now > s.deadline)]:
                self.waiting.remove(seq)
                for s in seq.group:
                    self._finish(s, "cancelled" if seq.cancelled else "timeout")
        self._admit(now)
        if not self.running:
            return None
        budget = self.config.prefill_budget
        prefill, decode = [], []
        for seq in self.running:  # admission order: the oldest prompts prefill first
            if seq.pending_fork:
                continue
            left = len(seq.prompt) - seq.n_cached
            if left > 0:
                if budget > 0:
                    chunk = min(left, self.config.prefill_chunk, budget)
                    budget -= chunk
                    prefill.append((seq, chunk))
            else:
                decode.append(seq)
        decode.sort(key=lambda s: s.slot)
        self.last_batch_size = len(prefill) + len(decode)
        kv = sum(s.n_cached for s in self.running) / (self.config.max_slots * self.max_positions)
        self.sink.on_step(self.name, self.last_batch_size, kv, len(self.running), len(self.waiting))
        return _Plan(prefill, decode, moves)

    def _compact(self) -> list[tuple[int, int, int]]:
        """Move the sequences in slots >= n into the holes below n (n = running sequences), so that
        a step's rows use slots [0, n) and the KV cache reads views, not gathers (index_select was 13 %
        of a 64-client step). The K/V copies run on the worker thread at the start of the step."""
        n = len(self.running)
        used = {s.slot for s in self.running}
        holes = [i for i in range(n) if i not in used]
        movers = sorted((s for s in self.running if s.slot >= n), key=lambda s: s.slot)
        moves = []
        for seq, dst in zip(movers, holes, strict=True):
            moves.append((seq.slot, dst, seq.n_cached))
            self.slots.move(seq.slot, dst)
            seq.slot = dst
        return moves

    def _admit(self, now: float) -> None:
        """Admit waiting requests in order, each with a slot for every choice (all or none)."""
        mode = self.config.mode
        if mode != "continuous" and self.running:
            return  # static / serial: a new batch only when the last one has finished
        n = 1 if mode == "serial" else len(self.waiting)
        while n > 0 and self.waiting and len(self.waiting[0].group) <= self.slots.n_free:
            n -= 1
            for seq in self.waiting.popleft().group:
                seq.slot = self.slots.take(1)[0]
                seq.t_admit = now
                self.running.append(seq)

    # --- one step (worker thread) ------------------------------------------------------------
    @torch.inference_mode()
    def _execute(self, plan: _Plan) -> list[_Seq]:
        """One step; returns the sequences with events to deliver."""
        dev = self.config.device
        if plan.moves:
            src, dst, n = zip(*plan.moves, strict=True)
            self.cache.copy_slots(list(src), list(dst), length=list(n))
        rows: list[_Seq] = []  # sampled this step, in the order of `logits`
        scored: list[_Seq] = []  # prompts scored without generating (max_new_tokens 0)
        logits = []
        plain = [sc for sc in plan.prefill if sc[0].params.prompt_logprobs is None]
        # a prompt to score prefills alone: it needs every position's logits, the others only the last
        alone = [[sc] for sc in plan.prefill if sc[0].params.prompt_logprobs is not None]
        for group in _padding_bounded_groups(plain, self.config.prefill_max_padding) + alone:
            width = max(c for _, c in group)
            top = self.config.max_seq_len - 1
            tokens = torch.zeros(len(group), width, dtype=torch.long)  # (P, W) right-padded
            positions = torch.empty(len(group), width, dtype=torch.long)
            ar = torch.arange(width)
            for i, (seq, c) in enumerate(group):
                tokens[i, :c] = torch.tensor(seq.prompt[seq.n_cached: seq.n_cached + c])
                # pad positions go past the chunk (clamped to the last cache row, never a real one)
                positions[i] = (ar + seq.n_cached).clamp_(max=top)
            slots = [s.slot for s, _ in group]
            if group[0][0].params.prompt_logprobs is None:
                last = torch.tensor([c - 1 for _, c in group])
                out = self.model(tokens.to(dev), positions.to(dev), self.cache, slots,
                                 output_index=last.to(dev))  # (P, V)
            else:
                seq, c = group[0]
                full = self.model(tokens.to(dev), positions.to(dev), self.cache, slots)[0]  # (C, V)
                targets = seq.prompt[seq.n_cached + 1: seq.n_cached + c + 1]
                seq.prompt_lp.extend(prompt_logprobs(full, targets, seq.params.prompt_logprobs))
                out = full[c - 1:]  # (1, V)
            take = []  # the row of `out` each sampled choice starts from
            for i, (seq, c) in enumerate(group):
                seq.n_cached += c
                if seq.n_cached == len(seq.prompt):
                    for choice in self._prompt_done(seq):
                        if choice.params.max_new_tokens > 0:
                            take.append(i)
                            rows.append(choice)
                        else:
                            scored.append(choice)
            if take:
                logits.append(out[take])
        if plan.decode:
            d = plan.decode
            if self.compiled is not None:  # d is sorted by slot
                out = self.compiled.decode([s.slot for s in d], [s.output[-1] for s in d], [s.n_cached for s in d])
            else:
                tokens = torch.tensor([[s.output[-1]] for s in d], device=dev)  # (D, 1)
                positions = torch.tensor([[s.n_cached] for s in d], device=dev)  # (D, 1)
                out = self.model(tokens, positions, self.cache, [s.slot for s in d])[:, -1]  # (D, V)
            for s in d:
                s.n_cached += 1
            logits.append(out)
            rows.extend(d)
        if not rows:
            return scored
        x = torch.cat(logits).float() if len(logits) > 1 else logits[0].float()  # (N, V)
        params = [s.params for s in rows]
        ask = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = x[ask] if ask else None  # (A, V) a copy: sampling changes x in place
        constrained = [i for i, s in enumerate(rows) if s.matcher is not None]
        if constrained:
            apply_bitmask(x, constrained, self.grammars.fill([rows[i].matcher for i in constrained]))
        hist = [s.prompt + s.output if s.params.repetition_penalty != 1.0 else [] for s in rows]
        outs = [s.output if s.params.presence_penalty or s.params.frequency_penalty else [] for s in rows]
        toks = sample_next(x, params, [s.generator for s in rows], hist, outs)
        lps: list[TokenLogprob | None] = [None] * len(rows)
        if ask:
            got = sampled_logprobs(raw, [toks[i] for i in ask], [params[i].logprobs for i in ask])
            for i, lp in zip(ask, got, strict=True):
                lps[i] = lp
        now = time.monotonic()
        for seq, tok, lp in zip(rows, toks, lps, strict=True):
            try:
                complete = seq.matcher is not None and self.grammars.advance(seq.matcher, tok)
            except GrammarError as e:  # the vocabulary cannot spell what the grammar needs next
                seq.done = ("error", f"[structured output: {e}]", [], None)
                continue
            self._on_token(seq, tok, now, lp, complete)
        return scored + rows

    def _prompt_done(self, seq: _Seq) -> list[_Seq]:
        """`seq` has prefilled its prompt: fork its K/V to the request's other choices (worker thread);
        returns every live choice, each with its prompt logprobs staged when asked."""
        choices = [seq] + [c for c in seq.forks if c.slot >= 0 and c.finish_reason is None]
        forks, seq.forks = choices[1:], []
        if forks and seq.params.max_new_tokens > 0:
            self.cache.copy_slots([seq.slot] * len(forks), [c.slot for c in forks], length=len(seq.prompt))
        for c in forks:
            c.n_cached, c.pending_fork, c.prompt_lp = len(seq.prompt), False, seq.prompt_lp
        for c in choices:
            if c.prompt_lp is not None:
                c.outbox.append(GenerationEvent(index=c.index, prompt_logprobs=c.prompt_lp))
            if c.params.max_new_tokens == 0:
                c.done = ("length", "", [], None)
        return choices

    def _on_token(self, seq: _Seq, tok: int, now: float, lp: TokenLogprob | None = None,
                  complete: bool = False) -> None:
        """Append a sampled token and stage its event in `seq.outbox` (worker thread: asyncio
        queues are not thread-safe, so `_deliver` moves the events to the queue on the event loop).
        `complete`: the token completed the request's grammar, so nothing but end-of-sequence could follow."""
        seq.output.append(tok)
        if len(seq.output) == 1:
            self.sink.on_first_token(self.name, seq.t_admit - seq.t_submit, now - seq.t_submit)
        else:
            self.sink.on_token_latency(self.name, now - seq.t_last)
        seq.t_last = now
        lps = None
        if lp is not None:
            seq.cum_logprob += lp.logprob
            lps = [lp]
        if tok in self.eos_ids and not seq.params.ignore_eos:
            text, _ = self._tail(seq)
            # no text, so no id in token_ids; its logprob is reported (scorers count one entry per sampled token)
            seq.done = ("stop", text, [], lps)
            return
        text, hit = seq.stopper.push(seq.detok.push(tok))
        if hit:
            seq.done = ("stop", text, [tok], lps)
        elif complete or len(seq.output) >= seq.params.max_new_tokens:
            tail, hit = self._tail(seq)
            seq.done = ("stop" if hit or complete else "length", text + tail, [tok], lps)
        else:
            seq.outbox.append(GenerationEvent(text=text, token_ids=[tok], index=seq.index, logprobs=lps))

    @staticmethod
    def _tail(seq: _Seq) -> tuple[str, bool]:
        """Text still buffered at the end of a stream (detokenizer, then stop-string hold-back)."""
        text, hit = seq.stopper.push(seq.detok.flush())
        return (text, True) if hit else (text + seq.stopper.flush(), False)

    # --- after a step (event loop) -------------------------------------------------------------
    def _deliver(self, rows: list[_Seq]) -> None:
        finished = False
        for seq in rows:
            for ev in seq.outbox:
                seq.queue.put_nowait(ev)
            seq.outbox.clear()
            if seq.done is not None:
                self._finish(seq, *seq.done)
                self._release(seq)
                finished = True
        if finished:
            self.running = [s for s in self.running if s.slot >= 0]

    def _fail_plan(self, plan: _Plan, error: Exception) -> None:
        """Fail every request the step touched, all its choices (those waiting for a fork too)."""
        for seq in [s for s, _ in plan.prefill] + plan.decode:
            for s in seq.group:
                if s.finish_reason is None:
                    self._finish(s, "error", f"[engine error: {error}]")
                self._release(s)
        self.running = [s for s in self.running if s.slot >= 0]

    def _fail_all(self, error: Exception) -> None:
        told: set[int] = set()  # one error per stream: the choices of a request share it
        for seq in list(self.running) + [s for w in self.waiting for s in w.group]:
            if seq.finish_reason is None:
                seq.finish_reason = "error"
                if id(seq.queue) not in told:
                    told.add(id(seq.queue))
                    seq.queue.put_nowait(error)
            self._release(seq)
        self.running, self.waiting = [], deque()


def _padding_bounded_groups(chunks: list, max_padding: float = 0.25) -> list[list]:
    """Split a step's prefill chunks [(seq, n_tokens)] into forwards whose right padding stays within
    `max_padding` of their real tokens: a 16-token prompt batched with a 256-token one would otherwise
    compute 240 pad positions through every layer. Longest first; a chunk joins the current group
    while the group's padded size stays within bounds."""
    groups: list[list] = []
    for item in sorted(chunks, key=lambda sc: -sc[1]):
        g = groups[-1] if groups else None
        if g is not None:
            width = g[0][1]  # longest in the group (sorted)
            real = sum(c for _, c in g) + item[1]
            if width * (len(g) + 1) <= (1 + max_padding) * real:
                g.append(item)
                continue
        groups.append([item])
    return groups
