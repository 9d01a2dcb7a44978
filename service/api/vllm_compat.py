"""vLLM's utility endpoints, with its request and response shapes, for clients written against vLLM:
POST /tokenize, POST /detokenize, GET /version, GET /health (200 when the generator serves)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.api.errors import ApiError, error_response
from service.api.generation import encode_input
from service.api.schemas import DetokenizeBody, TokenizeBody

router = APIRouter(tags=["vllm"])


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, request: Request):
    """`{prompt}` or `{messages, add_generation_prompt, continue_final_message}` -> `{count, max_model_len,
    tokens, token_strs}`."""
    gen, limits = request.app.state.backends.need_generator(body.model, request), request.app.state.limits
    ids, _ = encode_input(gen, body, limits)
    strs = [gen.decode([i]) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": gen.max_context, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, request: Request):
    """`{tokens}` -> `{prompt}`: the text of those token ids."""
    gen = request.app.state.backends.need_generator(body.model, request)
    if bad := [i for i in body.tokens if not 0 <= i < gen.vocab_size]:
        raise ApiError(400, f"tokens: {bad[:5]} are not token ids of model {gen.name} "
                            f"(integers in [0, {gen.vocab_size}))", "tokens")
    return {"prompt": gen.decode(body.tokens)}


@router.get("/version", tags=["ops"])
async def server_version():
    try:
        return {"version": version("attnserve")}
    except PackageNotFoundError:  # run from a checkout that was never installed
        return {"version": "unknown"}


@router.get("/health", tags=["ops"])
async def health(request: Request):
    """200 with an empty body once the generator serves (vLLM's probe); 503 until then."""
    backends = request.app.state.backends
    if backends.generator is None:
        return error_response(503, f"no generator is served: {backends.unavailable or 'not loaded'}")
    return Response(status_code=200)
