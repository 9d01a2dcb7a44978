"""HTTP + Ray Serve overhead (issue 6): engine-only output tok/s vs. the same load through `attnserve serve`.

One run, two phases on the same Serve config (same checkpoint, engine config, dtype and threads):
1. engine only: a subprocess builds the generator exactly as a replica does (`service.models.load_generator`
   on the config's generator spec) and N closed-loop asyncio clients call the engine in-process;
2. service: `attnserve serve --config ... --port ...` in a subprocess (Ray + Serve on 127.0.0.1), wait
   for /readyz, the same N clients send the same requests with httpx as streaming /v1/completions
   (`ignore_eos`, `stream_options.include_usage`), then SIGTERM and wait for a clean exit.
Prompts are the user messages of loadtests/data/prompts.jsonl (raw text, cycled), every request asks
for exactly --max-tokens greedy tokens. Output tok/s = completion tokens / wall time of the phase
(after one warm-up request). Prints both, TTFT p50, and the ratio (issue 6's goal: >= 80 %).

    python -m benchmarks.bench_overhead --clients 16 --requests 64 --max-tokens 128
    python -m benchmarks.bench_overhead --tiny --clients 2 --requests 4 --max-tokens 8   # validation only

Refuses to start when another Ray instance is running on this machine (it would share the cores, and
a stray `ray.init` must never attach to someone else's cluster); ATTNSERVE_ALLOW_OTHER_RAY=1 starts a
separate one beside it instead (validation runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from model.progress import progress, write_line

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "loadtests" / "data" / "prompts.jsonl"


def prompts(n: int) -> list[str]:
    users = [m["content"] for line in PROMPTS.read_text().splitlines() if line.strip()
             for m in json.loads(line)["messages"] if m["role"] == "user"]
    return [users[i % len(users)] for i in range(n)]


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def app_args(config: Path) -> dict:
    return yaml.safe_load(config.read_text())["applications"][0]["args"]


async def closed_loop(clients: int, texts: list[str], one) -> tuple[float, int, list[float]]:
    """Run `one(text) -> (ttft, completion tokens)` from `clients` concurrent loops; (wall, tokens, ttfts)."""
    queue = list(reversed(texts))
    ttft: list[float] = []
    tokens = 0

    async def client():
        nonlocal tokens
        while queue:
            t, n = await one(queue.pop())
            ttft.append(t)
            tokens += n

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - t0, tokens, ttft


# --- phase 1: engine only (subprocess) -----------------------------------------------------------

async def engine_phase(args) -> dict:
    from service.config import ServiceConfig
    from service.engine.cpu_runtime import single_threaded_caller
    from service.engine.types import GenerateRequest, SamplingParams
    from service.models import load_generator

    single_threaded_caller()  # as in a replica: only the engine thread runs torch in parallel
    gen = load_generator(ServiceConfig.from_dict(app_args(Path(args.config))).generator)
    await gen.start()

    async def one(text: str) -> tuple[float, int]:
        t0, first, n = time.perf_counter(), None, 0
        req = GenerateRequest(gen.encode_prompt(text), SamplingParams(max_new_tokens=args.max_tokens,
                                                                      temperature=0.0, ignore_eos=True))
        async for ev in gen.submit(req):
            if ev.text and first is None:
                first = time.perf_counter() - t0
            if ev.finished:
                n = ev.usage.completion_tokens
        return first if first is not None else float("nan"), n

    await one("warm-up")
    wall, tokens, ttft = await closed_loop(args.clients, prompts(args.requests), one)
    await gen.stop()
    cfg = gen.engine.config
    return dict(wall_s=wall, tokens=tokens, ttft=ttft, dtype=cfg.dtype, threads=cfg.threads, slots=cfg.max_slots)


# --- phase 2: the service over HTTP --------------------------------------------------------------

START_RETRIES = 5  # 503s (a replica still loading) retried one second apart

async def http_phase(args, url: str) -> dict:
    import httpx

    from loadtests.sse import parse_sse_line

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as http:
        async def one(text: str) -> tuple[float, int]:
            body = {"prompt": text, "max_tokens": args.max_tokens, "temperature": 0.0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            for attempt in range(START_RETRIES + 1):
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    # /readyz can answer from one replica before Serve's router has learnt that it is ready
                    # (routing stats come each second), so a request may still meet a replica that is
                    # loading: it answers 503 with Retry-After, and a client retries, as the OpenAI SDK does
                    if r.status_code == 503 and attempt < START_RETRIES:
                        await asyncio.sleep(1.0)
                        continue
                    if r.status_code != 200:
                        raise RuntimeError(f"/v1/completions answered {r.status_code}: {(await r.aread())[:300]!r}")
                    return await read_stream(r, t0)

        async def read_stream(r, t0: float) -> tuple[float, int]:
            first, n = None, 0
            async for line in r.aiter_lines():
                c = parse_sse_line(line)
                if c is None:
                    continue
                if c.error:
                    raise RuntimeError(f"stream error: {c.error}")
                if c.text and first is None:
                    first = time.perf_counter() - t0
                if c.usage_completion_tokens is not None:
                    n = c.usage_completion_tokens
            return first if first is not None else float("nan"), n

        await one("warm-up")
        wall, tokens, ttft = await closed_loop(args.clients, prompts(args.requests), one)
    return dict(wall_s=wall, tokens=tokens, ttft=ttft)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, tick=None) -> None:
    """Poll /readyz each second; `tick()` between polls (a progress bar's refresh)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if tick:
            tick()
        if proc.poll() is not None:
            raise RuntimeError(f"attnserve serve exited with {proc.returncode} before /readyz answered 200")
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url}/readyz not 200 after {timeout_s:.0f} s")


