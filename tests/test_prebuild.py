"""The translator's packages built by a child process after the replica is ready (service/prebuild.py): the
engine serves eagerly meanwhile, the child builds them only where they are missing, keyed as the replica keys
them, and the engine then loads them between two steps, translating as before."""

import os
import subprocess
import sys

_REPLICA = """
import asyncio, logging, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from service.config import ServiceConfig
from service.engine.cpu_runtime import BusyBoard
from service.engine.types import TranslateRequest
from service.models import load_translator
from service.prebuild import start_translator_build
cfg = ServiceConfig.from_dict({"translator": {"device": "cpu", "dtype": "float32",
                                              "engine": {"max_slots": 4, "max_seq_len": 32, "compile": True,
                                                         "threads": 1}}})
frontend = load_translator(cfg.translator)
engine = frontend.engine
engine.compile_later = True  # a replica's first start: it serves eagerly while the child builds
board = BusyBoard()
req = TranslateRequest(texts=["The Fund may invest in bonds.", "本基金可投资于债券。"], beam_size=2)

async def main():
    await engine.start()
    eager = (await frontend.translate(req)).translations
    print("eager", engine.compiled is None, flush=True)
    child = start_translator_build(cfg, frontend)
    busy = False
    while child is not None and child.poll() is None:  # serving engines see the build as a busy neighbour
        busy = busy or board.others_busy()
        await asyncio.sleep(0.05)
    print("child", child is not None and child.returncode == 0, "busy", busy, "after", board.others_busy(), flush=True)
    print("again", start_translator_build(cfg, frontend) is None, flush=True)
    await engine.compile_deferred()  # loads what the child built, between two steps
    compiled = (await frontend.translate(req)).translations
    print("compiled", engine.compiled is not None, "same", compiled == eager, flush=True)
    await engine.stop()

asyncio.run(main())
"""


def test_a_child_builds_the_translator_packages_and_the_replica_loads_them(tmp_path):
    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(ATTNSERVE_HOME=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               ATTNSERVE_BUSY_DIR=str(tmp_path / "busy"))
    r = subprocess.run([sys.executable, "-c", _REPLICA], env=env, capture_output=True, text=True, timeout=900,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["eager", "True", "child", "True", "busy", "True", "after", "False", "again", "True",
                                "compiled", "True", "same", "True"]
    built = [line for line in r.stderr.splitlines() if ": built " in line]
    loaded = [line for line in r.stderr.splitlines() if ": loaded " in line]
    assert len(built) == 2 and all(line.startswith("prebuild: ") for line in built)  # by the child
    assert len(loaded) == 2 and not any(line.startswith("prebuild: ") for line in loaded)  # by the replica


def test_no_child_where_the_translators_sizes_run_eagerly():
    """A compiled translator too small for the compiled step (slots of two positions) runs eagerly: nothing
    to build, and the replica's start must not fail on it."""
    from service.config import ServiceConfig
    from service.models import load_translator
    from service.prebuild import start_translator_build

    cfg = ServiceConfig.from_dict({"translator": {"device": "cpu", "dtype": "float32",
                                                  "engine": {"max_slots": 1, "max_seq_len": 2, "compile": True}}})
    assert start_translator_build(cfg, load_translator(cfg.translator)) is None


_GENERATOR_REPLICA = """
import asyncio, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from tests.serve_fixture import tiny_checkpoints
from service.config import ServiceConfig
from service.models import load_generator
from service.prebuild import start_prefill_build
gen, _ = tiny_checkpoints(Path(sys.argv[1]))
cfg = ServiceConfig.from_dict({"generator": {"checkpoint": str(gen), "device": "cpu", "dtype": "float32",
                                             "quantization": "int8",
                                             "engine": {"max_slots": 4, "max_seq_len": 64, "compile": True,
                                                        "threads": 1}},
                               "translator": {"enabled": False}})
frontend = load_generator(cfg.generator)
engine = frontend.engine
engine.runner.build_prefill = False  # as the replica starts it

async def main():
    await engine.start()
    try:
        print("pending", engine.compiled.prefill_pending, flush=True)
        child = start_prefill_build(cfg, frontend)
        print("child", child is not None and await asyncio.to_thread(child.wait) == 0, flush=True)
        print("loaded", engine.compiled.load_prefill(), flush=True)
        print("again", start_prefill_build(cfg, frontend) is None, flush=True)
    finally:
        await engine.stop()

asyncio.run(main())
"""


def test_a_child_builds_the_generators_prefill_after_the_replica_started(tmp_path):
    """A replica's first start serves without the generator's compiled prefill; a child builds it, keyed as
    the replica keys it, and the replica loads it."""
    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(ATTNSERVE_HOME=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _GENERATOR_REPLICA, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    said = [w for line in r.stdout.splitlines() if not line.startswith("attnserve: ") for w in line.split()]
    assert said == ["pending", "True", "child", "True", "loaded", "True", "again", "True"]
    built = [line for line in r.stderr.splitlines() if "decoder-prefill: built " in line]
    assert len(built) == 1 and built[0].startswith("prebuild: ")  # by the child, not the replica


def test_a_cancelled_wait_kills_and_reaps_the_child():
    """A replica going away while its build child runs (the wait cancelled) leaves no child behind, nor a zombie
    that would still count as busy on the host's board."""
    import asyncio

    from service.prebuild import wait_child

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    async def main():
        waiting = asyncio.create_task(wait_child(child))
        await asyncio.sleep(0.5)
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            return "cancelled"
        return "finished"

    try:
        assert asyncio.run(main()) == "cancelled"
        assert child.returncode is not None  # killed and reaped by wait_child, not by this test
    finally:
        if child.poll() is None:
            child.kill()


def test_a_finished_child_gives_its_exit_code():
    import asyncio

    from service.prebuild import wait_child

    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert asyncio.run(wait_child(child)) == 3


def test_the_child_loads_its_model_single_threaded_as_a_replica_does(monkeypatch, tmp_path):
    """A multi-threaded load would leave a second OpenMP pool beside the engine thread's, slowing the build."""
    import asyncio
    import threading
    from types import SimpleNamespace

    import torch

    from service import models, prebuild
    from service.engine import cpu_runtime

    seen = {}

    class Engine:
        async def start(self):
            seen["engine started"] = True

        async def stop(self):
            pass

    def load(spec):
        seen["threads"] = torch.get_num_threads()
        return SimpleNamespace(engine=Engine())

    monkeypatch.setattr(models, "load_translator", load)
    monkeypatch.setattr(cpu_runtime, "BUSY_DIR", tmp_path)
    cpu_runtime.default_threads()  # the process default is remembered from here, not from the 2 set below

    def child_main():  # a thread of its own: torch's thread count is per thread
        torch.set_num_threads(2)  # as a process's main thread starts on a host with cores to spare
        asyncio.run(prebuild._build("translator", "{}"))

    t = threading.Thread(target=child_main)
    t.start()
    t.join()
    assert seen == {"threads": 1, "engine started": True}
