"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (SSE, stream_options.include_usage,
n choices, logprobs, echo, best_of, response_format), /v1/models. The official `openai` client works against
these unchanged."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from service.api.choices import UsageTotal, best, gather
from service.api.errors import ApiError
from service.api.generation import build_request, check_choices, check_prompt, encode_messages, new_id, usage_dict
from service.api.logprob_format import CompletionLogprobs, TokenTexts, chat_content
from service.api.schemas import ChatCompletionBody, CompletionBody
from service.api.streaming import collect, merged, sse_stream, started, unless_disconnected
from service.api.structured import response_schema

router = APIRouter(tags=["openai"])
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 512
NO_TOOLS = "the model cannot call tools"


def _model_card(model_id: str, request: Request) -> dict:
    return {"id": model_id, "object": "model", "created": request.app.state.created, "owned_by": "attnserve"}


@router.get("/v1/models")
async def models(request: Request):
    return {"object": "list", "data": [_model_card(m, request) for m in request.app.state.backends.ids()]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    if model_id not in request.app.state.backends.ids():
        raise ApiError(404, f"model {model_id!r} is not served here; GET /v1/models lists them", "model")
    return _model_card(model_id, request)


def _envelope(rid: str, obj: str, model: str, choices: list[dict], created: int | None = None, **more) -> dict:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model, "choices": choices,
            **more}


async def _stream(request: Request, events, rid: str, model: str, body, chunk, obj: str,
                  per_prompt: int = 0) -> StreamingResponse:
    """`chunk(ev)` -> the choice dicts of one event; usage (every choice's) goes in one last chunk when
    the body's stream_options ask for it (`per_prompt`: as UsageTotal's)."""
    usage, include_usage = UsageTotal(per_prompt), bool(body.stream_options and body.stream_options.include_usage)
    created = int(time.time())  # one timestamp for every chunk of the stream, as OpenAI's

    def render(ev) -> list[dict]:
        usage.add(ev)
        return [_envelope(rid, obj, model, [choice], created, **({"usage": None} if include_usage else {}))
                for choice in chunk(ev)]

    def tail() -> list[dict]:
        if not include_usage or not usage.finished:
            return []
        return [_envelope(rid, obj, model, [], created, usage=usage_dict(usage))]

    return StreamingResponse(sse_stream(await started(request, events), render, tail), media_type="text/event-stream")


def _check_stream_options(body) -> None:
    if body.stream_options is not None and not body.stream:  # as OpenAI and vLLM answer
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")


def _refuse_unsupported(body: ChatCompletionBody) -> None:
    """Chat fields accepted in the body but not acted on: a 400 naming the field and what to change (rather
    than pydantic's generic "Extra inputs are not permitted")."""
    if body.tools:
        raise ApiError(400, f"tools: {NO_TOOLS}; remove 'tools'", "tools")
    if body.tool_choice not in (None, "none"):
        raise ApiError(400, f"tool_choice: {NO_TOOLS}; remove 'tool_choice' or set it to \"none\"", "tool_choice")
    if body.functions:
        raise ApiError(400, f"functions: {NO_TOOLS}; remove 'functions'", "functions")
    if body.function_call not in (None, "none"):
        raise ApiError(400, f"function_call: {NO_TOOLS}; remove 'function_call'", "function_call")


def _penalties(body) -> dict:
    return {"presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
            "logit_bias": body.logit_bias}


def _completion_choices(body: CompletionBody, gen, limits) -> tuple[int, int]:
    """(n, best_of) checked: best_of >= n, best_of > n not streamed, both within the limits."""
    n = body.n
    best_of = body.best_of if body.best_of is not None else n
    if best_of < n:
        raise ApiError(400, f"best_of={best_of} must be >= n={n}", "best_of")
    if best_of > n and body.stream:
        raise ApiError(400, "best_of > n cannot be streamed (the best candidates are known only at the end); "
                            "set best_of = n or stream false", "best_of")
    check_choices(gen, n, limits, "n")
    check_choices(gen, best_of, limits, "best_of")
    return n, best_of


