"""Replica crash: SIGKILL one of two replicas in the middle of a closed-loop load and measure what
fails and how long until Serve has restarted it.

Reports the requests that failed (status or client error, with their times relative to the kill),
seconds until the Serve controller reports both replicas RUNNING again, seconds until a request
succeeded on the new replica process, and completed requests per second before / during / after.

    PYTHONPATH=. .venv/bin/python -m loadtests.reliability.replica_kill --out results/reliability/replica_kill.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from collections import Counter
from pathlib import Path

import httpx

from loadtests.reliability.tiny_service import TinyServiceConfig, replica_pids, report, tiny_service

BODY = {"prompt": "hello world", "max_tokens": 16, "ignore_eos": True, "temperature": 0}
AFTER_RECOVERY_S = 5.0  # load kept on the recovered replicas at the least, for the rate after recovery


def replica_states() -> dict:
    """The Serve controller's view: replica state -> count (e.g. {"RUNNING": 1, "STARTING": 1})."""
    from ray import serve

    app = serve.status().applications.get("attnserve")
    if app is None or "AttnServe" not in app.deployments:
        return {}
    return {str(k): v for k, v in app.deployments["AttnServe"].replica_states.items()}


async def replicas_up(states: dict, timeout_s: float = 30.0) -> list[int]:
    """The replicas' PIDs once there is one process per replica the controller counts (titles are set a
    moment after a process starts)."""
    want = sum(states.values())
    deadline = time.monotonic() + timeout_s
    while True:
        pids = replica_pids()
        if pids and len(pids) == want:
            return pids
        if time.monotonic() > deadline:
            raise RuntimeError(f"found replica processes {pids}, expected {want} ({states})")
        await asyncio.sleep(0.5)


async def client(c: httpx.AsyncClient, stop: asyncio.Event, records: list) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            r = await c.post("/v1/generate", json=BODY)
            ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
            records.append((t0, time.monotonic(), r.status_code, ok, r.text[:160] if not ok else ""))
        except httpx.HTTPError as e:
            records.append((t0, time.monotonic(), type(e).__name__, False, str(e)[:160]))


async def run(url: str, users: int, kill_at_s: float, duration_s: float, recover_wait_s: float = 120.0) -> dict:
    records: list = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        tasks = [asyncio.create_task(client(c, stop, records)) for _ in range(users)]
        t0 = time.monotonic()
        await asyncio.sleep(kill_at_s)
        victims = await replicas_up(await asyncio.to_thread(replica_states))
        victim = victims[0]
        t_kill = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        back_s, timeline, last = None, [], None
        # the run lasts duration_s, longer while the replicas are not back (up to recover_wait_s more: a
        # busy host restarts a replica slowly), and AFTER_RECOVERY_S past their return at least
        end, limit = t0 + duration_s, t0 + duration_s + recover_wait_s
        while (now := time.monotonic()) < end or (back_s is None and now < limit):
            await asyncio.sleep(0.2)
            if back_s is None:
                states, pids = await asyncio.to_thread(replica_states), replica_pids()
                new = sorted(set(pids) - set(victims))
                if (states, new) != last:  # record each change of the controller's view or the processes
                    last = (states, new)
                    timeline.append((round(time.monotonic() - t_kill, 2), states, new))
                if new and states == {"RUNNING": len(victims)} and len(pids) == len(victims):
                    back_s = time.monotonic() - t_kill
                    end = max(end, time.monotonic() + AFTER_RECOVERY_S)
        stop.set()
        ran_s = time.monotonic() - t0
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        new_pids = replica_pids()
    failed = [r for r in records if not r[3]]

    def rate(a: float, b: float) -> float:  # completed OK per second, by end time, in [a, b) after t0
        return round(sum(1 for r in records if r[3] and a <= r[1] - t0 < b) / max(b - a, 1e-9), 1)

    kill = t_kill - t0
    last_fail = max((r[1] - t_kill for r in failed), default=None)
    return {"users": users, "ran_s": round(ran_s, 1), "replicas": len(victims), "killed_pid": victim,
            "replica_pids_after": new_pids,
            "requests": len(records), "failed": len(failed),
            "failed_statuses": dict(Counter(str(r[2]) for r in failed)),
            "failed_examples": sorted({r[4] for r in failed})[:3],
            "failed_started_s_after_kill": sorted(round(r[0] - t_kill, 2) for r in failed),
            "last_failure_s_after_kill": round(last_fail, 2) if last_fail is not None else None,
            "replicas_running_again_s": round(back_s, 1) if back_s is not None else None,
            "timeline_s_after_kill": timeline,
            "ok_req_s_before": rate(1.0, kill), "ok_req_s_first_5s_after": rate(kill, kill + 5),
            "ok_req_s_after_recovery": rate(kill + (back_s or ran_s), ran_s)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--kill-at-s", type=float, default=8.0)
    p.add_argument("--duration-s", type=float, default=40.0)
    p.add_argument("--recover-wait-s", type=float, default=120.0,
                   help="run on past --duration-s while the replicas are not back, this long at most")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with tiny_service(TinyServiceConfig(num_replicas=2)) as url:
        result = asyncio.run(run(url, args.users, args.kill_at_s, args.duration_s, args.recover_wait_s))
    report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
