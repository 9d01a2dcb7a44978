"""Native endpoints: POST /v1/generate (prompt or chat messages, optional SSE) and POST /v1/translate; also at
/generate and /translate, the names TGI's and vLLM's first servers used."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from service.api.errors import ApiError
from service.api.generation import build_request, encode_input, new_id, usage_dict
from service.api.schemas import GenerateBody, TranslateBody
from service.api.streaming import collect, sse_stream, started, unless_disconnected
from service.engine.types import TranslateRequest

router = APIRouter(tags=["native"])
DEFAULT_MAX_TOKENS = 128


@router.post("/v1/generate")
@router.post("/generate", include_in_schema=False)
async def generate(body: GenerateBody, request: Request):
    """Generate text from a `prompt` or chat `messages`. With `stream: true`, server-sent events:
    `{"text", "token_ids"}` deltas, a final event with `finish_reason` and `usage`, then `[DONE]`."""
    gen, limits = request.app.state.backends.need_generator(body.model, request), request.app.state.limits
    ids, param = encode_input(gen, body, limits)
    rid = new_id("gen")
    req = build_request(gen, body, ids, prompt_param=param, max_tokens=body.max_tokens,
                        default_max_tokens=DEFAULT_MAX_TOKENS, limits=limits)
    events = gen.submit(req)  # raises RequestRejected / EngineOverloaded before any work

    if body.stream:
        def render(ev) -> list[dict]:
            out = {"id": rid, "model": gen.name, "text": ev.text, "token_ids": ev.token_ids}
            if ev.finish_reason is not None:
                out.update(finish_reason=ev.finish_reason, usage=usage_dict(ev.usage))
            return [out]

        return StreamingResponse(sse_stream(await started(request, events), render), media_type="text/event-stream")

    done = await unless_disconnected(request, collect(events))
    last = done[-1]
    return {"id": rid, "model": gen.name, "text": "".join(e.text for e in done),
            "token_ids": [t for e in done for t in e.token_ids], "finish_reason": last.finish_reason,
            "usage": usage_dict(last.usage)}


@router.post("/v1/translate")
@router.post("/translate", include_in_schema=False)
async def translate(body: TranslateBody, request: Request):
    """Translate one text or a list between Chinese and English (source detected per text when omitted)."""
    tr, limits = request.app.state.backends.need_translator(body.model, request), request.app.state.limits
    texts = [body.text] if isinstance(body.text, str) else list(body.text)
    if not texts or len(texts) > limits.max_texts:
        raise ApiError(400, f"text must hold 1..{limits.max_texts} strings, got {len(texts)}", "text")
    for i, t in enumerate(texts):
        if not t.strip():
            raise ApiError(400, f"text[{i}] is empty", "text")
        if len(t) > limits.max_text_chars:
            raise ApiError(400, f"text[{i}] is {len(t)} characters; the limit is {limits.max_text_chars}", "text")
    # one bound per field: the operator's limit (ApiLimits) or what the translator can hold, the lower
    for field, value, limit_name, engine_limit, what in (
            ("beam_size", body.beam_size, "max_beam_size", tr.max_beam_size, "slots"),
            ("max_length", body.max_length, "max_translate_length", tr.max_length, "target positions")):
        limit = getattr(limits, limit_name)
        if value is not None and value > min(limit, engine_limit):
            raise ApiError(400, f"{field} must be <= {min(limit, engine_limit)} (ApiLimits.{limit_name} {limit}; "
                                f"the translator has {engine_limit} {what}), got {value}", field)
    options = body.model_dump(exclude={"model", "text"})  # languages, decoding options: named as in TranslateRequest
    req = TranslateRequest(texts=texts, max_sentences=limits.max_sentences, **options)
    try:
        result = await unless_disconnected(request, tr.translate(req))
    except TimeoutError as e:  # the engine's per-request deadline (EngineConfig.default_deadline_s)
        raise ApiError(504, str(e) or "translation exceeded its deadline", None) from None
    return {"model": tr.name, "translations": result.translations, "source_langs": result.source_langs,
            "target_langs": result.target_langs, "usage": usage_dict(result.usage)}
