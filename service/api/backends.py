"""What the HTTP routes talk to: a generator (engine + tokenizer + chat template) and a translator (the
`TranslationEngine` itself: it takes text, detects languages, splits and joins sentences).

A model that could not be loaded is represented by its reason, so routes answer 503 naming it
instead of the service failing to start.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.api.errors import ApiError
from service.config import GENERATOR_ID, TRANSLATOR_ID
from service.engine.types import GenerateRequest, GenerationEvent

if TYPE_CHECKING:  # the engine (torch, the model) loads only where a replica builds it
    from service.engine.translation import TranslationEngine


class GeneratorBackend:
    def __init__(self, engine, tokenizer, *, name: str = GENERATOR_ID, chat_template: str | None = None):
        self.engine, self.tokenizer, self.name, self.chat_template = engine, tokenizer, name, chat_template

    @property
    def model(self):
        return self.engine.model

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def max_choices(self) -> int:
        """Most choices (n) one request can have: each holds a KV slot."""
        return self.engine.max_choices

    @property
    def vocab_size(self) -> int:
        """Token ids the model scores: [0, vocab_size)."""
        return self.engine.vocab_size

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if not self.chat_template:
            raise ApiError(400, f"model {self.name} has no chat template; send 'prompt' instead", "messages")
        from model.chat import ChatTemplateError, render_chat

        try:
            return self.tokenizer.encode(render_chat(self.chat_template, messages, add_generation_prompt))
        except ChatTemplateError as e:
            raise ApiError(400, f"messages: {e}", "messages") from None

    def submit(self, req: GenerateRequest) -> AsyncIterator[GenerationEvent]:
        return self.engine.submit(req)

    def compile_schema(self, schema: dict) -> None:
        """Compile a structured-output schema into the engine's cache (RequestRejected if unsupported);
        blocking: call it from a worker thread."""
        self.engine.grammars.compile(schema)

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()


@dataclass
class Backends:
    """The loaded models, and for each missing one the reason it is missing."""

    generator: GeneratorBackend | None = None
    translator: TranslationEngine | None = None
    unavailable: dict[str, str] = field(default_factory=dict)  # model id -> why it is not served

    def ids(self) -> list[str]:
        return [b.name for b in (self.generator, self.translator) if b is not None]

    def need_generator(self, model: str | None) -> GeneratorBackend:
        return self._need(model, self.generator, GENERATOR_ID, "completions/generation")

    def need_translator(self, model: str | None) -> TranslationEngine:
        return self._need(model, self.translator, TRANSLATOR_ID, "translation")

    def _need(self, model, backend, default_id: str, what: str):
        name = backend.name if backend is not None else default_id
        if model is not None and model != name:
            other = (self.translator, self.generator)
            if model in self.ids() or model in self.unavailable or any(b and b.name == model for b in other):
                raise ApiError(400, f"model {model!r} does not serve {what}", "model")
            raise ApiError(404, f"model {model!r} not found; available: {self.ids()}", "model")
        if backend is None:
            reason = self.unavailable.get(name, "not loaded")
            raise ApiError(503, f"model {name} is not available: {reason}", "model")
        return backend

    async def start(self) -> None:
        for b in (self.generator, self.translator):
            if b is not None:
                await b.start()

    async def stop(self) -> None:
        for b in (self.generator, self.translator):
            if b is not None:
                await b.stop()
