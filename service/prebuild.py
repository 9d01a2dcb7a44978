"""Compiled steps built in a child process, so that a replica's first start does not wait for them.

Package builds are most of a first start, and two engines' builds cannot share a process (torch.export's
tracing is not thread-safe). So a replica builds only the generator's decode step before ready; a child
builds the rest (the translator's packages, the generator's compiled prefill) by starting that engine once,
keyed as the replica's is, and the replica's eager engine loads them between two steps. The child runs at
the lowest priority and marks itself busy (`BusyBoard`); its failure costs only speed.

    python -m service.prebuild translator|generator '<ModelSpec as JSON>'
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time

from service.config import ModelSpec, ServiceConfig

log = logging.getLogger(__name__)


def translator_build_needed(cfg: ServiceConfig, translator) -> bool:
    """Whether a compiled CPU translator (`translator`: its loaded frontend) served beside a generator lacks
    its packages on this host."""
    engine = translator.engine
    return (cfg.generator.enabled and engine.config.compile and engine.config.device == "cpu"
            and not engine.runner.compiled_steps_built(engine.config.threads))


def start_translator_build(cfg: ServiceConfig, translator) -> subprocess.Popen | None:
    """Start the child that builds the translator's packages where `translator_build_needed`; else None."""
    return _child("translator", cfg.translator, translator.engine) if translator_build_needed(cfg, translator) else None


def start_prefill_build(cfg: ServiceConfig, generator) -> subprocess.Popen | None:
    """Start the child that builds the generator's compiled prefill where its engine (started, compiled)
    lacks it; None where there is nothing to build."""
    from model.quantize import quantization_of

    engine = generator.engine
    if engine.compiled is None or not engine.compiled.prefill_pending:
        return None
    return _child("generator", cfg.generator, engine, quantization=quantization_of(engine.runner.model))


async def wait_child(child: subprocess.Popen) -> int:
    """The child's exit code. A wait cancelled (the replica going away) kills the child and reaps it: a
    zombie would still count as busy on the host's board."""
    try:
        return await asyncio.to_thread(child.wait)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _child(kind: str, spec, engine, **resolved) -> subprocess.Popen:
    # the spec as the replica resolved it: the child then keys its packages as the replica does
    spec = dataclasses.replace(spec, device=engine.config.device, dtype=engine.config.dtype, **resolved)
    return subprocess.Popen([sys.executable, "-m", "service.prebuild", kind, json.dumps(dataclasses.asdict(spec))],
                            stdin=subprocess.DEVNULL)


async def _build(kind: str, spec_json: str) -> None:
    from service.engine.cpu_runtime import BusyBoard, single_threaded_caller
    from service.models import load_generator, load_translator

    # busy while building: a serving engine borrowing this build's core would wait for it
    board = BusyBoard()
    board.set(True)
    single_threaded_caller()  # as a replica loads: the engine thread's pool is the only parallel one
    spec = ModelSpec.from_dict(json.loads(spec_json))
    engine = (load_translator(spec) if kind == "translator" else load_generator(spec, log=log.info)).engine
    await engine.start()
    await engine.stop()
    board.set(False)


def _exit_with_parent(parent: int) -> None:
    """A child whose replica is gone (stopped, crashed) stops building for it."""
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="prebuild: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    os.nice(19)  # built after ready: the cores serve requests first
    asyncio.run(_build(*sys.argv[1:3]))
