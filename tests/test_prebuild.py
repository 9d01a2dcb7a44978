"""The translator's packages built by a child process beside the generator's (service/prebuild.py): the
child builds them only where they are missing, keyed as the replica keys them, so the replica loads them."""

import os
import subprocess
import sys

_REPLICA = """
import asyncio, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from service.config import ServiceConfig
from service.models import load_translator
from service.prebuild import start_translator_build
cfg = ServiceConfig.from_dict({"translator": {"device": "cpu", "dtype": "float32",
                                              "engine": {"max_slots": 4, "max_seq_len": 32, "compile": True,
                                                         "threads": 1}}})
frontend = load_translator(cfg.translator)
child = start_translator_build(cfg, frontend)
print("child", child is not None and child.wait() == 0, flush=True)
print("again", start_translator_build(cfg, frontend) is None, flush=True)

async def main():
    await frontend.engine.start()
    await frontend.engine.stop()

asyncio.run(main())
print("started", frontend.engine.compiled is not None, flush=True)
"""


def test_a_child_builds_the_translator_packages_and_the_replica_loads_them(tmp_path):
    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(ATTNSERVE_HOME=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _REPLICA], env=env, capture_output=True, text=True, timeout=900,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["child", "True", "again", "True", "started", "True"]
    built = [line for line in r.stderr.splitlines() if ": built " in line]
    loaded = [line for line in r.stderr.splitlines() if ": loaded " in line]
    assert len(built) == 2 and all(line.startswith("prebuild: ") for line in built)  # by the child
    assert len(loaded) == 2 and not any(line.startswith("prebuild: ") for line in loaded)  # by the replica


def test_no_child_where_the_translators_sizes_run_eagerly():
    """A compiled translator too small for the compiled step (one slot) runs eagerly: nothing to build, and
    the replica's start must not fail on it."""
    from service.config import ServiceConfig
    from service.models import load_translator
    from service.prebuild import start_translator_build

    cfg = ServiceConfig.from_dict({"translator": {"device": "cpu", "dtype": "float32",
                                                  "engine": {"max_slots": 1, "max_seq_len": 32, "compile": True}}})
    assert start_translator_build(cfg, load_translator(cfg.translator)) is None
