"""A fixed workload for both engines whose outputs are recorded in tests/data/engine_golden.json: a
refactor of the engines must give byte-identical text, token ids and finish reasons (and the same
log-probabilities to 4 decimals) for it. 50 generation requests (greedy, seeded sampling, penalties,
stops, n > 1, logprobs, prompt scoring, JSON schemas) and 50 translation requests (greedy and beam,
several texts and sentences) are all submitted at once to engines with fewer slots than requests, so
admission, chunked prefill, forks, compaction and beam slot moves all happen.

Regenerate only on purpose (a change that is meant to change outputs):
    .venv/bin/python tests/engine_golden.py --write
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_util import CharTokenizer, run_engine, tiny_llama, tiny_seq2seq  # noqa: E402

from service.engine.config import EngineConfig  # noqa: E402
from service.engine.generation import GenerationEngine  # noqa: E402
from service.engine.translation import TranslationEngine  # noqa: E402
from service.engine.types import GenerateRequest, SamplingParams, TranslateRequest  # noqa: E402
from service.frontend.translator import TranslationFrontend  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "data" / "engine_golden.json"
N_REQUESTS = 50
WORDS = "the cat sat on a mat while dogs ran far away from home and back again".split()
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def translate(engine, req):
    """Through the translator's frontend, as a replica and the CLI build it."""
    return TranslationFrontend(engine, CharTokenizer()).translate(req)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def generation_requests(tok: CharTokenizer) -> list[GenerateRequest]:
    rng = random.Random(1234)
    reqs = []
    for i in range(N_REQUESTS):
        prompt = tok.encode(_text(rng, 1, 12))
        kind = i % 10
        p = SamplingParams(max_new_tokens=rng.randint(4, 24), temperature=0.0)
        n = 1
        if kind == 1:
            p.temperature, p.seed = 0.9, i
        elif kind == 2:
            p.temperature, p.top_k, p.top_p, p.seed = 0.7, 8, 0.9, i
        elif kind == 3:
            p.repetition_penalty, p.presence_penalty, p.frequency_penalty = 1.3, 0.5, 0.4
        elif kind == 4:
            p.stop = [rng.choice("aeiou") + rng.choice("nrst")]
        elif kind == 5:
            p.temperature, p.seed, n = 1.0, i, 3
        elif kind == 6:
            p.logprobs = 2
        elif kind == 7:
            p.prompt_logprobs, p.logprobs = 1, 0
            p.max_new_tokens = 0 if i % 20 == 7 else p.max_new_tokens
        elif kind == 8:
            p.json_schema, p.max_new_tokens = SCHEMA, 40
        elif kind == 9:
            p.logit_bias, p.ignore_eos = {tok.stoi["a"]: 3.0}, True
        reqs.append(GenerateRequest(prompt_ids=prompt, params=p, n=n))
    return reqs


def _lp(lps) -> list | None:
    if lps is None:
        return None
    return [None if lp is None else [lp.token_id, round(lp.logprob, 4), [[t, round(v, 4)] for t, v in lp.top]]
            for lp in lps]


async def _collect(engine: GenerationEngine, req: GenerateRequest) -> list[dict]:
    choices: dict[int, dict] = {}
    async for ev in engine.submit(req):
        c = choices.setdefault(ev.index, {"text": "", "ids": [], "logprobs": [], "finish": None})
        c["text"] += ev.text
        c["ids"] += ev.token_ids
        if ev.logprobs is not None:
            c["logprobs"] += _lp(ev.logprobs)
        if ev.prompt_logprobs is not None:
            c["prompt_logprobs"] = _lp(ev.prompt_logprobs)
        if ev.choice_finished:
            c["finish"] = ev.finish_reason
            c["usage"] = [ev.usage.prompt_tokens, ev.usage.completion_tokens]
            if ev.cumulative_logprob is not None:
                c["cumulative_logprob"] = round(ev.cumulative_logprob, 4)
    return [choices[i] for i in sorted(choices)]


def run_generation() -> list[list[dict]]:
    tok = CharTokenizer(100)
    engine = GenerationEngine(tiny_llama(vocab_size=tok.vocab_size), tok,
                              EngineConfig(max_slots=8, max_seq_len=96, prefill_chunk=6, prefill_budget=16),
                              eos_ids={tok.eos_id})

    async def go(e):
        streams = [_collect(e, r) for r in generation_requests(tok)]
        return await asyncio.gather(*streams)
    return run_engine(engine, go)


def translation_requests() -> list[TranslateRequest]:
    rng = random.Random(4321)
    reqs = []
    for i in range(N_REQUESTS):
        texts = []
        for _ in range(1 + (i % 7 == 0)):  # some requests carry two texts
            # one to three sentences per text, each opening with a capital (as the sentence split expects)
            texts.append(" ".join(_text(rng, 1, 7).capitalize() + rng.choice(".!?")
                                  for _ in range(rng.randint(1, 3))))
        reqs.append(TranslateRequest(texts=texts, target_lang=["zh", "zh", None][i % 3], beam_size=[1, 2, 4][i % 3],
                                     length_penalty=[0.6, 1.0][i % 2], no_repeat_ngram=[0, 3][i % 4 == 1],
                                     max_length=12 if i % 5 == 0 else None))
    return reqs


def run_translation() -> list[dict]:
    engine = TranslationEngine(tiny_seq2seq(), EngineConfig(max_slots=12, max_waiting=512))

    async def go(e):
        results = await asyncio.gather(*(translate(e, r) for r in translation_requests()))
        return [{"translations": r.translations, "target_langs": r.target_langs,
                 "usage": [r.usage.prompt_tokens, r.usage.completion_tokens]} for r in results]
    return run_engine(engine, go)


def run_all() -> dict:
    torch.set_num_threads(1)
    return {"generation": run_generation(), "translation": run_translation()}


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(run_all(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {GOLDEN}")
