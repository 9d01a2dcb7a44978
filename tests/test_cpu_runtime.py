"""service/engine/cpu_runtime.py: glibc mallopt tuning and the per-thread torch thread counts.

The mallopt decisions are checked against a fake libc (which options, which values, how often, when
not at all); glibc's real effect is checked in a fresh process through mallinfo2: a 64 MB block is
mmapped before tuning and comes from the heap after. Thread counts are checked on worker threads, so
the test process's own torch settings stay as they are.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from service.engine import cpu_runtime

ROOT = Path(__file__).resolve().parent.parent
# glibc's malloc.h: #define M_TRIM_THRESHOLD -1, #define M_MMAP_THRESHOLD -3
GLIBC_M_TRIM_THRESHOLD, GLIBC_M_MMAP_THRESHOLD = -1, -3
MB = 2**20


class FakeMallopt:
    def __init__(self, answer: int):
        self.answer, self.calls = answer, []
        self.argtypes = self.restype = None

    def __call__(self, option, value):
        self.calls.append((option, value))
        return self.answer


class FakeLibc:
    def __init__(self, answer: int = 1):
        self.mallopt = FakeMallopt(answer)


@pytest.fixture
def fresh(monkeypatch):
    """cpu_runtime as in a new process: nothing tuned or memoised yet (restored afterwards)."""
    for name in ("tune_malloc", "default_threads"):  # memoised: a fresh memo, the process's own restored after
        monkeypatch.setattr(cpu_runtime, name, functools.cache(getattr(cpu_runtime, name).__wrapped__))
    monkeypatch.delenv("ATTNSERVE_MALLOPT", raising=False)
    return cpu_runtime


def _libc(monkeypatch, libc) -> list:
    opened = []

    def cdll(name, *a, **kw):
        opened.append(name)
        if isinstance(libc, Exception):
            raise libc
        return libc

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    return opened


def test_mallopt_sets_mmap_256_mb_and_trim_512_mb_once_per_process(fresh, monkeypatch):
    libc = FakeLibc(answer=1)
    opened = _libc(monkeypatch, libc)
    assert fresh.tune_malloc() is True
    want = [(GLIBC_M_MMAP_THRESHOLD, 256 * MB), (GLIBC_M_TRIM_THRESHOLD, 512 * MB)]
    assert sorted(libc.mallopt.calls) == sorted(want)
    assert libc.mallopt.argtypes == [ctypes.c_int, ctypes.c_int] and libc.mallopt.restype is ctypes.c_int
    assert fresh.tune_malloc() is True  # the second call remembers, touches nothing
    assert len(libc.mallopt.calls) == 2 and len(opened) == 1


def test_mallopt_off_by_environment(fresh, monkeypatch):
    opened = _libc(monkeypatch, FakeLibc())
    monkeypatch.setenv("ATTNSERVE_MALLOPT", "0")
    assert fresh.tune_malloc() is False
    assert opened == []  # libc not even opened


def test_mallopt_refused_by_glibc_is_reported_and_not_retried(fresh, monkeypatch):
    libc = FakeLibc(answer=0)  # mallopt returns 0 on error
    _libc(monkeypatch, libc)
    assert fresh.tune_malloc() is False
    n = len(libc.mallopt.calls)
    assert n >= 1
    assert fresh.tune_malloc() is False and len(libc.mallopt.calls) == n


@pytest.mark.parametrize("libc", [OSError("no libc"), object()], ids=["no-libc", "no-mallopt (musl, macOS)"])
def test_mallopt_missing_is_a_no_op(fresh, monkeypatch, libc):
    _libc(monkeypatch, libc)
    assert fresh.tune_malloc() is False


MALLINFO = """
import ctypes, sys
from service.engine.cpu_runtime import tune_malloc

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mmapped_bytes_of(n):
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(n)
    during = libc.mallinfo2().hblkhd
    libc.free(p)
    return during - before

print(mmapped_bytes_of(64 << 20), tune_malloc(), mmapped_bytes_of(64 << 20))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_real_glibc_serves_64_mb_from_the_heap_after_tuning():
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", MALLINFO], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    before, tuned, after = out.stdout.split()
    assert int(before) >= 64 * MB  # glibc's default threshold (32 MB at most) mmaps a 64 MB block
    assert tuned == "True"
    assert int(after) == 0  # below the raised 256 MB threshold: from the heap, no mmap


