"""What the HTTP routes talk to: each model's frontend (service/frontend/), or why the model is missing.

A model that could not be loaded is represented by its reason, so routes answer 503 naming it
instead of the service failing to start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.api.errors import ApiError
from service.config import GENERATOR_ID, TRANSLATOR_ID
from service.startup import RETRY_AFTER_S

if TYPE_CHECKING:  # the engines (torch, the models) load only where a replica builds them
    from service.frontend.generator import GeneratorFrontend
    from service.frontend.translator import TranslationFrontend


DISABLED = "disabled in the service config"  # the reason recorded for a model the config turns off


@dataclass
class Backends:
    """The loaded models, and for each missing one the reason it is missing."""

    generator: GeneratorFrontend | None = None
    translator: TranslationFrontend | None = None
    unavailable: dict[str, str] = field(default_factory=dict)  # model id -> why it is not served
    generator_id: str = GENERATOR_ID  # the configured ids (ServiceConfig), named while a model is missing
    translator_id: str = TRANSLATOR_ID

    @property
    def serving(self) -> bool:
        """Whether the models a replica is for serve: the generator; where the config disables it, the translator."""
        if self.unavailable.get(self.generator_id) == DISABLED:
            return self.translator is not None
        return self.generator is not None

    def ids(self) -> list[str]:
        return [b.name for b in (self.generator, self.translator) if b is not None]

    def need_generator(self, model: str | None, request) -> GeneratorFrontend:
        """The generator serving `model` (the request's metrics label then names it), else an ApiError."""
        return self._need(model, self.generator, self.generator_id, "completions/generation", request)

    def need_translator(self, model: str | None, request) -> TranslationFrontend:
        return self._need(model, self.translator, self.translator_id, "translation", request)

    def _need(self, model, backend, default_id: str, what: str, request):
        name = backend.name if backend is not None else default_id
        if model is not None and model != name:
            if model in self.ids() or model in self.unavailable:
                raise ApiError(400, f"model {model!r} does not serve {what}", "model")
            raise ApiError(404, f"model {model!r} not found; available: {self.ids()}", "model")
        if backend is None:
            reason = self.unavailable.get(name, "not loaded")
            # a load that failed here may have worked on another replica; a model the config disables is not retried
            retry = None if reason == DISABLED else {"Retry-After": str(RETRY_AFTER_S)}
            raise ApiError(503, f"model {name} is not available: {reason}", "model", retry)
        request.state.model = backend.name
        return backend

    async def start(self) -> None:
        for b in (self.generator, self.translator):
            if b is not None:
                await b.start()

    async def stop(self) -> None:
        for b in (self.generator, self.translator):
            if b is not None:
                await b.stop()
