"""The generation engine's output processor counts each request once: a choice that fails ends the request
(counted as an error), and the choices cancelled after it are neither counted again nor recorded."""

from __future__ import annotations

import asyncio

from service.engine.generation_output import OutputProcessor
from service.engine.sequence import Sequence
from service.engine.stats import MetricsSink
from service.engine.stopping import StopMatcher
from service.engine.types import RequestRejected, SamplingParams


class Sink(MetricsSink):
    def __init__(self):
        self.finished: list[str] = []
        self.tokens: list[tuple[int, int]] = []  # (prompt, generated) per counted request
        self.first_tokens = 0

    def on_first_token(self, model, queue_s, ttft_s):
        self.first_tokens += 1

    def on_finish(self, model, finish_reason, prompt_tokens, generation_tokens, e2e_s):
        self.finished.append(finish_reason)
        self.tokens.append((prompt_tokens, generation_tokens))


def group(n: int) -> list[Sequence]:
    queue = asyncio.Queue()
    seqs = [Sequence(prompt=[1, 2], params=SamplingParams(max_new_tokens=4), queue=queue, detok=None,
                     stopper=StopMatcher([]), generator=None, deadline=None, t_submit=0.0, index=i)
            for i in range(n)]
    for s in seqs:
        s.group = seqs
    return seqs


def test_choices_cancelled_after_a_failure_do_not_count_the_request_again():
    sink, (a, b, c) = Sink(), group(3)
    out = OutputProcessor(eos_ids={0}, sink=sink, name="m")
    assert out.fail(b, RequestRejected("output cannot follow the schema")) is True
    assert out.finish(a, "cancelled") is False and out.finish(c, "cancelled") is False
    assert sink.finished == ["error"]


def test_the_last_choice_to_finish_ends_the_request_counted_once_with_every_choices_tokens():
    sink, (a, b) = Sink(), group(2)
    out = OutputProcessor(eos_ids={0}, sink=sink, name="m")
    a.output, b.output = [5], [6, 7, 8]
    assert out.finish(a, "stop") is False and out.finish(b, "length") is True
    assert sink.finished == ["length"] and sink.tokens == [(2, 4)]  # the shared prompt once


def test_a_request_has_one_time_to_first_token_whatever_its_choices():
    import types

    sink, seqs = Sink(), group(3)
    out = OutputProcessor(eos_ids={0}, sink=sink, name="m")
    latencies = []
    sink.on_token_latency = lambda model, itl_s: latencies.append(itl_s)
    for s in seqs:
        s.t_admit = 0.0
        s.detok = types.SimpleNamespace(push=lambda tok: "x", flush=lambda: "")
        out.token(s, 9, now=1.0)
    assert sink.first_tokens == 1 and latencies == []  # a fork's first token is no inter-token gap
    out.token(seqs[1], 9, now=1.5)
    assert latencies == [0.5]


def test_a_failure_after_other_choices_finished_counts_all_their_tokens():
    sink, (a, b) = Sink(), group(2)
    out = OutputProcessor(eos_ids={0}, sink=sink, name="m")
    a.output, b.output = [5, 6], [7]
    assert out.finish(a, "stop") is False
    assert out.fail(b, RequestRejected("output cannot follow the schema")) is True
    assert sink.finished == ["error"] and sink.tokens == [(2, 3)]
