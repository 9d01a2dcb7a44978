"""The translator's compiled steps built in a child process while the replica builds the generator's.

A replica starts its engines one after the other, and two engines' builds cannot share a process
(torch.export's tracing is not thread-safe: docs/decisions.md). On a first start the translator's
packages would wait for the generator's weights and packages while the second core idles. A child
process, started once both models' weights are loaded and only where this host lacks the
translator's packages, starts the translator's engine once, which builds them under `$ATTNSERVE_HOME`
(service/engine/aot_package.py) keyed exactly as the replica keys them, and exits; the replica builds
the generator's meanwhile and waits for the child before starting its own translator engine, which
then loads them. The child's failure costs nothing but time: the replica then builds them itself.

    python -m service.prebuild '<translator ModelSpec as JSON>'
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import subprocess
import sys

from service.config import ServiceConfig

log = logging.getLogger(__name__)


def start_translator_build(cfg: ServiceConfig, translator) -> subprocess.Popen | None:
    """Start the child for a compiled CPU translator (`translator`: its loaded frontend) served beside a
    generator, when this host lacks its packages; None where there is nothing to build or overlap."""
    from service.engine.cpu_runtime import default_threads

    engine = translator.engine
    if not (cfg.generator.enabled and engine.config.compile and engine.config.device == "cpu"):
        return None
    if engine.runner.compiled_steps_built(engine.config.threads or default_threads()):
        return None
    # the replica's own placement, so the child keys its packages as the replica will
    spec = dataclasses.replace(cfg.translator, device=engine.config.device, dtype=engine.config.dtype)
    return subprocess.Popen([sys.executable, "-m", "service.prebuild", json.dumps(dataclasses.asdict(spec))],
                            stdin=subprocess.DEVNULL)


async def _build(spec_json: str) -> None:
    from service.config import ModelSpec
    from service.models import load_translator

    engine = load_translator(ModelSpec.from_dict(json.loads(spec_json))).engine
    await engine.start()
    await engine.stop()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="prebuild: %(message)s")
    asyncio.run(_build(sys.argv[1]))
