"""Locust scenarios for attnserve: LLM-aware users that measure TTFT, inter-token latency, output tokens
and tokens/s for every request.

Each user class is one scenario (`loadtests/scenarios.py` maps the CLI's names to them). Every request
fires one Locust request event named after the scenario (response time = end-to-end latency, length =
output tokens; failures are named "HTTP <status>") plus METRIC events in the style of fw-ai's
llm_bench: time_to_first_token, inter_token_latency (mean per request), output_tokens and
tokens_per_s. Each request is also appended to the --records-file JSONL, from which
`attnserve loadtest` computes exact percentiles.

Two load shapes:
- closed loop (default): each of the Locust users sends its next request when the previous one ends;
- open loop (--arrival-rate R): a single Locust user draws Poisson arrivals at R requests/s and fires each
  request without waiting for earlier ones (at most --max-inflight at once; an arrival over the cap is
  recorded as a failure with status 0), so queueing in the service shows up in the latencies.

Run it through `attnserve loadtest` (which runs Locust as its own process: gevent and Ray must never share
one), or by hand: `locust -f loadtests/locustfile.py --headless -u 4 -r 4 -t 10s -H http://127.0.0.1:8000
ChatStreamUser`."""

from __future__ import annotations

import random
import time

import gevent
import gevent.pool
from gevent import GreenletExit
from locust import HttpUser, constant, events, task
from requests.adapters import HTTPAdapter

from loadtests.datasets import by_direction, load_prompts, load_translate_inputs, read_jsonl
from loadtests.records import RecordWriter, RequestRecord
from loadtests.sse import parse_sse_line
from service.config import GENERATOR_ID

PROMPTS = load_prompts()
TRANSLATE: dict[str, list[str]] = {}  # target language -> source sentences, loaded at init
TRANSLATE_BATCH = 8
_writer: RecordWriter | None = None


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    parser.add_argument("--records-file", default="", help="append one JSON line per request here")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of generation requests")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--model", default=GENERATOR_ID, help="model id sent to the OpenAI endpoints")
    parser.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (benchmarks)")
    parser.add_argument("--beam-size", type=int, default=4, help="beam size of translation requests")
    parser.add_argument("--arrival-rate", type=float, default=0.0, help="open loop: Poisson arrivals per second")
    parser.add_argument("--max-inflight", type=int, default=64, help="open loop: cap on requests in flight")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--translate-file", default="", help="JSONL of {text, source_lang, target_lang} to use "
                        "instead of the sentences from the test split")


@events.init.add_listener
def _on_init(environment, **_kw):
    global _writer
    opts = environment.parsed_options
    path = getattr(opts, "records_file", "") if opts else ""
    if path:
        _writer = RecordWriter(path)
    own = getattr(opts, "translate_file", "") if opts else ""
    TRANSLATE.update(by_direction(read_jsonl(own) if own else load_translate_inputs()))


@events.quitting.add_listener
def _on_quit(**_kw):
    if _writer is not None:
        _writer.close()


def _error_message(resp) -> str:
    """The API's error text: {"error": {"message"}} or FastAPI's {"detail"}; else the raw body."""
    try:
        body = resp.json()
    except Exception:
        return (getattr(resp, "text", "") or str(getattr(resp, "error", "")) or "")[:200]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:200]
        if "detail" in body:
            return str(body["detail"])[:200]
    return str(body)[:200]


