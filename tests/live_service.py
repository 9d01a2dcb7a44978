"""The real attnserve FastAPI app with the real engines, served by uvicorn in a subprocess on a free
loopback port, without Ray: the live target of the load-test smoke run and the browser test (Locust and
Chromium talk to it over real HTTP, from processes that never import Ray).

Models: `generator="tiny"` is a random tiny Llama (fast, nonsense text); `"smollm2"` is the real
SmolLM2-135M-Instruct (fetched and converted on first use). The translator is the shipped checkpoint when
weights/attnserve-zh-en exists, else a random tiny encoder-decoder.

    with live_service() as url: ...                              # in tests
    python tests/live_service.py --port 8123 --generator smollm2   # by hand
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtests.ports import free_port, stop_server

ROOT = Path(__file__).resolve().parent.parent



@contextlib.contextmanager
def live_service(generator: str = "tiny", startup_timeout_s: float = 180.0, log_path: Path | None = None):
    """Starts the service subprocess, waits for /readyz, yields its base URL, then stops it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), OMP_NUM_THREADS="1")
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--port", str(port),
                             "--generator", generator], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"service exited with {proc.returncode} before it was ready")
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"service not ready after {startup_timeout_s:.0f} s")
            time.sleep(0.3)
        yield url
    finally:
        stop_server(proc, timeout_s=20)
        if log is not subprocess.DEVNULL:
            log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--generator", choices=["tiny", "smollm2"], default="tiny")
    args = p.parse_args()
    import torch
    import uvicorn
    from api_util import backends, translator  # tests/ is on sys.path when run as a script

    from model.paths import SHIPPED_TRANSLATOR
    from service import models
    from service.api.app import create_app
    from service.config import ModelSpec
    from service.metrics import EngineMetrics

    torch.set_num_threads(1)
    b = backends()
    if args.generator == "smollm2":
        engine = {"max_slots": 8, "max_seq_len": 1024}
        b.generator = models.load_generator(ModelSpec(device="cpu", dtype="float32", engine=engine), EngineMetrics())
    if (SHIPPED_TRANSLATOR / "config.json").is_file():
        b.translator = models.load_translator(ModelSpec(device="cpu", dtype="float32"), EngineMetrics())
    elif b.translator is None:
        b.translator = translator()
    app = create_app(b, manage_engines=True)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
