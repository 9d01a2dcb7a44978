"""Single-stream SmolLM2-135M speed: our DecoderLM vs transformers on the same weights and prompt.

Prints prefill tokens/s (one forward over the prompt) and decode tokens/s (greedy, one token per
forward with a KV cache) for fp32 and bf16. Not a test: numbers depend on the machine and its load.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_smollm2.py --threads 2
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from model.progress import progress, write_line

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. The story should "
          "have a beginning, a middle and an end, and it should be told in the first person. ")


def make_prompt(tok, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(PROMPT)
    return ids[:n]


@torch.inference_mode()
def bench_ours(model, ids: list[int], new: int, reps: int) -> tuple[float, float]:
    n = len(ids)
    x, pos = torch.tensor([ids]), torch.arange(n)[None]
    cache = model.new_cache(1, n + new)
    model(x[:, :8], pos[:, :8], cache, [0])  # warm-up
    prefill = []
    for _ in range(reps):
        t = time.perf_counter()
        logits = model(x, pos, cache, [0], output_index=torch.tensor([n - 1]))  # (1, V)
        prefill.append(time.perf_counter() - t)
    tok = int(logits.argmax(-1))
    t = time.perf_counter()
    for i in range(new):
        logits = model(torch.tensor([[tok]]), torch.tensor([[n + i]]), cache, [0], output_index=torch.tensor([0]))
        tok = int(logits.argmax(-1))
    decode = time.perf_counter() - t
    return n / min(prefill), new / decode


@torch.inference_mode()
def bench_hf(model, ids: list[int], new: int, reps: int) -> tuple[float, float]:
    from transformers import DynamicCache

    n = len(ids)
    x = torch.tensor([ids])
    model(x[:, :8])  # warm-up
    prefill = []
    for _ in range(reps):
        cache = DynamicCache()
        t = time.perf_counter()
        out = model(x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill.append(time.perf_counter() - t)
    tok = int(out.logits[0, -1].argmax())
    t = time.perf_counter()
    for _ in range(new):
        out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
        tok = int(out.logits[0, -1].argmax())
    decode = time.perf_counter() - t
    return n / min(prefill), new / decode


class _ByteTok:  # --tiny: token ids are the prompt's bytes
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def tiny_models(with_hf: bool, workdir: str):
    """--tiny: a random tiny Llama (bench_engine's TINY shape) and, with `with_hf`, the same weights loaded by
    transformers from an export to the Hugging Face layout in `workdir`."""
    from benchmarks.bench_engine import TINY
    from model.config import DecoderConfig
    from model.decoder import DecoderLM

    torch.manual_seed(0)
    ours = DecoderLM(DecoderConfig(**TINY)).eval()
    hf = None
    if with_hf:
        import transformers

        from model.importers.hf import export_hf

        export_hf(ours, workdir, dtype=torch.float32)
        hf = transformers.LlamaForCausalLM.from_pretrained(workdir, dtype=torch.float32).eval()
    return ours, _ByteTok(), hf


def smollm2_models(with_hf: bool):
    from model.importers.smollm2 import gguf_path, load_smollm2

    ours, tok = load_smollm2("float32")
    hf = None
    if with_hf:
        import transformers

        g = gguf_path()
        hf = transformers.AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32).eval()
    return ours, tok, hf


def report(args, name: str, ids: list[int], ours, hf) -> None:
    print(f"{name}, prompt {len(ids)} tokens, {args.new_tokens} new tokens greedy, batch 1, "
          f"torch {torch.__version__}, {args.threads} threads")
    print(f"{'engine':<14}{'dtype':<10}{'prefill tok/s':>15}{'decode tok/s':>15}")
    peers = [("attnserve", ours, bench_ours)] + ([("transformers", hf, bench_hf)] if hf is not None else [])
    bar = progress(desc="bench_smollm2", total=2 * len(peers), unit="point")
    for dtype in (torch.float32, torch.bfloat16):
        for name, model, fn in peers:
            model.to(dtype)
            p, d = fn(model, ids, args.new_tokens, args.reps)
            write_line(f"{name:<14}{str(dtype).removeprefix('torch.'):<10}{p:>15.1f}{d:>15.1f}")
            bar.update(1)
    bar.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="prefill repetitions (best is reported)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny random Llama, 16 prompt and 8 new tokens: validates the script, not a benchmark")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="attnserve-bench-smollm2-") as tmp:
        if args.tiny:
            args.prompt_tokens, args.new_tokens, args.reps = 16, 8, 1
            ours, tok, hf = tiny_models(not args.no_transformers, tmp)
        else:
            ours, tok, hf = smollm2_models(not args.no_transformers)
        ids = make_prompt(tok, args.prompt_tokens)
        name = "TINY random Llama (validation only)" if args.tiny else "SmolLM2-135M-Instruct"
        report(args, name, ids, ours, hf)


if __name__ == "__main__":
    main()
