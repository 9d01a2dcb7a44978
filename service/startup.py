"""Start-up state of a replica: which phase it is in, how long it has taken, and each model's state, behind
`/readyz` and the fast 503s of a replica still loading (docs/architecture.md, "Start-up")."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

RETRY_AFTER_S = 5  # what a client is told to wait while the replica starts


@dataclass
class Startup:
    phase: str = "starting"
    models: dict[str, str] = field(default_factory=dict)  # model id -> state
    ready: bool = False
    error: str | None = None
    t0: float = field(default_factory=time.monotonic)
    ready_s: float | None = None
    # Serve's request router learns readiness from `routing_report` (service/routing.py), once a period:
    # None = nothing reads it (no such router); False until a report said "ready", then True
    routed: bool | None = None
    # model id -> what a replica that is ready builds behind its requests (its compiled steps): until
    # that ends it serves slower, and throughput measured then is not the steady state's
    warming: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set(self, phase: str, model: str | None = None, state: str | None = None) -> None:
        """Enter `phase`; with `model`, also record that model's state (default: the phase)."""
        with self._lock:
            self.phase = phase
            if model is not None:
                self.models[model] = state or phase

    def model(self, model: str, state: str) -> None:
        with self._lock:
            self.models[model] = state

    def done(self) -> None:
        with self._lock:
            self.ready, self.phase = True, "ready"
            self.ready_s = time.monotonic() - self.t0

    @contextlib.contextmanager
    def warming_up(self, model: str, work: str) -> Iterator[None]:
        """`model` listed under `warming` while the block runs, however it ends (a cancelled build too)."""
        with self._lock:
            self.warming[model] = work
        try:
            yield
        finally:
            with self._lock:
                self.warming.pop(model, None)

    def fail(self, error: str) -> None:
        with self._lock:
            self.error, self.phase = error, "failed"

    def routing_report(self) -> bool:
        """Readiness as the router will see it (called by the replica's `record_routing_stats`)."""
        with self._lock:
            self.routed = self.ready
            return self.ready

    @property
    def serving(self) -> bool:
        """Ready, and where a router routes by readiness, known ready to it: before that, requests the
        router still spreads over loading replicas would get 503s while `/readyz` said 200."""
        return self.ready and self.routed is not False

    @property
    def elapsed_s(self) -> float:
        return self.ready_s if self.ready_s is not None else time.monotonic() - self.t0

    def snapshot(self) -> dict:
        with self._lock:
            serving = self.serving
            phase = "ready; waiting for the request router to see it" if self.ready and not serving else self.phase
            body = {"ready": serving, "phase": phase, "elapsed_s": round(self.elapsed_s, 1),
                    "models": dict(self.models), "warming": dict(self.warming)}
            if self.error:
                body["error"] = self.error
            return body


def watch_startup(url: str, stop: threading.Event, t0: float, say: Callable[..., None] = print,
                  poll_s: float = 0.5, timeout_s: float | None = None) -> bool:
    """Poll `url`/readyz, printing each new phase and model state with the elapsed time (from `t0`), until
    it answers 200 (True), or `stop` is set or `timeout_s` has passed (False). With several replicas
    the answers alternate between them: each line is printed once, when the first replica reaches it."""
    import httpx

    seen: set[tuple[str, str]] = set()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
        try:
            r = httpx.get(url + "/readyz", timeout=5)
            body = r.json()
        except (httpx.HTTPError, ValueError):
            body, r = {"phase": "waiting for the HTTP proxy"}, None
        lines = {"phase": body.get("phase", "?"), **{f"  {m}": s for m, s in (body.get("models") or {}).items()}}
        if body.get("error"):
            lines["error"] = f"start-up failed: {body['error']} (Serve restarts the replica)"
        for key, text in lines.items():
            if (key, text) not in seen:
                seen.add((key, text))
                label = "" if key in ("phase", "error") else f"{key.strip()}: "
                say(f"[{time.monotonic() - t0:6.1f} s] {'  ' if label else ''}{label}{text}", flush=True)
        if r is not None and r.status_code == 200:
            return True
        stop.wait(poll_s)
    return False