class LLMUser(HttpUser):
    """Base class: subclasses list `scenarios` as (weight, method name); each method sends one request."""

    abstract = True
    wait_time = constant(0)
    scenarios: list[tuple[int, str]] = []

    def on_start(self):
        opts = self.environment.parsed_options
        self.opts = opts
        self._pool = None
        if opts.arrival_rate > 0:
            adapter = HTTPAdapter(pool_connections=1, pool_maxsize=opts.max_inflight)
            self.client.mount("http://", adapter)
            self.client.mount("https://", adapter)
            self._pool = gevent.pool.Pool(opts.max_inflight)

    def on_stop(self):
        if self._pool is not None:
            self._pool.kill(block=False)

    def _pick(self):
        weights = [w for w, _ in self.scenarios]
        name = random.choices([n for _, n in self.scenarios], weights=weights)[0]
        return getattr(self, name)

    @task
    def step(self):
        if self._pool is None:  # closed loop: one request, then the next
            self._pick()()
            return
        rate = self.opts.arrival_rate
        while True:  # open loop: runs until Locust stops this user
            gevent.sleep(random.expovariate(rate))
            if self._pool.full():
                now = time.time()
                self._record(RequestRecord("arrival", now, now, False, 0, error="dropped: max-inflight reached"))
                continue
            self._pool.spawn(self._pick())

    # ---- measuring -------------------------------------------------------------------------------

    def _record(self, rec: RequestRecord):
        if _writer is not None:
            _writer.write(rec)
        if rec.status == 0 and rec.scenario == "arrival":
            self.environment.events.request.fire(
                request_type="POST",
                name="arrival",
                response_time=0,
                response_length=0,
                exception=RuntimeError(rec.error),
                context={},
            )
            return
        if not rec.ok:
            return
        fire = self.environment.events.request.fire
        if rec.ttft_s is not None:
            fire(
                request_type="METRIC",
                name="time_to_first_token",
                response_time=rec.ttft_s * 1000,
                response_length=0,
                exception=None,
                context={},
            )
        if rec.itl_s:
            mean_itl = sum(rec.itl_s) / len(rec.itl_s)
            fire(
                request_type="METRIC",
                name="inter_token_latency",
                response_time=mean_itl * 1000,
                response_length=0,
                exception=None,
                context={},
            )
        if rec.output_tokens:
            fire(
                request_type="METRIC",
                name="output_tokens",
                response_time=rec.output_tokens,
                response_length=0,
                exception=None,
                context={},
            )
            fire(
                request_type="METRIC",
                name="tokens_per_s",
                response_time=rec.output_tokens / max(rec.e2e_s, 1e-9),
                response_length=0,
                exception=None,
                context={},
            )

    def _post(self, name: str, path: str, body: dict, *, stream: bool, count_tokens):
        """Sends one request and records it. `count_tokens(json_body)` gives the output tokens of a
        non-streaming answer; streams are measured chunk by chunk."""
        start = time.time()
        t0 = time.perf_counter()
        rec = RequestRecord(name, start, start, False, 0)
        stopped = None
        try:
            resp_cm = self.client.post(
                path, json=body, stream=stream, catch_response=True, name=name, timeout=self.opts.request_timeout
            )
        except GreenletExit:  # stopped before the answer (a stream: its headers) came: a cut request too
            rec.cut, rec.error = True, "cut by the end of the run"
            rec.end = start + (time.perf_counter() - t0)
            self._record(rec)
            raise
        with resp_cm as resp:
            rec.status = int(resp.status_code or 0)
            try:
                if rec.status != 200:
                    rec.error = _error_message(resp) if rec.status else str(resp.error)[:200]
                elif stream:
                    self._read_stream(resp, rec, t0)
                else:
                    rec.output_tokens = int(count_tokens(resp.json()))
                    rec.ok = True
            except GreenletExit as e:  # the run's end stopped this user mid-stream: record what it received
                rec.ok, rec.cut, rec.error, stopped = False, True, "cut by the end of the run", e
            except Exception as e:  # a broken stream or body: a failure, not a crash of the user
                rec.ok = False
                rec.error = f"{type(e).__name__}: {e}"[:200]
            rec.end = start + (time.perf_counter() - t0)
            resp.request_meta["response_time"] = (rec.end - start) * 1000
            resp.request_meta["response_length"] = rec.output_tokens
            if rec.ok or rec.cut:
                resp.success()
            else:
                resp.failure(f"HTTP {rec.status}" + (" (in stream)" if rec.status == 200 else ""))
        self._record(rec)
        if stopped is not None:
            raise stopped

    @staticmethod
    def _read_stream(resp, rec: RequestRecord, t0: float):
        """TTFT = first chunk with text; a stream is complete at [DONE] or a finish_reason (an empty answer,
        e.g. EOS first, is a success without TTFT); a stream cut before either is a failure."""
        last = None
        chunks = 0
        complete = False
        usage = False
        for line in resp.iter_lines(chunk_size=None):
            chunk = parse_sse_line(line)
            if chunk is None:
                continue
            if chunk.error:
                rec.error = chunk.error[:200]
                return
            if chunk.done:
                complete = True
                break
            complete = complete or chunk.finish_reason is not None
            if chunk.usage_completion_tokens is not None:
                rec.output_tokens, usage = chunk.usage_completion_tokens, True
            if chunk.text:
                now = time.perf_counter()
                if last is None:
                    rec.ttft_s = now - t0
                else:
                    rec.itl_s.append(now - last)
                last = now
                chunks += 1
                if not usage:  # kept current: a stream cut by the run's end counts what it received
                    rec.output_tokens = chunks
        if not rec.output_tokens:
            rec.output_tokens = chunks  # no usage in the stream: one chunk ~ one token
        if not complete:
            rec.error = "stream ended before [DONE] or a finish_reason"
            return
        rec.ok = True

    # ---- request kinds ---------------------------------------------------------------------------

    def _gen_params(self) -> dict:
        body = {"max_tokens": self.opts.max_tokens, "temperature": self.opts.temperature}
        if self.opts.ignore_eos:
            body["ignore_eos"] = True
        return body

    def generate(self):
        body = {"messages": random.choice(PROMPTS), **self._gen_params()}
        self._post("generate", "/v1/generate", body, stream=False, count_tokens=_usage_tokens)

    def generate_stream(self):
        body = {"messages": random.choice(PROMPTS), "stream": True, **self._gen_params()}
        self._post("generate-stream", "/v1/generate", body, stream=True, count_tokens=_usage_tokens)

    def chat_stream(self):
        body = {
            "model": self.opts.model,
            "messages": random.choice(PROMPTS),
            "stream": True,
            "stream_options": {"include_usage": True},
            **self._gen_params(),
        }
        self._post("chat-stream", "/v1/chat/completions", body, stream=True, count_tokens=_usage_tokens)

    def translate(self):
        target = random.choice(["en", "zh"])
        body = {"text": random.choice(TRANSLATE[target]), "target_lang": target, "beam_size": self.opts.beam_size}
        self._post(f"translate-{target}", "/v1/translate", body, stream=False, count_tokens=_usage_tokens)

    def translate_batch(self):
        target = random.choice(["en", "zh"])
        texts = random.sample(TRANSLATE[target], min(TRANSLATE_BATCH, len(TRANSLATE[target])))
        body = {"text": texts, "target_lang": target, "beam_size": self.opts.beam_size}
        self._post(f"translate-batch-{target}", "/v1/translate", body, stream=False, count_tokens=_usage_tokens)


def _usage_tokens(body: dict) -> int:
    usage = body.get("usage") or {}
    return int(usage.get("completion_tokens") or 0)


class GenerateUser(LLMUser):
    scenarios = [(1, "generate")]


class GenerateStreamUser(LLMUser):
    scenarios = [(1, "generate_stream")]


class ChatStreamUser(LLMUser):
    scenarios = [(1, "chat_stream")]


class TranslateUser(LLMUser):
    scenarios = [(1, "translate")]


class TranslateBatchUser(LLMUser):
    scenarios = [(1, "translate_batch")]


class MixedUser(LLMUser):
    """Chat-heavy traffic with some translation, like a playground in use."""

    scenarios = [(4, "chat_stream"), (1, "generate"), (2, "translate"), (1, "translate_batch")]
