"""The FastAPI application. The same object serves under Ray Serve (as the ingress deployment's
ASGI app) and without Ray (tests with httpx's ASGITransport, or plain uvicorn)."""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from service import metrics
from service.api import errors, native, openai_routes, vllm_compat
from service.api.auth import OPEN_PREFIXES, ApiKeyAuth, KeySet, load_keys
from service.api.backends import Backends
from service.api.middleware import BodyLimit, CountResponses, StartupGate
from service.api.streaming import ClientDisconnected
from service.config import ApiLimits
from service.startup import RETRY_AFTER_S, Startup

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"


def create_app(backends: Backends, limits: ApiLimits | None = None, *, static_dir: Path | None = STATIC_DIR,
               manage_engines: bool = False, api_keys: list[str] | None = None,
               startup: Startup | None = None, cors_origins: list[str] | None = None) -> FastAPI:
    """`manage_engines`: start/stop the engines in the app's lifespan (plain uvicorn); under Ray Serve
    and in tests the owner starts them. `api_keys`: None = from ATTNSERVE_API_KEYS(_FILE); [] = off.
    `startup`: the replica's start-up state while it loads models (None = already loaded). `cors_origins`:
    origins allowed to call from a browser (`ServiceConfig.cors_allowed_origins`; None or [] = no CORS)."""
    lifespan = None
    if manage_engines:
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(_app):
            await backends.start()
            yield
            await backends.stop()

    app = FastAPI(title="attnserve", version="0.1.0", lifespan=lifespan,
                  description="From-scratch Transformers behind Ray Serve: native and OpenAI-compatible API.")
    app.state.backends = backends
    app.state.startup = startup or Startup(phase="ready", ready=True, ready_s=0.0)  # engines loaded already
    app.state.limits = limits or ApiLimits()
    app.state.created = int(time.time())
    keys = load_keys() if api_keys is None else api_keys
    app.state.api_keys = KeySet(keys) if keys else None  # no keys: authentication off
    errors.install(app)
    app.include_router(native.router)
    app.include_router(openai_routes.router)
    app.include_router(vllm_compat.router)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected):
        return Response(status_code=499)

    @app.get("/healthz", tags=["ops"])
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz():
        """200 once the models are loaded and the generator serves (the translator, where the config disables
        the generator); until then 503 with the start-up phase, its elapsed time and each model's state."""
        b: Backends = app.state.backends
        body = app.state.startup.snapshot()
        body["ready"] = body["ready"] and b.serving
        if app.state.startup.serving:
            body["models"] = {**{n: body["models"].get(n, "ready") for n in b.ids()},
                              **{n: f"unavailable: {why}" for n, why in b.unavailable.items()}}
            if not b.serving:  # start-up is over, yet this 503 lasts: not "ready"
                body["phase"] = "loaded, but not serving: a model it serves did not load (see models)"
        body["unavailable"] = b.unavailable
        return JSONResponse(body, status_code=200 if body["ready"] else 503,
                            headers=None if body["ready"] else {"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/metrics", tags=["ops"])
    async def prometheus():
        data, content_type = await metrics.render()
        return Response(data, media_type=content_type)

    if static_dir is not None and static_dir.is_dir():
        app.mount("/static", StaticFiles(directory=static_dir), name="static")
        index = static_dir / "index.html"

        @app.get("/", include_in_schema=False)
        async def playground():
            if not index.is_file():
                return errors.error_response(404, "playground page not installed")
            return FileResponse(index)

    app.add_middleware(StartupGate, startup=lambda: app.state.startup,
                       open_paths=("/healthz", "/readyz", "/metrics", "/version", "/", "/docs", "/openapi.json"),
                       open_prefixes=OPEN_PREFIXES)
    app.add_middleware(ApiKeyAuth, keys=lambda: app.state.api_keys)  # inside CountResponses: 401s are counted
    app.add_middleware(BodyLimit, limit=lambda: app.state.limits.max_body_bytes)
    app.add_middleware(CountResponses)  # outside BodyLimit: 413s are counted
    if cors_origins:  # outermost: a browser's preflight carries no API key and must not meet the 401
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    return app