def _in_thread(fn):
    out = {}

    def body():
        out["before"] = torch.get_num_threads()
        out["result"] = fn()
        out["after"] = torch.get_num_threads()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


def test_default_threads_is_the_count_before_anyone_set_it(fresh):
    main = torch.get_num_threads()
    seen = _in_thread(fresh.default_threads)
    assert seen["result"] == seen["before"]
    # later changes (here: a thread going single-threaded) do not change the remembered default
    assert _in_thread(lambda: (torch.set_num_threads(1), fresh.default_threads())[1])["result"] == seen["before"]
    assert torch.get_num_threads() == main


def test_single_threaded_caller_only_changes_its_own_thread(fresh):
    main = torch.get_num_threads()
    seen = _in_thread(fresh.single_threaded_caller)
    assert seen["after"] == 1
    assert torch.get_num_threads() == main
    # the default it remembered first is the thread's count before, not the 1 it set
    assert fresh.default_threads() == seen["before"]


def test_init_engine_thread_sets_the_worker_threads_and_tunes_malloc(fresh, monkeypatch):
    tuned = []
    monkeypatch.setattr(fresh, "tune_malloc", lambda: tuned.append(1) or True)
    main = torch.get_num_threads()
    seen = _in_thread(lambda: fresh.init_engine_thread(3))
    assert seen["result"] == 3 and seen["after"] == 3 and tuned == [1]
    # no count given: the process's default, even when the loading thread went single-threaded first
    loader = _in_thread(fresh.single_threaded_caller)
    seen = _in_thread(lambda: fresh.init_engine_thread(None))
    assert seen["result"] == seen["after"] == loader["before"]
    assert torch.get_num_threads() == main


def test_busy_board_tells_an_engine_whether_another_has_work(tmp_path):
    mine, other = cpu_runtime.BusyBoard(tmp_path), cpu_runtime.BusyBoard(tmp_path)
    assert not mine.others_busy()
    mine.set(True)
    assert not mine.others_busy() and other.others_busy()  # its own entry does not count
    other.set(True)
    assert mine.others_busy()
    other.set(False)
    mine.set(False)
    assert not mine.others_busy() and not other.others_busy()
    assert list(tmp_path.iterdir()) == []


def test_busy_board_drops_the_entries_of_processes_that_died(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f"{dead.stdout.strip()}-1f").touch()  # a replica killed while busy
    board = cpu_runtime.BusyBoard(tmp_path)
    assert not board.others_busy()
    assert list(tmp_path.iterdir()) == []
    board.set(True)
    del board
    assert list(tmp_path.iterdir()) == []  # an engine's entry goes with it



@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs /proc")
def test_busy_board_does_not_count_a_stopped_process(tmp_path):
    import signal
    import time

    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a busy training job
    try:
        (tmp_path / f"{job.pid}-1f").touch()
        board = cpu_runtime.BusyBoard(tmp_path)
        assert board.others_busy()
        job.send_signal(signal.SIGSTOP)  # paused: it takes no core
        for _ in range(100):
            if cpu_runtime.process_stopped(job.pid):
                break
            time.sleep(0.02)
        assert not board.others_busy()
        assert (tmp_path / f"{job.pid}-1f").exists()  # still its entry: it counts again once resumed
        job.send_signal(signal.SIGCONT)
        for _ in range(100):
            if not cpu_runtime.process_stopped(job.pid):
                break
            time.sleep(0.02)
        assert board.others_busy()
    finally:
        job.kill()
        job.wait()

def test_torch_threads_sets_the_count_for_the_body_and_restores_it():
    def body():
        torch.set_num_threads(1)
        with cpu_runtime.torch_threads(2):
            inside = torch.get_num_threads()
        with cpu_runtime.torch_threads(None):
            unchanged = torch.get_num_threads()
        with pytest.raises(RuntimeError), cpu_runtime.torch_threads(2):
            raise RuntimeError("a failed forward")
        return inside, unchanged

    seen = _in_thread(body)
    assert seen["result"] == (2, 1)
    assert seen["after"] == 1
