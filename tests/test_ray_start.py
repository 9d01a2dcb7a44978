"""service/ray_local.start_ray: Ray's fixed 30 s raylet deadline, missed on busy cores, is retried."""

import os
import signal
import subprocess
import time

import pytest

ray = pytest.importorskip("ray")

from service import ray_local  # noqa: E402

TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")


@pytest.fixture
def fake_ray(monkeypatch):
    calls = {"init": 0, "shutdown": 0}
    monkeypatch.setattr(ray_local, "loopback_env", lambda: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1))
    monkeypatch.setenv("PYTHONPATH", "")
    for k in (*ray_local.LOOPBACK_ENV, *ray_local.SERVE_TUNING_ENV):
        monkeypatch.setenv(k, "0")
    return calls


def test_a_missed_start_deadline_is_retried_once(monkeypatch, fake_ray, capsys):
    started = []

    def init(**kwargs):
        fake_ray["init"] += 1
        if fake_ray["init"] == 1:  # as Ray's node does: its processes started, then the deadline missed
            started.append(subprocess.Popen(["sleep", "60"]))
            raise TIMEOUT
        assert kwargs["_node_ip_address"] == ray_local.LOOPBACK
        assert kwargs["_system_config"]["prestart_worker_first_driver"] is False

    monkeypatch.setattr(ray, "init", init)
    ray_local.start_ray(num_cpus=2)
    assert fake_ray == {"init": 2, "shutdown": 1}
    assert "starting it again" in capsys.readouterr().err
    assert started[0].wait(timeout=5) == -signal.SIGKILL  # the failed node's processes are gone


def test_descendants_are_read_from_proc():
    child = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    try:
        time.sleep(0.3)
        below = ray_local.descendants(os.getpid())
        assert child.pid in below and len(below - {child.pid}) >= 1  # its own child (the sleep) too
    finally:
        child.kill()
        child.wait()


def test_a_last_miss_and_other_errors_are_raised(monkeypatch, fake_ray):
    def init(**kwargs):
        fake_ray["init"] += 1
        raise TIMEOUT

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(RuntimeError, match="missed its start-up deadline 3 times .*timed out during startup"):
        ray_local.start_ray()  # a RuntimeError: `attnserve serve` reports it in one line, exit 1
    assert fake_ray["init"] == ray_local.START_ATTEMPTS == 3

    fake_ray["init"] = 0
    monkeypatch.setattr(ray, "init", lambda **kw: (_ for _ in ()).throw(ValueError("bad object_store_memory")))
    with pytest.raises(ValueError, match="object_store_memory"):
        ray_local.start_ray()
