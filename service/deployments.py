"""The Ray Serve application: one ingress deployment that owns the engines.

HTTP -> Serve proxy -> `AttnServe` replica (FastAPI app + GenerationEngine + TranslationEngine).
Keeping the engines inside the ingress makes a request one hop from the proxy (a separate model
deployment would add a second actor call per request and per streamed chunk). Scale with
`num_replicas`/`autoscaling_config`; place on GPUs with `ray_actor_options.num_gpus` (each replica
then picks cuda + bfloat16, see service/models.py).

This file is imported by import path (`service.deployments:build`); metrics live in
`service.metrics`, never here (Ray pickles deployment modules by value).
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from service.api.app import create_app
from service.config import ApiLimits, ServiceConfig


@serve.deployment(name="AttnServe", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64)
@serve.ingress()
class AttnServe:
    async def __init__(self, config: dict | None = None):
        from service import metrics
        from service.models import load_backends
        from service.ray_metrics import RayRecorder

        metrics.install(RayRecorder())  # ray.serve.metrics: GET /metrics combines every replica's series

        self.config = ServiceConfig.from_dict(config)
        self.limits = self.config.limits
        self.fastapi = None
        self.backends = await asyncio.to_thread(load_backends, self.config, metrics.EngineMetrics())
        if self.config.batching == "serve_batch" and self.backends.generator is not None:
            from service.serve_batching import ServeBatchGenerator

            self.backends.generator = ServeBatchGenerator(self.backends.generator, self.config.serve_batch_size,
                                                          self.config.serve_batch_wait_s)
        await self.backends.start()
        for name, backend in (("generator", self.backends.generator), ("translator", self.backends.translator)):
            engine = getattr(backend, "engine", None)  # (a serve_batch wrapper has none: nothing to report)
            if engine is not None and engine.config.compile:  # the replica log says whether compile took effect
                state = (f"compiled in {engine.compiled.compile_seconds:.1f} s" if engine.compiled is not None
                         else "torch.compile failed, running eagerly (see stderr)")
                logging.getLogger("ray.serve").info("%s engine: %s", name, state)

    def __serve_build_asgi_app__(self):
        self.fastapi = create_app(self.backends, self.limits)
        return self.fastapi

    def reconfigure(self, user_config: dict | None) -> None:
        """`user_config: {limits: {...}}` in the Serve config: API limits, applied without a restart."""
        unknown = sorted(set(user_config or {}) - {"limits"})
        if unknown:
            raise ValueError(f"user_config: unknown key(s) {unknown}; known: ['limits']")
        self.limits = ApiLimits.from_dict((user_config or {}).get("limits"))
        if self.fastapi is not None:
            self.fastapi.state.limits = self.limits

    def check_health(self) -> None:
        gen = self.backends.generator
        if gen is not None and not gen.engine.started:
            raise RuntimeError("generator engine is not running")


def build(args: dict | None = None):
    """Application builder for `import_path: service.deployments:build`; `args` is a ServiceConfig dict."""
    ServiceConfig.from_dict(args)  # fail at deploy time, on the driver, with a clear message
    return AttnServe.bind(args)