@router.post("/v1/completions")
async def completions(body: CompletionBody, request: Request):
    gen, limits = request.app.state.backends.need_generator(body.model, request), request.app.state.limits
    _check_stream_options(body)
    prompts = body.prompts()
    if len(prompts) > limits.max_prompts:
        raise ApiError(400, f"prompt: {len(prompts)} prompts given; the limit is {limits.max_prompts}", "prompt")
    ids_of, params = [], ["prompt"] if len(prompts) == 1 else [f"prompt.{i}" for i in range(len(prompts))]
    for prompt, param in zip(prompts, params, strict=True):
        if isinstance(prompt, str):
            check_prompt(prompt, limits, param)
            ids_of.append(gen.encode_prompt(prompt))
        else:
            ids_of.append(list(prompt))  # checked against the vocabulary by the engine's one check (submit)
    n, best_of = _completion_choices(body, gen, limits)
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens=0 generates nothing: it only scores the prompt, with echo true "
                            "(and logprobs for the scores)", "max_tokens")
    want_lp = body.logprobs is not None
    # best_of ranks candidates by their logprobs: tracked even when not returned
    track = body.logprobs if want_lp else (0 if best_of > n else None)
    score_prompt = body.logprobs if body.echo and want_lp else (0 if body.max_tokens == 0 else None)
    rid = new_id("cmpl")
    schema = await response_schema(gen, body.response_format)
    # prompt i's choices are indexed from i * best_of (OpenAI's order), i * n once best_of has picked
    reqs = [build_request(gen, body, ids, prompt_param=param, max_tokens=body.max_tokens,
                          default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, limits=limits, **_penalties(body),
                          n=best_of, logprobs=track, prompt_logprobs=score_prompt, json_schema=schema)
            for ids, param in zip(ids_of, params, strict=True)]
    # all queued or none (room checked for them together; where a schema's grammar refuses one, the
    # streams queued before it are dropped unread, which cancels them: the engine's finalizers)
    streams = gen.submit_all(reqs)
    events = streams[0] if len(streams) == 1 else merged(streams, best_of)
    texts = TokenTexts(gen.decode, lambda: gen.vocab_bytes, gen.hidden_ids)
    echoes = [(p if isinstance(p, str) else gen.decode(ids)) if body.echo else "" for p, ids in zip(prompts, ids_of)]

    def echo_pairs(prompt: int, prompt_lp) -> list:
        # a choice that ended (timeout, cancel) before its prompt was scored has no prompt logprobs
        if not (want_lp and body.echo and prompt_lp is not None):
            return []
        return list(zip(ids_of[prompt], prompt_lp, strict=True))

    offsets: dict[int, CompletionLogprobs] = {}

    def chunk(ev) -> list[dict]:
        """A choice's event (or, not streamed, the gathered choice) as its dict; its first carries the echo."""
        first, i = ev.index not in offsets, ev.index // n
        state = offsets.setdefault(ev.index, CompletionLogprobs(texts))
        text, echoed = (echoes[i] + ev.text, echo_pairs(i, ev.prompt_logprobs)) if first else (ev.text, [])
        generated = (ev.logprobs or []) if want_lp else []
        if not text and not echoed and not generated and ev.finish_reason is None:
            return []
        lp = state.render(echoed, generated) if want_lp and (echoed or generated or not body.stream) else None
        return [{"index": ev.index, "text": text, "logprobs": lp, "finish_reason": ev.finish_reason}]

    if body.stream:
        return await _stream(request, events, rid, gen.name, body, chunk, "text_completion", per_prompt=n)
    choices, usage = gather(await unless_disconnected(request, collect(events)), per_prompt=best_of)
    if best_of > n:
        choices = [c for i in range(len(prompts))
                   for c in best([c for c in choices if c.index // best_of == i], n, first=i * n)]
    return _envelope(rid, "text_completion", gen.name, [d for c in choices for d in chunk(c)], usage=usage_dict(usage))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionBody, request: Request):
    gen, limits = request.app.state.backends.need_generator(body.model, request), request.app.state.limits
    _refuse_unsupported(body)
    _check_stream_options(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    check_choices(gen, body.n, limits, "n")
    rid = new_id("chatcmpl")
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    ids = encode_messages(gen, body.messages, limits, body)
    track = (body.top_logprobs or 0) if body.logprobs else None
    schema = await response_schema(gen, body.response_format)
    req = build_request(gen, body, ids, prompt_param="messages", max_tokens=getattr(body, param),
                        default_max_tokens=CHAT_DEFAULT_MAX_TOKENS, limits=limits, max_tokens_param=param,
                        **_penalties(body), n=body.n, logprobs=track, json_schema=schema)
    events = gen.submit(req)
    texts = TokenTexts(gen.decode, lambda: gen.vocab_bytes, gen.hidden_ids)
    if body.stream:
        started: set[int] = set()

        def chunk(ev) -> list[dict]:
            i, out = ev.index, []
            if i not in started:
                started.add(i)
                out.append({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})
            if ev.text or (body.logprobs and ev.logprobs):
                lp = {"content": chat_content(texts, ev.logprobs or [])} if body.logprobs else None
                out.append({"index": i, "delta": {"content": ev.text}, "logprobs": lp, "finish_reason": None})
            if ev.finish_reason is not None:
                out.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": ev.finish_reason})
            return out

        return await _stream(request, events, rid, gen.name, body, chunk, "chat.completion.chunk")
    choices, usage = gather(await unless_disconnected(request, collect(events)))
    return _envelope(rid, "chat.completion", gen.name,
                     [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                       "logprobs": {"content": chat_content(texts, c.logprobs)} if body.logprobs else None,
                       "finish_reason": c.finish_reason} for c in choices], usage=usage_dict(usage))
