"""Disconnects: hundreds of clients drop their requests mid-way, streamed (after the first chunk) and
non-streamed (after a random delay), while a few well-behaved clients run alongside. Afterwards the
engine must hold no request (running = 0, KV cache usage = 0 on /metrics), every well-behaved request
must have completed correctly, and the replica logs must show no traceback.

    PYTHONPATH=. .venv/bin/python -m loadtests.reliability.disconnects --out results/reliability/disconnects.json
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import random
import time
from pathlib import Path

import httpx

from loadtests.reliability.tiny_service import TinyServiceConfig, ray_logs_dir, report, scrape, tiny_service

LONG = {"prompt": "tell me a long story", "max_tokens": 100, "ignore_eos": True, "temperature": 0.8}
GOOD = {"prompt": "hello", "max_tokens": 16, "ignore_eos": True, "temperature": 0}


def tracebacks() -> int:
    """Tracebacks in this Ray session's worker and Serve logs (a crash in a replica prints one)."""
    n = 0
    for path in glob.glob(f"{glob.escape(str(ray_logs_dir()))}/**/*", recursive=True):
        if path.endswith((".log", ".out", ".err")):
            try:
                with open(path, errors="replace") as f:
                    n += f.read().count("Traceback (most recent call last)")
            except OSError:
                pass
    return n


async def drop_stream(c: httpx.AsyncClient) -> str:
    async with c.stream("POST", "/v1/generate", json={**LONG, "stream": True}) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        async for _ in r.aiter_bytes():
            return "dropped"  # leaving the block closes the connection mid-stream
    return "finished"


async def drop_unary(c: httpx.AsyncClient, rng: random.Random) -> str:
    try:
        await asyncio.wait_for(c.post("/v1/generate", json=LONG), timeout=rng.uniform(0.05, 0.5))
        return "finished"
    except TimeoutError:
        return "dropped"


async def good(c: httpx.AsyncClient, stop: asyncio.Event, results: list) -> None:
    while not stop.is_set():
        r = await c.post("/v1/generate", json=GOOD)
        results.append(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == GOOD["max_tokens"])


async def run(url: str, n: int, concurrency: int) -> dict:
    rng = random.Random(0)
    cancelled_before = scrape(url, "attnserve_request_success_total", finished_reason="cancelled")
    length_before = scrape(url, "attnserve_request_success_total", finished_reason="length")
    tb_before = tracebacks()
    outcomes: dict[str, int] = {}
    good_results: list = []
    sem = asyncio.Semaphore(concurrency)
    t0 = time.monotonic()
    # a fresh connection per dropper (closing a pooled connection is what a vanishing client does)
    async with httpx.AsyncClient(base_url=url, timeout=60) as keeper:
        async def one(i: int):
            async with sem, httpx.AsyncClient(base_url=url, timeout=60) as c:
                kind = await (drop_stream(c) if i % 2 == 0 else drop_unary(c, rng))
                key = ("stream " if i % 2 == 0 else "unary ") + kind
                outcomes[key] = outcomes.get(key, 0) + 1

        stop = asyncio.Event()
        good_tasks = [asyncio.create_task(good(keeper, stop, good_results)) for _ in range(2)]
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), timeout=300)
        stop.set()  # the good clients stop after their current request
        await asyncio.wait_for(asyncio.gather(*good_tasks), timeout=60)
    drop_s = time.monotonic() - t0
    deadline, running, kv, waiting = time.monotonic() + 30, None, None, None
    while time.monotonic() < deadline:
        running = scrape(url, "attnserve_num_requests_running")
        kv = scrape(url, "attnserve_kv_cache_usage_ratio")
        waiting = scrape(url, "attnserve_num_requests_waiting")
        if running == 0 and kv == 0 and waiting == 0:
            break
        await asyncio.sleep(0.5)
    settle_s = time.monotonic() - t0 - drop_s
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        after = await c.post("/v1/generate", json=GOOD)
    # let the log monitor flush and Ray's metrics export catch up (GET /metrics lags by its 2 s report
    # interval; seconds_to_zero_after_last_drop includes that lag)
    await asyncio.sleep(6)
    return {"dropped_clients": n, "outcomes": outcomes, "drop_phase_s": round(drop_s, 1),
            "engine_cancelled": scrape(url, "attnserve_request_success_total", finished_reason="cancelled")
            - cancelled_before,
            "engine_finished_length": scrape(url, "attnserve_request_success_total", finished_reason="length")
            - length_before,
            "running_after": running, "waiting_after": waiting, "kv_usage_after": kv,
            "seconds_to_zero_after_last_drop": round(settle_s, 1),
            "well_behaved_requests": len(good_results), "well_behaved_ok": sum(good_results),
            "request_after_ok": after.status_code == 200, "new_tracebacks_in_ray_logs": tracebacks() - tb_before}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=300, help="clients that disconnect (half streamed, half not)")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with tiny_service(TinyServiceConfig(max_waiting=64)) as url:
        result = asyncio.run(run(url, args.n, args.concurrency))
    report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
