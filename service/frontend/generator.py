"""The generator's request boundary, for the HTTP routes and `attnserve generate`: prompts and chat
messages in (the model's chat template, tokenising), model-ready ids to the engine; the engine streams
text back (detokenising is its output processing, service/engine/generation_output.py)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from operator import attrgetter

from model.tokenizer import encode_rendered
from service.config import GENERATOR_ID
from service.engine.types import GenerateRequest, GenerationEvent, RequestRejected


class GeneratorFrontend:
    def __init__(self, engine, tokenizer, *, name: str = GENERATOR_ID, chat_template: str | None = None):
        self.engine, self.tokenizer, self.name, self.chat_template = engine, tokenizer, name, chat_template

    max_context = property(attrgetter("engine.max_context"))
    max_choices = property(attrgetter("engine.max_choices"),
                           doc="Most choices (n) one request can have: each holds a KV slot.")
    vocab_size = property(attrgetter("engine.vocab_size"), doc="Token ids the model scores: [0, vocab_size).")
    hidden_ids = property(attrgetter("engine.hidden_ids"),
                          doc="Ids the engine leaves out of generated text (end of sequence, special tokens).")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @functools.cached_property
    def vocab_bytes(self) -> list[bytes] | None:
        """Each token id's bytes in decoded text (a byte-level token may hold part of a character), where
        the tokenizer can tell them (`token_bytes`), else None."""
        return self.tokenizer.token_bytes() if hasattr(self.tokenizer, "token_bytes") else None

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        if not self.chat_template:
            raise RequestRejected(f"model {self.name} has no chat template; send 'prompt' instead", "messages")
        from model.chat import ChatTemplateError, render_chat

        try:
            special = self.tokenizer.special_tokens() if hasattr(self.tokenizer, "special_tokens") else {}
            text = render_chat(self.chat_template, messages, add_generation_prompt, continue_final_message, **special)
        except ChatTemplateError as e:
            raise RequestRejected(f"messages: {e}", "messages") from None
        return encode_rendered(self.tokenizer, text)

    def submit(self, req: GenerateRequest) -> AsyncIterator[GenerationEvent]:
        return self.engine.submit(req)

    def submit_all(self, reqs: list[GenerateRequest]) -> list[AsyncIterator[GenerationEvent]]:
        """Several requests queued all or none (one completions call's prompts)."""
        return self.engine.submit_all(reqs)

    def compile_schema(self, schema: dict) -> None:
        """Compile a structured-output schema into the engine's cache (RequestRejected if unsupported);
        blocking: call it from a worker thread."""
        self.engine.grammars.compile(schema)

    async def start(self) -> None:
        await self.engine.start()
        if self.chat_template:  # compiled now rather than on the first chat request (jinja's import included)
            with contextlib.suppress(RequestRejected):
                self.encode_chat([{"role": "user", "content": "Hello"}])

    async def stop(self) -> None:
        await self.engine.stop()
