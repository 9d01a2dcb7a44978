import hashlib
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session", autouse=True)
def _shipped_weights_untouched():
    """No test may write the repository's shipped checkpoints: a finished training run exports to
    weights/attnserve-zh-en unless told otherwise (`export_to`, `--export-to`)."""
    def digest() -> dict[str, str]:
        return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted((ROOT / "weights").rglob("*")) if p.is_file()}

    before = digest()
    yield
    assert digest() == before, "a test wrote into weights/: give training runs an export_to / --export-to"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module; module-scoped so reference and compared results come from the same
    thread count (a matmul split over another number of threads need not round identically)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def restore_torch():
    """Commands under test (translate, train) set the torch thread count and signal handlers: put them back."""
    threads = torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    torch.set_num_threads(threads)
    for s, h in handlers.items():
        signal.signal(s, h)


from serve_fixture import serve_url  # noqa: E402,F401  (the one shared Ray Serve instance, for `ray` tests)
