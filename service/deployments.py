"""The Ray Serve application: one ingress deployment that owns the engines (why, and how it scales:
docs/architecture.md, "How a request flows", 2).

This file is imported by import path (`service.deployments:build`); metrics live in
`service.metrics`, never here (Ray pickles deployment modules by value).
"""

from __future__ import annotations

import asyncio
import gc
import logging

from ray import serve

from service.api.app import create_app
from service.api.backends import Backends
from service.config import ServiceConfig, limits_from_user_config
from service.startup import Startup

log = logging.getLogger("ray.serve")


@serve.deployment(name="AttnServe", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64)
@serve.ingress()
class AttnServe:
    async def __init__(self, config: dict | None = None):
        """Returns at once: the models load behind `/readyz` (service/startup.py), so Serve routes to this
        replica from the start and requests get a fast 503 + Retry-After until it is ready."""
        from service import metrics
        from service.ray_metrics import RayRecorder

        metrics.install(RayRecorder())  # ray.serve.metrics: GET /metrics combines every replica's series

        self.config = ServiceConfig.from_dict(config)
        self.limits = self.config.limits
        self.fastapi = None
        self.startup = Startup()
        # filled in place by _load: the app holds this object
        self.backends = Backends(generator_id=self.config.generator_id, translator_id=self.config.translator_id)
        self._loading = asyncio.get_running_loop().create_task(self._load(metrics.EngineMetrics()))

    async def _load(self, sink) -> None:
        from service.models import load_backends
        from service.prebuild import translator_build_needed

        try:
            loaded = await asyncio.to_thread(load_backends, self.config, sink, startup=self.startup)
            if self.config.batching == "serve_batch" and loaded.generator is not None:
                from service.serve_batching import ServeBatchGenerator

                loaded.generator = ServeBatchGenerator(loaded.generator, self.config.serve_batch_size,
                                                       self.config.serve_batch_wait_s)
            self.backends.unavailable.update(loaded.unavailable)
            later = loaded.translator is not None and translator_build_needed(self.config, loaded.translator)
            for model_id, attr in ((self.config.generator_id, "generator"), (self.config.translator_id, "translator")):
                backend = getattr(loaded, attr)
                if backend is None:
                    continue
                engine = backend.engine
                deferred = attr == "translator" and later  # its packages are built after ready: eager until then
                compiling = engine.config.compile and not deferred
                self.startup.set(f"{'compiling' if compiling else 'starting'} the {attr} engine", model_id,
                                 "compiling (or loading) the decode step" if compiling else "starting")
                if attr == "generator":  # its compiled prefill, where missing, is built after ready
                    engine.runner.build_prefill = False
                if deferred:
                    engine.compile_later = True
                await backend.start()
                state = "ready"
                if deferred:
                    state = "ready (eager until its compiled steps are built, after start-up)"
                elif compiling:
                    state = (f"ready (step compiled or loaded in {engine.compiled.compile_seconds:.1f} s)"
                             if engine.compiled is not None else "ready (compiling failed: running eagerly)")
                self.startup.model(model_id, state)
                log.info("%s engine: %s", attr, state)
                setattr(self.backends, attr, backend)
            # Serve froze the heap after __init__, before the models loaded: freeze again, or a full
            # collection walks the weights' and tokenizers' objects in the middle of a request
            gc.collect()
            gc.freeze()
            self.startup.done()
            log.info("attnserve replica ready in %.1f s", self.startup.elapsed_s)
        except Exception as e:  # reported on /readyz; check_health then has Serve restart the replica
            self.startup.fail(f"{type(e).__name__}: {e}")
            log.exception("attnserve replica failed to start")
        if not self.startup.ready:
            return
        translator, translator_id = self.backends.translator, self.config.translator_id
        if translator is not None and translator.engine.compile_later:
            with self.startup.warming_up(translator_id, "building its compiled steps (translating eagerly until then)"):
                try:
                    await self._compile_translator(translator)
                except Exception:  # only speed is lost: it keeps translating eagerly
                    log.warning("translator: compiled steps not loaded", exc_info=True)
            self.startup.model(translator_id, "ready (compiled steps built after start-up)"
                               if translator.engine.compiled is not None
                               else "ready (eager: its compiled steps could not be built)")
        if self.backends.generator is not None:
            with self.startup.warming_up(self.config.generator_id, "building its compiled prefill where missing"):
                try:
                    await self._load_prefill(self.backends.generator)
                except Exception:  # only speed is lost: prompts keep prefilling eagerly
                    log.warning("generator: compiled prefill not loaded", exc_info=True)

    async def _compile_translator(self, translator) -> None:
        """A child builds the translator's packages (service/prebuild.py) while this replica serves; then its
        engine loads them between two steps. Should the child fail, the engine stays eager: building them
        on its own thread would stop its steps for the build's length."""
        from service.prebuild import start_translator_build, translator_build_needed, wait_child

        child = start_translator_build(self.config, translator)
        rc = None if child is None else await wait_child(child)
        if translator_build_needed(self.config, translator):
            log.warning("translator: its packages were not built (child exit %s): running eagerly", rc)
            return
        await translator.engine.compile_deferred()
        log.info("translator engine: compiled steps %s", "loaded" if translator.engine.compiled is not None
                 else "failed to load: running eagerly")

    async def _load_prefill(self, generator) -> None:
        """Where the generator's compiled prefill is missing, a child builds it (service/prebuild.py) while
        this replica serves, then the engine loads it; until then prompts prefill eagerly."""
        from service.prebuild import start_prefill_build, wait_child

        child = start_prefill_build(self.config, generator)
        if child is None:
            return
        rc = await wait_child(child)
        loaded = rc == 0 and await asyncio.to_thread(generator.engine.compiled.load_prefill)
        log.info("generator: compiled prefill %s", "loaded" if loaded else f"not built (child exit {rc})")

    def __serve_build_asgi_app__(self):
        self.fastapi = create_app(self.backends, self.limits, startup=self.startup,
                                  cors_origins=self.config.cors_allowed_origins)
        return self.fastapi

    def reconfigure(self, user_config: dict | None) -> None:
        """`user_config: {limits: {...}}` in the Serve config: API limits, applied without a restart."""
        # without limits here, the args' limits (or the defaults) hold: Serve calls this right after __init__
        self.limits = limits_from_user_config(user_config, self.config.limits)
        if self.fastapi is not None:
            self.fastapi.state.limits = self.limits

    def record_routing_stats(self) -> dict:
        """What service.routing.ReadyFirstRouter routes by: whether this replica's models serve."""
        # loaded but its generator did not (/readyz 503): the router is to send requests to the others
        return {"ready": self.startup.routing_report() and self.backends.serving}

    def check_health(self) -> None:
        """Healthy while loading (that is start-up, not failure); unhealthy if start-up failed or a
        started engine stopped."""
        if self.startup.error:
            raise RuntimeError(f"start-up failed: {self.startup.error}")
        for b in (self.backends.generator, self.backends.translator):
            if b is not None and self.startup.ready and not b.engine.started:
                raise RuntimeError(f"engine {b.engine.name} is not running")


def build(args: dict | None = None):
    """Application builder for `import_path: service.deployments:build`; `args` is a ServiceConfig dict."""
    ServiceConfig.from_dict(args)  # fail at deploy time, on the driver, with a clear message
    return AttnServe.bind(args)
