"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (SSE, stream_options.include_usage),
/v1/models. The official `openai` client works against these unchanged."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from service.api.errors import ApiError
from service.api.generation import build_request, check_prompt, encode_messages, new_id, usage_dict
from service.api.schemas import ChatCompletionBody, CompletionBody
from service.api.streaming import collect, sse_stream, unless_disconnected

router = APIRouter(tags=["openai"])
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 512


@router.get("/v1/models")
async def models(request: Request):
    created = request.app.state.created
    return {"object": "list",
            "data": [{"id": m, "object": "model", "created": created, "owned_by": "attnserve"}
                     for m in request.app.state.backends.ids()]}


def _stream(events, rid: str, model: str, include_usage: bool, chunk, obj: str) -> StreamingResponse:
    """`chunk(ev)` -> the choice dicts of one event; usage goes in one last chunk when asked for."""
    final: list = []

    def render(ev) -> list[dict]:
        if ev.finish_reason is not None:
            final.append(ev.usage)
        out = []
        for choice in chunk(ev):
            c = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
            if include_usage:
                c["usage"] = None
            out.append(c)
        return out

    def tail() -> list[dict]:
        if not include_usage or not final:
            return []
        return [{"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
                 "usage": usage_dict(final[-1])}]

    return StreamingResponse(sse_stream(events, render, tail), media_type="text/event-stream")


@router.post("/v1/completions")
async def completions(body: CompletionBody, request: Request):
    backends, limits = request.app.state.backends, request.app.state.limits
    gen = backends.need_generator(body.model)
    request.state.model = gen.name
    prompt = body.prompt_text()
    check_prompt(prompt, limits, "prompt")
    rid = new_id("cmpl")
    req = build_request(gen, body, gen.encode_prompt(prompt), prompt_param="prompt", max_tokens=body.max_tokens,
                        default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, limits=limits,
                        ignore_eos=body.ignore_eos, request_id=rid)
    events = gen.submit(req)
    if body.stream:
        def chunk(ev) -> list[dict]:
            if not ev.text and ev.finish_reason is None:
                return []
            return [{"index": 0, "text": ev.text, "logprobs": None, "finish_reason": ev.finish_reason}]

        include = bool(body.stream_options and body.stream_options.include_usage)
        return _stream(events, rid, gen.name, include, chunk, "text_completion")
    done = await unless_disconnected(request, collect(events))
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": gen.name,
            "choices": [{"index": 0, "text": "".join(e.text for e in done), "logprobs": None,
                         "finish_reason": done[-1].finish_reason}],
            "usage": usage_dict(done[-1].usage)}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionBody, request: Request):
    backends, limits = request.app.state.backends, request.app.state.limits
    gen = backends.need_generator(body.model)
    request.state.model = gen.name
    rid = new_id("chatcmpl")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    ids = encode_messages(gen, body.messages, limits)
    try:
        req = build_request(gen, body, ids, prompt_param="messages", max_tokens=max_tokens,
                            default_max_tokens=CHAT_DEFAULT_MAX_TOKENS, limits=limits,
                        ignore_eos=body.ignore_eos, request_id=rid)
    except ApiError as e:  # name the field the client actually sent
        if e.param == "max_tokens":
            e.param, e.message = param, e.message.replace("max_tokens", param)
        raise
    events = gen.submit(req)
    if body.stream:
        first = [True]

        def chunk(ev) -> list[dict]:
            out = []
            if first[0]:
                first[0] = False
                out.append({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})
            if ev.text:
                out.append({"index": 0, "delta": {"content": ev.text}, "logprobs": None, "finish_reason": None})
            if ev.finish_reason is not None:
                out.append({"index": 0, "delta": {}, "logprobs": None, "finish_reason": ev.finish_reason})
            return out

        include = bool(body.stream_options and body.stream_options.include_usage)
        return _stream(events, rid, gen.name, include, chunk, "chat.completion.chunk")
    done = await unless_disconnected(request, collect(events))
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": gen.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(e.text for e in done)},
                         "logprobs": None, "finish_reason": done[-1].finish_reason}],
            "usage": usage_dict(done[-1].usage)}