def service_phase(args, tick=None) -> tuple[dict, float]:
    """(result, start-up seconds): start `attnserve serve`, measure, stop it with SIGTERM."""
    url = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log = open(args.serve_log, "w")  # closed in the finally below
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--config", args.config,
                             "--port", str(args.port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        wait_ready(url, proc, args.ready_timeout, tick)
        startup = time.perf_counter() - t0
        return asyncio.run(http_phase(args, url)), startup
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            print(f"attnserve serve (pid {proc.pid}) did not stop in 90 s; killing its process group",
                  file=sys.stderr)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


# --- driver --------------------------------------------------------------------------------------

def tiny_config(base: Path, tmp: Path) -> Path:
    """The base config pointed at random tiny checkpoints (validation runs): translator off, and the
    decode step eager (compiling it took longer than the whole rest of a validation run)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from serve_fixture import TEMPLATE, tiny_checkpoints

    gen, _ = tiny_checkpoints(tmp)
    config = yaml.safe_load(base.read_text())
    a = config["applications"][0]["args"]
    a["generator"].update(checkpoint=str(gen), chat_template=TEMPLATE)
    a["generator"]["engine"].update(max_seq_len=128, compile=False)
    a["translator"] = {"enabled": False}
    out = tmp / "serve_config.tiny.yaml"
    out.write_text(yaml.safe_dump(config))
    return out


def main() -> int:
    from service.ray_local import DEFAULT_CONFIG

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="Serve config used by both phases")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--serve-log", default=str(Path(tempfile.gettempdir()) / "attnserve-bench-overhead.log"))
    ap.add_argument("--tiny", action="store_true", help="random tiny checkpoints: validates the script only")
    ap.add_argument("--phase", choices=["engine"], help=argparse.SUPPRESS)  # internal: the engine-only child
    args = ap.parse_args()
    if args.phase == "engine":
        print(json.dumps(asyncio.run(engine_phase(args))))
        return 0
    from loadtests.reliability.tiny_service import ALLOW_OTHER_RAY, allow_other_ray, other_ray_running

    if other_ray_running():
        if not allow_other_ray():
            print(f"another Ray instance is running on this machine; stop it first (not touching it), or set "
                  f"{ALLOW_OTHER_RAY}=1 to start a separate one beside it (sharing the cores)", file=sys.stderr)
            return 2
        os.environ["RAY_ADDRESS"] = "local"  # `attnserve serve` starts a new Ray instance, never joins the other
    bar = progress(desc="bench_overhead", total=2, unit="phase")
    with tempfile.TemporaryDirectory(prefix="attnserve-overhead-") as tmp:
        if args.tiny:
            args.config = str(tiny_config(Path(args.config), Path(tmp)))
        bar.set_postfix_str("engine only")
        child = [sys.executable, "-m", "benchmarks.bench_overhead", "--phase", "engine", "--config", args.config,
                 "--clients", str(args.clients), "--requests", str(args.requests), "--max-tokens", str(args.max_tokens)]
        proc = subprocess.run(child, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            write_line(f"engine-only phase failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            return 1
        eng = json.loads(proc.stdout.strip().splitlines()[-1])
        bar.update(1)
        write_line(f"# engine only: {eng['tokens'] / eng['wall_s']:.1f} output tok/s", file=sys.stderr)
        bar.set_postfix_str("service: start-up, then the same load over HTTP")
        svc, startup = service_phase(args, tick=bar.refresh)
        bar.update(1)
    bar.close()
    e_tps, s_tps = eng["tokens"] / eng["wall_s"], svc["tokens"] / svc["wall_s"]
    print(f"Config: {args.config}{' (TINY random checkpoint: validation only)' if args.tiny else ''}; engine dtype "
          f"{eng['dtype']}, threads {eng['threads']}, {eng['slots']} slots; {args.clients} clients, {args.requests} "
          f"requests, {args.max_tokens} output tokens each (greedy, ignore_eos); service start-up to /readyz "
          f"{startup:.0f} s\n")
    print("| path | output tok/s | TTFT p50 / p95 (s) | completion tokens | wall (s) |")
    print("|---|---|---|---|---|")
    for name, r, tps in (("engine only (in-process)", eng, e_tps), ("service (HTTP, Ray Serve, SSE)", svc, s_tps)):
        print(f"| {name} | {tps:.1f} | {pct(r['ttft'], 0.5):.2f} / {pct(r['ttft'], 0.95):.2f} | {r['tokens']} "
              f"| {r['wall_s']:.1f} |")
    ratio = s_tps / e_tps
    print(f"\nservice / engine-only output tok/s = {ratio:.1%} (goal >= 80 %: {'met' if ratio >= 0.8 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
