"""A FastAPI app served by uvicorn in a background thread on 127.0.0.1 (real HTTP, no Ray, no
subprocess), for tests that need a URL: the schema fuzz and the auth tests."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import uvicorn

from loadtests.ports import free_port


@contextmanager
def serve_in_thread(app, start_timeout_s: float = 30.0):
    """Yield the base URL of `app` served on loopback; stop the server (bounded wait) on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=5,
                                           # uvicorn's 5 s default closes idle pooled connections while
                                           # a client may be reusing one (a race seen as "server
                                           # disconnected"); tests keep connections idle for longer.
                                           timeout_keep_alive=120))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
