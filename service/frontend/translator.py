"""The translator's request boundary: texts in, translations out, for `/v1/translate`, `attnserve translate`
and `attnserve eval translate` alike (the steps: docs/architecture.md, "How a request flows", 4)."""

from __future__ import annotations

import dataclasses
import functools
from operator import attrgetter

from model.tokenizer import check_vocabularies
from model.translation import TAGS, detect_lang, encode_source, join_text, needs_translation, other, pieces, split_text
from service.engine.translation import TranslationEngine
from service.engine.types import SourceBatch, TranslateRequest, TranslationResult, TranslationSettings, Usage, rejection


class TranslationFrontend:
    def __init__(self, engine: TranslationEngine, tokenizer):
        check_vocabularies(tokenizer, engine.cfg.vocab_size)
        self.engine = engine
        self.tokenizer = tokenizer

    name = property(attrgetter("engine.name"))
    max_beam_size = property(attrgetter("engine.max_beam_size"))
    max_length = property(attrgetter("engine.max_length"))

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    async def translate(self, req: TranslateRequest) -> TranslationResult:
        """Translate every text of the request (RequestRejected / EngineOverloaded / EngineStopped are
        raised before any work; TimeoutError past the deadline). Cancelling the awaiting task frees the
        request's slots."""
        reject = functools.partial(rejection, req.field_names)
        if not req.texts:
            raise reject("text", "texts is empty")
        for field in ("source_lang", "target_lang"):
            if getattr(req, field) not in (None, *TAGS):
                raise reject(field, f"{{}} must be one of {sorted(TAGS)}", got=getattr(req, field))
        if req.source_lang is not None and req.source_lang == req.target_lang:
            raise reject("target_lang", f"{{}} must differ from {req.field_names.get('source_lang', 'source_lang')}")
        max_src = self.engine.max_source_len
        sources: list[list[int]] = []
        # per text, per line, per sentence: its index in `sources`, or the text it passes through as
        plans: list[list[list[int | str]]] = []
        source_langs = [req.source_lang or detect_lang(text) for text in req.texts]
        target_langs = [req.target_lang or other(lang) for lang in source_langs]
        for i, (text, tgt) in enumerate(zip(req.texts, target_langs, strict=True)):
            plan = []

            def fits(piece: str, tgt=tgt) -> bool:  # one passed through never meets the model: cut, it would gap
                return (not needs_translation(piece, tgt, req.source_lang)
                        or len(encode_source(self.tokenizer, piece, tgt)) <= max_src)

            for line in split_text(text):
                items: list[int | str] = []
                for sentence in (p for s in line for p in pieces(s, fits)):
                    if not needs_translation(sentence, tgt, req.source_lang):
                        items.append(sentence)
                        continue
                    src = encode_source(self.tokenizer, sentence, tgt)
                    if len(src) > max_src:
                        raise reject("text", f"text {i} has a sentence of {len(src) - 2} tokens; the translator "
                                             f"takes at most {max_src - 2} tokens per sentence")
                    items.append(len(sources))
                    sources.append(src)
                plan.append(items)
            plans.append(plan)
        if req.max_sentences is not None and len(sources) > req.max_sentences:
            raise reject("text", f"the texts hold {len(sources)} sentences to translate; the limit is "
                                 f"{req.max_sentences} per request")
        settings = {f.name: getattr(req, f.name) for f in dataclasses.fields(TranslationSettings)}
        outputs = await self.engine.run(SourceBatch(sources, **settings))
        usage = Usage(prompt_tokens=sum(map(len, sources)), completion_tokens=sum(map(len, outputs)))
        texts = [join_text([[self.tokenizer.decode(outputs[x]) if isinstance(x, int) else x
                             for x in items] for items in plan], lang)
                 for plan, lang in zip(plans, target_langs, strict=True)]
        return TranslationResult(translations=texts, source_langs=source_langs, target_langs=target_langs,
                                 usage=usage)
