"""Optional API keys: Bearer keys from env or file, 401 + WWW-Authenticate without a valid one,
health/readiness/metrics/playground open, every configured key compared, off when none configured."""

from __future__ import annotations

import hmac

import pytest
import torch
from api_util import backends, run

from service.api import auth
from service.api.app import create_app
from service.api.auth import KeySet, load_keys

torch.set_num_threads(1)
KEYS = ["key-one", "key-two"]
OPEN = ["/healthz", "/readyz", "/metrics", "/", "/static/app.js"]
PROTECTED = [("GET", "/v1/models", None), ("POST", "/v1/generate", {"prompt": "hi", "max_tokens": 2}),
             ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
             ("POST", "/v1/translate", {"text": "hi", "beam_size": 1, "max_length": 3}),
             ("GET", "/openapi.json", None), ("GET", "/docs", None), ("GET", "/v1/unknown", None)]


def test_load_keys_from_env_and_file(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("# ops team\nfile-key-1\n\n  file-key-2  \n")
    assert load_keys({}) == []
    assert load_keys({"ATTNSERVE_API_KEYS": " a, b ,,"}) == ["a", "b"]
    assert load_keys({"ATTNSERVE_API_KEYS": "a", "ATTNSERVE_API_KEYS_FILE": str(f)}) == ["a", "file-key-1",
                                                                                       "file-key-2"]
    with pytest.raises(ValueError, match="ATTNSERVE_API_KEYS_FILE"):
        load_keys({"ATTNSERVE_API_KEYS_FILE": str(tmp_path / "missing.txt")})
    assert load_keys({"ATTNSERVE_API_KEYS": " , "}) == []


def test_every_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = KeySet(["first", "second-longer-key", "third"])
    assert keys.matches("first") and keys.matches("third") and not keys.matches("firs") and not keys.matches("")
    # 4 checks x 3 keys, whichever key matched; digests make every comparison the same length
    assert len(calls) == 12 and set(calls) == {(32, 32)}


def test_keys_required_except_open_paths():
    async def main(c):
        for path in OPEN:
            r = await c.get(path)
            assert r.status_code == 200, (path, r.status_code)  # the app serves service/static by default
        assert (await c.get("/healthz")).status_code == 200
        for method, path, body in PROTECTED:
            r = await c.request(method, path, json=body)
            assert r.status_code == 401, (path, r.status_code)
            assert r.headers["www-authenticate"] == 'Bearer realm="attnserve"'
            assert r.json()["error"]["type"] == "authentication_error" and "Bearer" in r.json()["error"]["message"]
        for header in ["Bearer wrong", "Bearer ", "Basic a2V5LW9uZQ==", "key-one", "Bearer key-one-extra"]:
            r = await c.get("/v1/models", headers={"Authorization": header})
            assert r.status_code == 401, header
            assert "invalid_token" in r.headers["www-authenticate"] or "missing" in r.json()["error"]["message"]
        for key in KEYS:
            for method, path, body in PROTECTED[:5]:
                r = await c.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, (path, r.text)
        r = await c.get("/v1/models", headers={"authorization": "bearer key-two"})
        assert r.status_code == 200
        c.app.state.api_keys = None  # switched off on the running app
        assert (await c.get("/v1/models")).status_code == 200
    run(main, backends(), api_keys=KEYS)


def test_a_key_with_non_ascii_characters_matches_as_clients_send_it():
    async def main(c):
        for raw in ("Bearer clé".encode(), "Bearer clé".encode("latin-1")):  # UTF-8 (curl, httpx), Latin-1
            r = await c.get("/v1/models", headers=[(b"authorization", raw)])
            assert r.status_code == 200, raw
        r = await c.get("/v1/models", headers=[(b"authorization", b"Bearer cle")])
        assert r.status_code == 401
    run(main, backends(), api_keys=["sekret", "clé"])


def test_off_without_keys_and_configured_from_env(monkeypatch, tmp_path):
    monkeypatch.delenv("ATTNSERVE_API_KEYS", raising=False)
    monkeypatch.delenv("ATTNSERVE_API_KEYS_FILE", raising=False)
    assert create_app(backends(with_translator=False)).state.api_keys is None
    f = tmp_path / "keys"
    f.write_text("from-file\n")
    monkeypatch.setenv("ATTNSERVE_API_KEYS_FILE", str(f))

    async def main(c):
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer from-file"})).status_code == 200
    run(main, backends(with_translator=False))


def test_openai_client_sends_its_api_key():
    import openai
    from live_app import serve_in_thread

    app = create_app(backends(with_translator=False), manage_engines=True, api_keys=["sk-test"])
    with serve_in_thread(app) as url:
        good = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=30)
        out = good.completions.create(model="smollm2-135m-instruct", prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens <= 2
        bad = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_cors_off_by_default_and_allowed_origins_pass_preflight_before_the_key():
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def off(c):
        r = await c.options("/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = await c.post("/v1/chat/completions", json=body, headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    run(off, backends(with_translator=False), api_keys=[])

    async def on(c):
        r = await c.options("/v1/chat/completions", headers=preflight)  # no key: a browser's preflight has none
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "POST" in r.headers["access-control-allow-methods"]
        other = await c.options("/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        r = await c.post("/v1/chat/completions", json=body, headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 401  # the key is still required for the request itself
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"  # so the page can read why
        r = await c.post("/v1/chat/completions", json=body,
                         headers={"Origin": "http://localhost:3000", "Authorization": f"Bearer {KEYS[0]}"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    run(on, backends(with_translator=False), api_keys=KEYS, cors_origins=["http://localhost:3000"])


def test_cors_origins_in_the_service_config():
    from service.config import ServiceConfig

    assert ServiceConfig.from_dict({}).cors_allowed_origins == []
    assert ServiceConfig.from_dict({"cors_allowed_origins": ["*"]}).cors_allowed_origins == ["*"]
    with pytest.raises(ValueError, match="cors_allowed_origins"):
        ServiceConfig.from_dict({"cors_allowed_origins": "http://a"})
    with pytest.raises(ValueError, match="cors_allowed_origins"):
        ServiceConfig.from_dict({"cors_allowed_origins": [""]})


def test_open_paths_stay_open_under_a_route_prefix():
    # Serve's proxy keeps the route prefix in "path" and in "root_path" (the /batched app)
    async def main(c):
        for path in ["/healthz", "/metrics", "/"]:
            r = await c.get("/batched" + path)
            assert r.status_code == 200, (path, r.status_code)
        assert (await c.get("/batched/v1/models")).status_code == 401
        r = await c.get("/batched/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"})
        assert r.status_code == 200
    run(main, backends(with_translator=False), api_keys=KEYS, root_path="/batched")
