"""Pure-ASGI middleware: a request body size limit (413) whose `receive` reads a transport failure as a client
disconnect, HTTP response counting for Prometheus, and a fast 503 while the replica starts."""

from __future__ import annotations

from starlette.routing import Match

from service import metrics
from service.api.errors import send_error
from service.startup import RETRY_AFTER_S


class BodyLimit:
    """Reject bodies over `limit()` bytes: by Content-Length up front, or while reading a chunked body.

    The app's `receive` also reads one that raises as the client gone: under Ray Serve a client that drops
    a stream makes the replica's `receive` raise `ray.exceptions.TaskCancelledError` instead of returning
    `http.disconnect`, which Starlette would log as a crash; as the disconnect it is, the usual cancellation
    path (close the engine stream, free the slot) runs quietly."""

    def __init__(self, app, limit):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit()
        too_large = f"request body exceeds {limit} bytes"
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await send_error(send, 413, too_large, "body")
        seen, rejected = 0, False

        async def counting_receive():
            nonlocal seen, rejected
            try:
                message = await receive()
            except Exception:  # not CancelledError (a BaseException): our own cancellation still propagates
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit and not rejected:  # answer 413 now; the app sees the client leave
                    rejected = True
                    await send_error(send, 413, too_large, "body")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not rejected:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)


class CountResponses:
    """Count responses by model (set by the route in `request.state.model`), route and status."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [0]

        async def tracking_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:  # Starlette's outermost middleware turns it into the 500 response
            status[0] = status[0] or 500
            raise
        finally:
            model = (scope.get("state") or {}).get("model", "none")
            metrics.count_http(model, _route_label(scope), status[0] or 499)


def _route_label(scope) -> str:
    """The path template of the route a request is for. The router sets it; a middleware's own answer (413,
    401, the start-up 503) comes before routing, so then it is matched here as the router would: the first
    full match, else the first of another method (its 405)."""
    route = scope.get("route")
    if route is None and "app" in scope:
        route = _match(scope["app"].router.routes, scope)
    return getattr(route, "path", None) or "unmatched"


def _match(routes, scope):
    first: dict[Match, object] = {}
    for r in routes:
        first.setdefault(r.matches(scope)[0], r)
    route = first.get(Match.FULL) or first.get(Match.PARTIAL)
    # FastAPI keeps an included router whole, matching for its routes (our routers have no prefix)
    inner = getattr(getattr(route, "original_router", None), "routes", None)
    return route if inner is None else _match(inner, scope)


class StartupGate:
    """While `startup()` is not ready, answer every path outside `open_paths` with 503, Retry-After and
    the start-up state, at once (a request would otherwise wait for models that are still loading)."""

    def __init__(self, app, startup, open_paths: tuple[str, ...], open_prefixes: tuple[str, ...]):
        self.app, self.startup = app, startup
        self.open_paths, self.open_prefixes = set(open_paths), open_prefixes

    async def __call__(self, scope, receive, send):
        state = self.startup()
        path = route_path(scope)
        if (scope["type"] != "http" or state.ready or path in self.open_paths
                or path.startswith(self.open_prefixes)):
            return await self.app(scope, receive, send)
        snap = state.snapshot()
        why = f"failed to start: {snap['error']}" if state.error else f"{snap['phase']} ({snap['elapsed_s']} s)"
        await send_error(send, 503, f"the service is not ready: {why}; retry after {RETRY_AFTER_S} s",
                         headers={"retry-after": str(RETRY_AFTER_S)}, startup=snap)


def route_path(scope) -> str:
    """The path below the mount: under a Serve route prefix the proxy keeps the prefix in "path" (and in
    "root_path"), so "/prefix/readyz" must match "/readyz" as Starlette's routing does."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):] or "/"
    return path
