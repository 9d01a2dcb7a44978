"""The service's engines in this process, without Ray or HTTP: `attnserve translate` and `attnserve eval
translate` run the engine `/v1/translate` runs, built from the same Serve config, so the command line and
the service translate a text the same way.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from service.config import ModelSpec, ServiceConfig
from service.engine.types import EngineOverloaded, TranslateRequest, TranslationResult, Usage


def serve_config(path: str | Path | None = None) -> ServiceConfig:
    """The application args of a Serve config file (default: deploy/serve_config.yaml)."""
    from service.ray_local import DEFAULT_CONFIG, attnserve_apps, load_yaml

    path = path or DEFAULT_CONFIG
    doc = load_yaml(path)
    app = attnserve_apps(doc if isinstance(doc, dict) else {}, path)[0]
    return ServiceConfig.from_dict(app.get("args") or {})


def generator_spec(*, config: str | Path | None = None, **overrides) -> ModelSpec:
    """The served generator's spec; `overrides`: ModelSpec fields (None leaves a field as served) and
    `threads` / `compile` for its engine."""
    spec, given = serve_config(config).generator, {k: v for k, v in overrides.items() if v is not None}
    engine = {**spec.engine, **{k: given.pop(k) for k in ("threads", "compile") if k in given}}
    return replace(spec, engine=engine, **given)


def translator_spec(checkpoint: str | Path | None = None, *, config: str | Path | None = None) -> ModelSpec:
    """The served translator's spec, optionally with another checkpoint. Compiled where the service compiles:
    in bf16 the compiled and the eager step round differently and choose other tokens for some sentences."""
    spec = serve_config(config).translator
    # a folder given on the command line is relative to where the command runs (the config's, to the repo)
    return replace(spec, checkpoint=str(Path(checkpoint).resolve()) if checkpoint else spec.checkpoint)


def load_translator(spec: ModelSpec):
    """The translator's frontend over a TranslationEngine for `spec` (not started), as a replica builds it."""
    from service.engine.cpu_runtime import single_threaded_caller
    from service.models import load_translator as load_engine

    single_threaded_caller()
    return load_engine(spec)


async def translate_async(translator, texts: list[str], *, progress: Callable[[int], None] | None = None,
                          **request) -> TranslationResult:
    """Start `translator` (a frontend), translate `texts` through it, one request per text with as many in flight
    as the engine queues, results in input order, and stop it. `request`: TranslateRequest fields (target_lang,
    beam_size, no_repeat_ngram, ...). `progress(n)` is called with the number of texts finished so far."""
    window = max(1, min(64, translator.engine.config.max_waiting // 4))  # texts in flight; a text may be many sentences
    results: list[TranslationResult | None] = [None] * len(texts)
    done = 0
    sem = asyncio.Semaphore(window)

    async def one(i: int) -> None:
        nonlocal done
        async with sem:
            while True:
                try:
                    results[i] = await translator.translate(TranslateRequest(texts=[texts[i]], **request))
                    break
                except EngineOverloaded as e:  # long texts filled the queue: wait as an HTTP client would
                    await asyncio.sleep(e.retry_after)
        done += 1
        if progress is not None:
            progress(done)

    await translator.start()
    try:
        await asyncio.gather(*(one(i) for i in range(len(texts))))
    finally:
        await translator.stop()
    return TranslationResult(translations=[t for r in results for t in r.translations],
                             source_langs=[lang for r in results for lang in r.source_langs],
                             target_langs=[lang for r in results for lang in r.target_langs],
                             usage=Usage(prompt_tokens=sum(r.usage.prompt_tokens for r in results),
                                         completion_tokens=sum(r.usage.completion_tokens for r in results)))


def translate(translator, texts: list[str], *, progress: Callable[[int], None] | None = None,
              **request) -> TranslationResult:
    """translate_async in a new event loop."""
    engine = translator.engine
    if engine.config.compile and not engine.runner.compiled_steps_built(engine.config.threads):
        print("attnserve: compiling the translator's steps for this host (once; later runs load them from "
              "$ATTNSERVE_HOME/compile)", file=sys.stderr, flush=True)
    return asyncio.run(translate_async(translator, texts, progress=progress, **request))
