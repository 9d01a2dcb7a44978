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

    def on_finish(self, model, finish_reason, prompt_tokens, generation_tokens, e2e_s):
        self.finished.append(finish_reason)


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


def test_the_last_choice_to_finish_ends_the_request():
    sink, (a, b) = Sink(), group(2)
    out = OutputProcessor(eos_ids={0}, sink=sink, name="m")
    assert out.finish(a, "stop") is False and out.finish(b, "length") is True
    assert sink.finished == ["stop", "length"]
