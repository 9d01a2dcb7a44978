"""Optional API keys: `Authorization: Bearer <key>` on every endpoint except health, readiness,
metrics and the playground page.

Keys come from `ATTNSERVE_API_KEYS` (comma-separated) and/or `ATTNSERVE_API_KEYS_FILE` (one key per
line, `#` comments). With no key configured, authentication is off. Keys are compared as SHA-256
digests with `hmac.compare_digest`, against every configured key, so the time taken does not depend
on how much of a guess matches or on which key matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from service.api.errors import send_error
from service.api.middleware import route_path

ENV_KEYS = "ATTNSERVE_API_KEYS"
ENV_KEYS_FILE = "ATTNSERVE_API_KEYS_FILE"
# "/" = the playground page; /health and /version are open in vLLM too (probes)
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/", "/health", "/version"})
OPEN_PREFIXES = ("/static/",)  # the playground's assets
REALM = 'Bearer realm="attnserve"'


def load_keys(env: Mapping[str, str] | None = None) -> list[str]:
    """The configured keys (possibly none). A key file that is named but unreadable is an error:
    starting without authentication by mistake would be worse than not starting."""
    env = os.environ if env is None else env
    keys = [k.strip() for k in env.get(ENV_KEYS, "").split(",")]
    if path := env.get(ENV_KEYS_FILE, "").strip():
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{ENV_KEYS_FILE}={path!r} cannot be read: {e}") from None
        keys += [ln.strip() for ln in lines if not ln.strip().startswith("#")]
    return [k for k in keys if k]


class KeySet:
    """Configured keys, kept as digests; `matches` compares in constant time."""

    def __init__(self, keys: list[str]):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def matches(self, candidate: str) -> bool:
        d = hashlib.sha256(candidate.encode("utf-8", "surrogatepass")).digest()
        return any([hmac.compare_digest(d, ref) for ref in self._digests])  # a list: every key is compared


def _bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            try:  # a key with non-ASCII characters, as clients send it (UTF-8), else byte for byte
                text = value.decode("utf-8")
            except UnicodeDecodeError:
                text = value.decode("latin-1")
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else ""
    return None


class ApiKeyAuth:
    """ASGI middleware: 401 + `WWW-Authenticate` unless the request carries a configured key.
    `keys()` is read per request, so keys can be swapped on a running app (None = off)."""

    def __init__(self, app, keys: Callable[[], KeySet | None]):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        keys = self.keys() if scope["type"] == "http" else None
        path = route_path(scope)  # under a Serve route prefix too
        if keys is None or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        token = _bearer(scope.get("headers") or [])
        if token is None:
            return await send_error(send, 401, "missing API key: send the header 'Authorization: Bearer <key>'",
                                    "authorization", {"www-authenticate": REALM})
        if not token or not keys.matches(token):
            return await send_error(send, 401, "invalid API key", "authorization",
                                    {"www-authenticate": REALM + ', error="invalid_token"'})
        return await self.app(scope, receive, send)
