"""Peers for `benchmarks/bench_engine.py`: transformers `generate()` and CTranslate2 `generate_batch` run
the same decoder-only workload on the same weights, in static batches.

Weights: the DecoderLM that bench_engine benchmarks is exported once to the Hugging Face Llama layout
(`model.importers.hf.export_hf`, loaded as `LlamaForCausalLM`) and converted from there to CTranslate2
(`TransformersConverter`, vocabulary `tok<i>` so token ids map 1:1), under
`$ATTNSERVE_HOME/bench/<key>-{hf,ct2-<quantization>}/`.

Workload and batching: the requests of bench_engine in arrival order, cut into batches of up to
`--clients` requests; a batch starts when the previous one has returned (a closed loop of `clients`
callers whose requests return together). Prompts are left-padded (transformers) or given as-is
(CTranslate2, which forwards the common prefix at once and the rest token by token). Every row of a
batch generates max(output length in the batch) tokens with EOS disabled (min length = max length);
only each request's own output length counts as output tokens, so the padding work of static batching
is paid but not credited.

Timing: a hook stamps the time at which each request's tokens exist (transformers: a StoppingCriteria
called once per step, every row gets a token each step; CTranslate2: the per-token `callback`, since a
row with a longer prompt starts generating later). TTFT of a request = its first token's time - batch
start (the time the batch's requests were handed over); ITL = gaps between its consecutive tokens over
its own output length. Both are what a streaming client of a static-batch server would see.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

Job = tuple[list[int], int]  # (prompt token ids, output length)


# --- weights -------------------------------------------------------------------------------------

def bench_dir(key: str) -> Path:
    from model import paths

    return paths.home() / "bench" / key


def ensure_hf(model, key: str) -> Path:
    """The model exported to the Hugging Face Llama layout in fp32 (written once)."""
    import torch

    from model.importers.hf import export_hf

    d = bench_dir(f"{key}-hf")
    if not (d / "model.safetensors").is_file():
        export_hf(model, d, dtype=torch.float32)
    return d


class _IdVocab:
    """What CTranslate2's Llama loader reads from a tokenizer: token `tok<i>` has id i."""

    def __init__(self, config: dict):
        self.n = config["vocab_size"]
        self.bos_token = f"tok{config.get('bos_token_id') or 0}"
        eos = config.get("eos_token_id")
        self.eos_token = f"tok{(eos[0] if isinstance(eos, list) else eos) or 0}"
        self.unk_token = self.eos_token

    def get_vocab(self) -> dict[str, int]:
        return {f"tok{i}": i for i in range(self.n)}


def ensure_ct2(hf_dir: Path, key: str, quantization: str) -> Path:
    """The HF export converted to CTranslate2 with the given quantization (written once)."""
    from ctranslate2.converters import TransformersConverter

    class _Converter(TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return _IdVocab(json.loads((Path(model_name_or_path) / "config.json").read_text()))

    d = bench_dir(f"{key}-ct2-{quantization}")
    if not (d / "model.bin").is_file():
        _Converter(str(hf_dir)).convert(str(d), quantization=quantization, force=True)
    return d


# --- workload ------------------------------------------------------------------------------------

def batches(jobs: list[Job], size: int) -> list[list[Job]]:
    return [jobs[i: i + size] for i in range(0, len(jobs), size)]


def credit(batch: list[Job], t_start: float, rows: list[list[float]], ttft: list[float], itl: list[float]) -> int:
    """Add each request's TTFT and ITL from its row's token times; return the batch's credited output tokens."""
    for (_, n), times in zip(batch, rows):
        if len(times) < n:
            raise RuntimeError(f"the peer produced {len(times)} tokens for a request of {n}")
        ttft.append(times[0] - t_start)
        itl.extend(b - a for a, b in zip(times[: n - 1], times[1:n]))
    return sum(n for _, n in batch)


# --- transformers --------------------------------------------------------------------------------

def run_hf(hf_dir: Path, dtype: str, jobs: list[Job], clients: int) -> tuple[float, int, list, list]:
    """(wall seconds, output tokens, ttft, itl) of transformers generate() over static batches."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=getattr(torch, dtype)).eval()
    steps: list[float] = []  # one time per step: every row gets a token at each step

    class Stamp(transformers.StoppingCriteria):  # called once per step, after the step's tokens exist
        def __call__(self, input_ids, scores, **kwargs):
            steps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def generate(batch: list[Job]) -> None:
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])  # (B, T) left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])  # (B, T)
        n = max(k for _, k in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=0, stopping_criteria=transformers.StoppingCriteriaList([Stamp()]))

    def timed(batch: list[Job]) -> list[list[float]]:
        steps.clear()
        generate(batch)
        return [list(steps)] * len(batch)

    timed([([100] * 8, 2)])  # warm-up
    return _timed(timed, jobs, clients)


# --- CTranslate2 ---------------------------------------------------------------------------------

def run_ct2(ct2_dir: Path, compute_type: str, threads: int, jobs: list[Job],
            clients: int) -> tuple[float, int, list, list]:
    """(wall seconds, output tokens, ttft, itl) of CTranslate2 Generator.generate_batch over static batches."""
    import ctranslate2

    gen = ctranslate2.Generator(str(ct2_dir), device="cpu", compute_type=compute_type, intra_threads=threads,
                                inter_threads=1)
    def timed(batch: list[Job]) -> list[list[float]]:
        # rows whose prompt is longer than the batch's shortest are fed the rest of it token by token first,
        # so rows start generating at different steps: stamp each row's own tokens (callback per token)
        rows: list[list[float]] = [[] for _ in batch]

        def on_token(r) -> bool:
            rows[r.batch_id].append(time.perf_counter())
            return False

        n = max(k for _, k in batch)
        gen.generate_batch([[f"tok{i}" for i in p] for p, _ in batch], max_length=n, min_length=n,
                           include_prompt_in_result=False, beam_size=1, callback=on_token)
        return rows

    timed([([100] * 8, 2)])  # warm-up
    return _timed(timed, jobs, clients)


def _timed(timed, jobs: list[Job], clients: int) -> tuple[float, int, list, list]:
    """Run the batches one after the other; `timed(batch)` -> per-row token times."""
    ttft: list[float] = []
    itl: list[float] = []
    out = 0
    t0 = time.perf_counter()
    for batch in batches(jobs, clients):
        t = time.perf_counter()
        out += credit(batch, t, timed(batch), ttft, itl)
    return time.perf_counter() - t0, out, ttft, itl
