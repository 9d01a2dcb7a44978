"""Quality of each quantization mode against full precision on SmolLM2: perplexity on a fixed held-out
text and greedy agreement on chat prompts.

    python -m benchmarks.quant_quality [--modes none int8 int4] [--prompts 40] [--new-tokens 64]

Perplexity: loadtests/data/heldout_en.txt (text written for this project, never seen in training),
windows of --window tokens, every token predicted once. Agreement: loadtests/data/prompts.jsonl in the
model's chat template, greedy, --new-tokens each; per mode, the share of prompts whose whole continuation
equals fp32's and the mean number of leading tokens that match. Prints a table and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from model.chat import render_chat
from model.importers.smollm2 import load_smollm2
from model.paths import REPO_ROOT
from model.progress import progress
from model.quantize import QUANTIZATIONS, quantize_decoder

TEXT = REPO_ROOT / "loadtests/data/heldout_en.txt"
PROMPTS = REPO_ROOT / "loadtests/data/prompts.jsonl"


@torch.inference_mode()
def perplexity(model, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start:start + window + 1]])  # (1, T + 1)
        logits = model(chunk[:, :-1]).float()  # (1, T, V)
        nll += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count)


@torch.inference_mode()
def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    cache = model.new_cache(1, len(prompt) + new_tokens)
    positions = torch.arange(len(prompt))[None]  # (1, T)
    logits = model(torch.tensor([prompt]), positions, cache=cache, slots=[0])[:, -1]  # (1, V)
    out = []
    for i in range(new_tokens):
        tok = int(logits.argmax(-1))
        out.append(tok)
        pos = torch.tensor([[len(prompt) + i]])
        logits = model(torch.tensor([[tok]]), pos, cache=cache, slots=[0])[:, -1]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(QUANTIZATIONS), choices=QUANTIZATIONS)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the model's dtype after quantizing, as the engine casts it (served on bf16 CPUs: bfloat16)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_smollm2("float32", log=lambda *_: None)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    text_ids = tok.encode(TEXT.read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = [tok.encode(render_chat(tok.chat_template, r["messages"])) for r in rows[:a.prompts]]
    ref: list[list[int]] | None = None
    results = {}
    for mode in a.modes:
        m = quantize_copy(model, state, tok, mode).to(getattr(torch, a.dtype))
        ppl = perplexity(m, text_ids, a.window)
        outs = [greedy(m, pr, a.new_tokens) for pr in progress(prompts, desc=f"greedy {mode}", unit="prompt")]
        if ref is None:
            ref = outs
        same = sum(o == r for o, r in zip(outs, ref))
        lead = sum(next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), len(o)) for o, r in zip(outs, ref))
        results[mode] = {"perplexity": ppl, "identical": same / len(outs), "mean_leading_match": lead / len(outs)}
    base = results[a.modes[0]]["perplexity"]
    print(f"held-out text: {len(text_ids)} tokens; {len(prompts)} prompts x {a.new_tokens} greedy tokens; "
          f"reference: {a.modes[0]}; model in {a.dtype} around the quantized linears")
    print("| mode | perplexity | vs reference | identical continuations | mean leading tokens equal |")
    print("|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / base - 1):+.2f} % | "
              f"{100 * r['identical']:.0f} % | {r['mean_leading_match']:.1f} / {a.new_tokens} |")
    if a.out:
        a.out.write_text(json.dumps(results, indent=2))
    return results


def quantize_copy(model, state, tok, mode):
    import copy

    m = copy.deepcopy(model)
    m.load_state_dict(state)
    if mode != "none":
        quantize_decoder(m, tok, mode)
    return m.eval()


if __name__ == "__main__":
    main()
