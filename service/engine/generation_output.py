"""The generation engine's output processing: each sampled token becomes text (incremental
detokenising, stop strings held back across token boundaries), end-of-sequence and length limits end a
choice, and events reach the request's stream.

`token` runs on the worker thread and only stages events in the sequence's outbox (asyncio queues are not
thread-safe); `flush` and `finish` run on the event loop and put them on the stream.
"""

from __future__ import annotations

import time

from service.engine.sequence import Sequence
from service.engine.stats import MetricsSink
from service.engine.types import GenerationEvent, TokenLogprob, Usage


class OutputProcessor:
    def __init__(self, eos_ids: set[int], sink: MetricsSink, name: str):
        self.eos_ids = eos_ids
        self.sink = sink
        self.name = name

    def token(self, seq: Sequence, tok: int, now: float, lp: TokenLogprob | None = None,
              complete: bool = False) -> None:
        """Worker thread: append a sampled token and stage its event, or the choice's end in `seq.done`.
        `complete`: the token completed the request's grammar, so nothing but end-of-sequence could follow."""
        seq.output.append(tok)
        if len(seq.output) == 1:
            if seq.index == 0:  # a request's first token, once: its choices share the prompt
                self.sink.on_first_token(self.name, seq.t_admit - seq.t_submit, now - seq.t_submit)
        else:
            self.sink.on_token_latency(self.name, now - seq.t_last)
        seq.t_last = now
        lps = None
        if lp is not None:
            seq.cum_logprob += lp.logprob
            lps = [lp]
        if tok in self.eos_ids and not seq.params.ignore_eos:
            text, _ = self.tail(seq)
            # no text, so no id in token_ids; its logprob is reported (scorers count one entry per sampled token)
            seq.done = ("stop", text, [], lps)
            return
        text, hit = seq.stopper.push(seq.detok.push(tok))
        if hit:
            seq.done = ("stop", text, [tok], lps)
        elif complete or len(seq.output) >= seq.params.max_new_tokens:
            tail, hit = self.tail(seq)
            seq.done = ("stop" if hit or complete else "length", text + tail, [tok], lps)
        else:
            seq.outbox.append(GenerationEvent(text=text, token_ids=[tok], index=seq.index, logprobs=lps))

    @staticmethod
    def tail(seq: Sequence) -> tuple[str, bool]:
        """Text still buffered at the end of a stream (detokenizer, then stop-string hold-back)."""
        return seq.stopper.finish(seq.detok.flush())

    def flush(self, seq: Sequence) -> None:
        """Event loop: put the staged events on the stream."""
        for ev in seq.outbox:
            seq.queue.put_nowait(ev)
        seq.outbox.clear()

    def fail(self, seq: Sequence, error: Exception) -> bool:
        """Event loop: end the choice's request with `error`, raised to its stream's reader (whose leaving
        cancels the other choices); no partial text is passed off as an answer -> whether this was the
        request's first failure."""
        first = not any(s.finish_reason == "error" for s in seq.group if s is not seq)
        seq.finish_reason = "error"
        if first:
            seq.queue.put_nowait(error)
            self.sink.on_finish(self.name, "error", len(seq.prompt), sum(len(s.output) for s in seq.group),
                                time.monotonic() - seq.t_submit)
        return first

    def finish(self, seq: Sequence, reason: str, text: str = "", token_ids: list[int] | None = None,
               logprobs: list[TokenLogprob] | None = None) -> bool:
        """Event loop: the choice's last event -> whether it ended the request (False for a choice cancelled
        after another failed: the request ended, and was counted, with that failure)."""
        failed = any(s.finish_reason == "error" for s in seq.group if s is not seq)
        seq.finish_reason = reason
        if failed:
            return False
        more = any(s.finish_reason is None for s in seq.group)
        usage = Usage(prompt_tokens=len(seq.prompt), completion_tokens=len(seq.output),
                      cached_tokens=seq.group[0].n_reused)
        cum = seq.cum_logprob if seq.params.logprobs is not None else None
        seq.queue.put_nowait(GenerationEvent(text=text, token_ids=token_ids or [], finish_reason=reason,
                                             usage=usage, index=seq.index, logprobs=logprobs,
                                             cumulative_logprob=cum, more=more))
        if not more:  # one request, counted once (as a failure is): the prompt once, every choice's tokens
            self.sink.on_finish(self.name, reason, len(seq.prompt), sum(len(s.output) for s in seq.group),
                                time.monotonic() - seq.t_submit)
        return not more
