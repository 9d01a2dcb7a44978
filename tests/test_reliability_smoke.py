"""Smoke runs of the tools that start their own Ray + Serve on tiny models: the reliability scripts
(loadtests/reliability/: disconnects, overload, replica_kill) and bench_overhead --tiny, each as a user
runs it (python -m) with small counts and short phases.

Most of their time is Ray's start-up and fixed waits, not CPU, so the four run at the same time, each in
its own process with its own Ray instance (ATTNSERVE_ALLOW_OTHER_RAY=1: a separate instance beside the
others, and beside the suite's own Serve instance when that is up; their probes only see their own
processes). Each test waits for its run and checks the result it reports, not only the exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parent.parent
NUM = r"(\d+(?:\.\d+)?)"


class Run:
    def __init__(self, tmp: Path, name: str, module: str, *args: str):
        self.out = tmp / f"{name}.json"
        self.log_path = tmp / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(PYTHONPATH=str(ROOT), ATTNSERVE_HOME=str(tmp / "home"), ATTNSERVE_ALLOW_OTHER_RAY="1",
                   RAY_USAGE_STATS_ENABLED="0")
        self.log = open(self.log_path, "w")  # noqa: SIM115  (closed in finish)
        args = (*args, "--out", str(self.out)) if module.startswith("loadtests.reliability.") else args
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def finish(self, timeout: float = 600) -> str:
        """Wait for the run; its output (fails with the output's tail on a non-zero exit)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        text = self.log_path.read_text(errors="replace")
        assert rc == 0, f"exit {rc}:\n{text[-4000:]}"
        return text

    def result(self) -> dict:
        self.finish()
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        """Ctrl-C first, so a run cleans up what it started in sessions of its own (bench_overhead's
        `attnserve serve`), then SIGKILL to its process group (Ray's processes too)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reliability")
    started = {
        "disconnects": Run(tmp, "disconnects", "loadtests.reliability.disconnects", "-n", "12", "--concurrency", "6"),
        "overload": Run(tmp, "overload", "loadtests.reliability.overload", "--calibrate-s", "2", "--duration-s", "3"),
        "replica_kill": Run(tmp, "replica_kill", "loadtests.reliability.replica_kill", "--users", "4",
                            "--kill-at-s", "3", "--duration-s", "25"),
        "overhead": Run(tmp, "overhead", "benchmarks.bench_overhead", "--tiny", "--clients", "2", "--requests", "4",
                        "--max-tokens", "8", "--port", str(free_port()), "--serve-log", str(tmp / "serve.log")),
    }
    yield started
    for r in started.values():
        r.stop()


def test_disconnects_leave_no_request_behind(runs):
    r = runs["disconnects"].result()
    assert r["dropped_clients"] == 12 and sum(r["outcomes"].values()) == 12
    assert set(r["outcomes"]) <= {"stream dropped", "stream finished", "unary dropped", "unary finished"}
    assert r["engine_cancelled"] >= 1  # the engine saw clients go away
    assert r["running_after"] == 0 and r["waiting_after"] == 0 and r["kv_usage_after"] == 0
    assert r["well_behaved_requests"] >= 1 and r["well_behaved_ok"] == r["well_behaved_requests"]
    assert r["request_after_ok"] is True
    assert r["new_tracebacks_in_ray_logs"] == 0


def test_overload_sheds_with_retry_after_and_answers_the_rest(runs):
    r = runs["overload"].result()
    assert r["sustainable_req_s"] > 0 and r["factor"] == 3.0
    assert r["offered_req_s"] == pytest.approx(3 * r["sustainable_req_s"], abs=0.02)
    assert r["offered"] == sum(r["statuses"].values()) >= 1
    assert set(r["statuses"]) <= {"200", "429", "503"}  # shed or served, nothing else
    assert r["admitted"] == r["statuses"].get("200", 0) >= 1 and r["admitted_correct"] == r["admitted"]
    assert r["rejected"] == r["rejected_with_retry_after"]
    lat = r["admitted_latency_s"]
    assert 0 < lat["50"] <= lat["90"] <= lat["99"]
    for key in ("replica_rss_mb", "all_ray_rss_mb"):
        assert 0 < r[key]["first"] <= r[key]["max"] and r[key]["last"] <= r[key]["max"]
    assert r["replica_rss_mb"]["max"] < r["all_ray_rss_mb"]["max"]  # replicas are part of all of Ray


def test_replica_kill_recovers_to_two_new_replicas(runs):
    r = runs["replica_kill"].result()
    assert r["replicas"] == 2 and len(r["replica_pids_after"]) == 2
    assert r["killed_pid"] not in r["replica_pids_after"]
    assert r["replicas_running_again_s"] is not None  # back to 2 RUNNING replicas within the run
    assert r["requests"] > r["failed"] >= 0 and r["ok_req_s_after_recovery"] > 0
    assert r["timeline_s_after_kill"][-1][1] == {"RUNNING": 2}


def test_bench_overhead_measures_both_paths(runs):
    out = runs["overhead"].finish()
    assert "TINY random checkpoint" in out
    rows = {}
    for name in ("engine only (in-process)", "service (HTTP, Ray Serve, SSE)"):
        m = re.search(rf"^\| {re.escape(name)} \| {NUM} \| {NUM} / {NUM} \| (\d+) \| {NUM} \|$", out, re.M)
        assert m, name
        rows[name] = m
        assert float(m[1]) > 0 and int(m[4]) == 4 * 8  # 4 requests of exactly 8 tokens (ignore_eos)
    m = re.search(r"service / engine-only output tok/s = ([\d.]+)%", out)
    engine, service = (float(rows[n][1]) for n in rows)
    assert m and float(m[1]) == pytest.approx(100 * service / engine, rel=0.05, abs=0.2)
