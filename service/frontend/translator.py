"""The translator's request boundary: texts in, translations out, for `/v1/translate`, `attnserve
translate` and `attnserve eval translate` alike.

On the way in each text's language is detected, the text split into sentences and each sentence tagged
with its target language (model/translation.py); the engine gets model-ready sources. On the way out
each sentence is detokenised and punctuated for its language (model/punctuation.py) and a text's
sentences are joined.
"""

from __future__ import annotations

from model.punctuation import postprocess
from model.translation import TAGS, detect_lang, encode_source, join_sentences, other, split_sentences
from service.engine.translation import TranslationEngine
from service.engine.types import RequestRejected, SourceBatch, TranslateRequest, TranslationResult, Usage


class TranslationFrontend:
    def __init__(self, engine: TranslationEngine, tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def max_beam_size(self) -> int:
        return self.engine.max_beam_size

    @property
    def max_length(self) -> int:
        return self.engine.max_length

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    async def translate(self, req: TranslateRequest) -> TranslationResult:
        """Translate every text of the request (RequestRejected / EngineOverloaded / EngineStopped are
        raised before any work; TimeoutError past the deadline). Cancelling the awaiting task frees the
        request's slots."""
        if not req.texts:
            raise RequestRejected("texts is empty", "text")
        if req.target_lang is not None and req.target_lang not in TAGS:
            raise RequestRejected(f"target_lang must be one of {sorted(TAGS)}, got {req.target_lang!r}", "target_lang")
        max_src = self.engine.max_source_len
        sources: list[list[int]] = []
        shape: list[int] = []  # sentences per text
        source_langs, target_langs = [], []
        for i, text in enumerate(req.texts):
            src_lang = detect_lang(text)
            tgt = req.target_lang or other(src_lang)
            source_langs.append(src_lang)
            target_langs.append(tgt)
            sentences = split_sentences(text) if text.strip() else []
            for sentence in sentences:
                src = encode_source(self.tokenizer, sentence, tgt)
                if len(src) > max_src:
                    raise RequestRejected(f"text {i} has a sentence of {len(src) - 2} tokens; the translator takes "
                                          f"at most {max_src - 2} tokens per sentence", "text")
                sources.append(src)
            shape.append(len(sentences))
        outputs = await self.engine.run(SourceBatch(
            sources, beam_size=req.beam_size, length_penalty=req.length_penalty,
            no_repeat_ngram=req.no_repeat_ngram, max_length=req.max_length, request_id=req.request_id,
            deadline_s=req.deadline_s))
        usage = Usage(prompt_tokens=sum(map(len, sources)), completion_tokens=sum(map(len, outputs)))
        texts, k = [], 0
        for n, lang in zip(shape, target_langs, strict=True):
            parts = [postprocess(self.tokenizer.decode(ids), lang) for ids in outputs[k:k + n]]
            texts.append(join_sentences(parts, lang))
            k += n
        return TranslationResult(translations=texts, source_langs=source_langs, target_langs=target_langs,
                                 usage=usage)
