"""The CUDA path, checked against the CPU: both engines, seeded sampling, bf16, `compile` (eager on a GPU), training.

Runs where torch sees a GPU (a lent GPU machine: `benchmarks/gpu_check.sh`); on a CPU-only host every
test here is skipped with that reason (`pytest -ra` lists it). fp32 on both devices, tiny random models
with decisive logits: the tokens must be the same; bf16 on the GPU must keep the greedy path of fp32
for its first tokens.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
from engine_util import CharTokenizer, run_engine, tiny_llama, tiny_seq2seq

from service.engine.config import EngineConfig
from service.engine.generation import GenerationEngine
from service.engine.translation import TranslationEngine
from service.engine.types import GenerateRequest, SamplingParams, TranslateRequest
from service.frontend.translator import TranslationFrontend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch")

TOK = CharTokenizer()


def requests(seed: int, n: int, sampled: bool) -> list[GenerateRequest]:
    rng = random.Random(seed)
    return [GenerateRequest([rng.randrange(5, TOK.vocab_size) for _ in range(rng.randint(1, 40))],
                            SamplingParams(max_new_tokens=rng.randint(1, 30),
                                           temperature=rng.choice([0.0, 1.0]) if sampled else 0.0,
                                           top_p=0.9 if sampled else 1.0, seed=rng.randint(0, 99), ignore_eos=True))
            for _ in range(n)]


def generate(device: str, reqs: list[GenerateRequest], dtype: str = "float32", engines: list | None = None,
             **kw) -> list[list[int]]:
    """Every request at once through a continuous engine on `device`: each one's token ids (the engine is
    appended to `engines`)."""
    cfg = EngineConfig(device=device, dtype=dtype, max_slots=16, max_seq_len=128, prefill_chunk=8,
                       prefill_budget=24, **kw)
    engine = GenerationEngine(tiny_llama(), TOK, cfg, eos_ids={TOK.eos_id})
    if engines is not None:
        engines.append(engine)

    async def one(e, req):
        ids = []
        async for ev in e.submit(req):
            ids += ev.token_ids
        return ids

    async def all_of(e):
        return await asyncio.gather(*(one(e, r) for r in reqs))

    return run_engine(engine, all_of)


def test_generation_engine_on_cuda_matches_cpu_greedy_and_seeded():
    reqs = requests(0, 24, sampled=True)  # more requests than slots: admission and compaction on the GPU
    assert generate("cuda", reqs) == generate("cpu", reqs)


def test_generation_bf16_on_cuda_keeps_the_greedy_path():
    reqs = requests(1, 8, sampled=False)
    ref = generate("cpu", reqs)
    out = generate("cuda", reqs, dtype="bfloat16")
    assert [len(o) for o in out] == [len(r) for r in ref]
    same_first = sum(o[:4] == r[:4] for o, r in zip(out, ref))
    assert same_first >= 6, (out, ref)


def translate(device: str, texts: list[str], beam: int) -> list[str]:
    engine = TranslationEngine(tiny_seq2seq(), EngineConfig(device=device, max_slots=24, max_waiting=256))
    front = TranslationFrontend(engine, TOK)

    async def go(e):
        res = await front.translate(TranslateRequest(texts=texts, target_lang="zh", beam_size=beam))
        return res.translations

    return run_engine(engine, go)


@pytest.mark.parametrize("beam", [1, 4])
def test_translation_engine_on_cuda_matches_cpu(beam):
    rng = random.Random(3)
    words = "the cat sat on a mat while dogs ran far away from home".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))) for _ in range(12)]
    assert translate("cuda", texts, beam) == translate("cpu", texts, beam)


def test_training_on_cuda_drops_loss_and_resumes_on_cpu(tiny_run, tmp_path):
    from model.training.train_translate import train

    path, cfg, data, run = tiny_run
    # the GPU's dropout, native bf16 and batches of few shapes
    cfg["model"]["dropout"], cfg["bf16"], cfg["shape_multiple"] = 0.1, "auto", 8
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, export_to=tmp_path / "export", device="cuda")
    log = [json.loads(line) for line in (run / "train.log").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < 0.6 * losses[0], losses
    assert next(r for r in log if r.get("event") == "start")["config"]["bf16"] is True
    cfg["max_steps"] = 170
    path.write_text(json.dumps(cfg))
    train(path, run, data_dir=data, resume=True, export_to=tmp_path / "export2", device="cpu")
    assert json.loads((run / "state.json").read_text())["step"] == 170


def test_compile_on_cuda_serves_eagerly():
    reqs = requests(2, 12, sampled=False)
    engines = []
    assert generate("cuda", reqs, engines=engines, compile=True) == generate("cuda", reqs)
    assert engines[0].compiled is None  # the compiled steps are CPU-only: the engine said so and ran eagerly
