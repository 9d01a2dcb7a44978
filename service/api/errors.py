"""Error responses: every failure is a JSON body in OpenAI's shape, `{"error": {message, type, param, code}}`,
with a 4xx or 5xx status. Validation errors name the field; engine errors map to their status code."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from service.engine.types import EngineError, EngineOverloaded
from service.startup import RETRY_AFTER_S

logger = logging.getLogger("attnserve.api")
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "api_error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


async def send_error(send, status: int, message: str, param: str | None = None,
                     headers: dict[str, str] | None = None, **more) -> None:
    """An error response from pure-ASGI middleware (outside FastAPI's handlers); `more`: keys beside "error"."""
    data = json.dumps({**error_body(status, message, param), **more}).encode()
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": data})


def engine_error(e: EngineError) -> ApiError:
    """The HTTP form of an engine error: 429 + Retry-After, 400, 503 + Retry-After (as the start-up gate's: the
    engine stopping, another replica may answer), or 500 (a step that failed)."""
    status = e.status_code if e.status_code in (400, 429, 500, 503) else 500
    headers = {"Retry-After": str(max(1, round(e.retry_after)))} if isinstance(e, EngineOverloaded) else None
    if status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return ApiError(status, str(e) or type(e).__name__, getattr(e, "param", None), headers)


def _unparsable_body(cause: BaseException | None) -> str:
    """What was wrong with a body FastAPI could not parse (it only says "error parsing the body")."""
    if isinstance(cause, UnicodeDecodeError):
        return f"body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset {cause.start})"
    if isinstance(cause, RecursionError):
        return "body: JSON is nested too deeply"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return f"body: a number is too long ({str(cause).split(': ', 1)[-1].split(';')[0]})"
    return f"body could not be parsed as JSON ({type(cause).__name__ if cause else 'unknown error'})"


def _is_json(content_type: str) -> bool:
    """Whether FastAPI reads a body of this type as JSON: application/json or application/*+json."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _field(loc: tuple, error_type: str = "") -> str:
    # pydantic tags errors inside a union with the member type (`function-after[...]`, `list[str]`): drop those;
    # the last part of an unknown field's location is the client's key, whatever it holds
    last = [str(loc[-1])] if error_type == "extra_forbidden" and len(loc) > 1 else []
    parts = [str(p) for p in loc[:len(loc) - len(last)] if p != "body" and not (isinstance(p, str) and "[" in p)]
    return ".".join(parts + last) if parts + last else "body"


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, e: ApiError):
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(EngineError)
    async def _engine(request: Request, e: EngineError):
        return await _api(request, engine_error(e))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errors = e.errors()
        ctype = request.headers.get("content-type", "")
        if request.method == "POST" and not _is_json(ctype) and any(er.get("loc") == ("body",) for er in errors):
            # the body is not read as JSON without the header (FastAPI's CSRF guard for local servers)
            return error_response(415, f"Content-Type: send the JSON body with Content-Type: "
                                  f"application/json (got {ctype or 'none'})", "Content-Type")
        # inside a union (`str | list[str]`) the member whose type did not match adds a "should be a valid
        # <type>" error; a more specific one (a bound, a bad value) names the real problem
        specific = [er for er in errors if not str(er.get("type", "")).endswith("_type")]
        first = (specific or errors or [{"loc": ("body",), "msg": "invalid request"}])[0]
        field = _field(tuple(first.get("loc", ())), str(first.get("type", "")))
        msg = f"{field}: {first.get('msg', 'invalid value')}"
        if first.get("type") == "json_invalid":
            field = "body"
            msg = f"body: invalid JSON: {(first.get('ctx') or {}).get('error', 'decode error')}"
            pos = [p for p in first.get("loc", ()) if isinstance(p, int)]
            msg += f" at offset {pos[0]}" if pos else ""
        if len(errors) > 1:
            msg += f" (and {len(errors) - 1} more error(s))"
        return error_response(400, msg, field)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):  # a bug: JSON in the usual shape, no traceback leaked
        logger.exception("unhandled error in a request")
        return error_response(500, f"internal error ({type(e).__name__})")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        if e.status_code == 400 and e.detail == "There was an error parsing the body":
            if isinstance(e.__cause__, ClientDisconnect):  # gone before its body was in: as any disconnect
                return Response(status_code=499)
            return error_response(400, _unparsable_body(e.__cause__), "body")
        return error_response(e.status_code, str(e.detail), None, e.headers)
