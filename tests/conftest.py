import hashlib
import os
import re
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


@pytest.fixture(autouse=True)
def _metrics_recorder():
    """A replica built in-process installs Ray's recorder for the whole process: put back the one a later
    test's in-process app expects."""
    from service import metrics

    recorder = metrics.installed()
    yield
    metrics.install(recorder)


@pytest.fixture(autouse=True)
def _signal_handlers():
    """Commands under test (train, serve) and Ray take SIGINT/SIGTERM: give them back after each test, so
    a later test's Ctrl-C is Python's KeyboardInterrupt again."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in handlers.items():
        if h is not None:
            signal.signal(s, h)


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
    """Commands under test (translate, train) set the torch thread count: put it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


TINY_EN = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TINY_ZH = ["零", "一", "二", "三", "四", "五", "六", "七", "八", "九"]


@pytest.fixture
def tiny_run(tmp_path):
    """A tiny translator training setup: (config path, config dict, data folder, run folder); 400 pairs of
    number words, a 32-wide model, 150 steps."""
    import json
    import random

    rng = random.Random(0)
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 400), ("dev", 10)):
        with open(data / f"{split}.tsv", "w", encoding="utf-8") as f:
            for _ in range(n):
                idx = [rng.randrange(10) for _ in range(rng.randint(2, 6))]
                f.write(" ".join(TINY_EN[i] for i in idx) + "\t" + "".join(TINY_ZH[i] for i in idx) + "\n")
    cfg = {"model": {"d_model": 32, "n_encoder_layers": 1, "n_decoder_layers": 1, "n_heads": 2, "d_ff": 64,
                     "dropout": 0.0, "max_src_len": 64, "max_tgt_len": 64},
           "vocab_size": 300, "batch_tokens": 600, "warmup_steps": 20, "lr_factor": 0.3, "bf16": False,
           "threads": 1, "max_steps": 150, "ckpt_minutes": 100, "eval_minutes": 100, "log_every": 10, "avg_last": 2}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(cfg))
    return path, cfg, data, tmp_path / "run"


# files with tests that start Ray (markers ray, cluster): read once, for the xdist scheduler below
RAY_FILES = {f"tests/{p.name}" for p in ROOT.joinpath("tests").glob("test_*.py")
             if re.search(r"pytest\.mark\.(ray|cluster)\b", p.read_text(encoding="utf-8"))}


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two xdist workers, a file's tests on one (`--dist loadfile`); the files that start Ray
    form one unit on one worker, one after another: Ray instances booting side by side on two busy cores
    missed Ray's 30 s node start-up limit. (xdist's `loadgroup` marks do nothing under pytest 9.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayFilesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if path in RAY_FILES else path

    return RayFilesTogether(config, log)


from serve_fixture import serve_url  # noqa: E402,F401  (the one shared Ray Serve instance, for `ray` tests)
