"""Overload: offer 3x the load the service sustains and check that it sheds the excess quickly.

1. Calibrate: a closed loop of `slots + waiting` concurrent clients for `--calibrate-s` measures the
   sustainable rate R (completed requests/s with nothing rejected).
2. Offer `--factor` x R as open-loop Poisson arrivals for `--duration-s`.
Reports offered / admitted (200) / rejected (429 or 503, with or without Retry-After) / other,
latency percentiles of admitted and of rejected requests, and the RSS of the replicas and of all Ray
processes sampled once a second (memory must stay bounded).

    PYTHONPATH=. .venv/bin/python -m loadtests.reliability.overload --out results/reliability/overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import httpx

from loadtests.reliability.tiny_service import (
    TinyServiceConfig,
    percentile,
    replica_pids,
    report,
    rss_mb,
    serve_pids,
    tiny_service,
)

BODY = {"prompt": "hello world", "max_tokens": 32, "ignore_eos": True, "temperature": 0}
MAX_IN_FLIGHT = 2000  # client-side bound on outstanding requests


async def one_request(c: httpx.AsyncClient, records: list) -> None:
    """Send BODY once -> (status or error name, seconds, Retry-After sent, a complete answer) in `records`."""
    t0 = time.monotonic()
    try:
        r = await c.post("/v1/generate", json=BODY)
        try:
            ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
        except (ValueError, KeyError, TypeError):  # admitted but malformed: a wrong answer, not a lost record
            ok = False
        records.append((r.status_code, time.monotonic() - t0, "retry-after" in r.headers, ok))
    except httpx.HTTPError as e:
        records.append((type(e).__name__, time.monotonic() - t0, False, False))


async def calibrate(url: str, concurrency: int, seconds: float) -> float:
    records: list = []
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async def worker():
            while time.monotonic() < end:
                await one_request(c, records)
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - t0
    done = sum(1 for r in records if r[0] == 200)
    return done / elapsed


async def offer(url: str, rate: float, seconds: float, rss_samples: list) -> list:
    records: list = []
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=MAX_IN_FLIGHT, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        tasks: set = set()
        t0 = time.monotonic()
        next_at, next_rss = t0, t0
        pids_r, pids_all = replica_pids(), serve_pids()
        while time.monotonic() - t0 < seconds:
            now = time.monotonic()
            if now >= next_rss:
                rss_samples.append((round(now - t0, 1), rss_mb(pids_r), rss_mb(pids_all)))
                next_rss += 1.0
            if now >= next_at:
                if len(tasks) < MAX_IN_FLIGHT:
                    t = asyncio.create_task(one_request(c, records))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
                else:
                    records.append(("client_cap", 0.0, False, False))
                next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, min(next_at, next_rss) - time.monotonic()))
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=120)
        rss_samples.append((round(time.monotonic() - t0, 1), rss_mb(pids_r), rss_mb(pids_all)))
    return records


def summarize(rate: float, factor: float, seconds: float, records: list, rss: list) -> dict:
    statuses = Counter(str(r[0]) for r in records)
    admitted = [r[1] for r in records if r[0] == 200]
    rejected = [r for r in records if r[0] in (429, 503)]
    return {
        "sustainable_req_s": round(rate, 2), "factor": factor, "offered_req_s": round(rate * factor, 2),
        "duration_s": seconds, "offered": len(records), "statuses": dict(statuses),
        "admitted": len(admitted), "admitted_correct": sum(1 for r in records if r[3]),
        "rejected": len(rejected), "rejected_with_retry_after": sum(1 for r in rejected if r[2]),
        "admitted_latency_s": {q: round(percentile(admitted, q) or 0, 3) for q in (50, 90, 99)},
        "rejected_latency_s": {q: round(percentile([r[1] for r in rejected], q) or 0, 3) for q in (50, 99)},
        "replica_rss_mb": {"first": round(rss[0][1]), "max": round(max(s[1] for s in rss)), "last": round(rss[-1][1])},
        "all_ray_rss_mb": {"first": round(rss[0][2]), "max": round(max(s[2] for s in rss)), "last": round(rss[-1][2])},
    }


async def run(url: str, args) -> dict:
    concurrency = args.max_slots + args.max_waiting
    await calibrate(url, concurrency, 3)  # warm-up
    rate = await calibrate(url, concurrency, args.calibrate_s)
    if rate <= 0:  # nothing answered 200 while calibrating: there is no rate to offer a multiple of
        raise RuntimeError(f"calibration over {args.calibrate_s} s completed no request")
    rss: list = []
    records = await offer(url, rate * args.factor, args.duration_s, rss)
    return summarize(rate, args.factor, args.duration_s, records, rss)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--calibrate-s", type=float, default=8.0)
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--max-slots", type=int, default=4)
    p.add_argument("--max-waiting", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cfg = TinyServiceConfig(max_slots=args.max_slots, max_waiting=args.max_waiting)
    with tiny_service(cfg) as url:
        result = asyncio.run(run(url, args))
    report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
