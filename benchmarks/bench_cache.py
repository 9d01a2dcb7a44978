"""Decode speed with the slot KV cache vs. full recomputation (`make bench`). Prints measured numbers.

A SmolLM2-shaped decoder with random weights (the speed does not depend on the weight values)
continues a prompt by N tokens, greedy, at batch 1 and 16, fp32 and bf16:
- cache: prefill once, then one token per step against the KV cache;
- recompute: every step runs the whole sequence so far through the model (no cache).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from model.config import SMOLLM2_135M, TINY_LLAMA
from model.decoder import DecoderLM
from model.progress import progress, write_line


@torch.inference_mode()
def decode_cached(model, prompt: torch.Tensor, new_tokens: int) -> float:
    b, p = prompt.shape
    cache = model.new_cache(b, p + new_tokens)
    slots = torch.arange(b)
    t0 = time.perf_counter()
    logits = model(prompt, torch.arange(p).expand(b, p), cache, slots, output_index=torch.full((b,), p - 1))
    for i in range(new_tokens - 1):
        tok = logits.argmax(-1, keepdim=True)  # (B, 1)
        logits = model(tok, torch.full((b, 1), p + i), cache, slots)[:, -1]
    return time.perf_counter() - t0


@torch.inference_mode()
def decode_recompute(model, prompt: torch.Tensor, new_tokens: int) -> float:
    seq = prompt
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        logits = model(seq)[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-recompute-above", type=int, default=16,
                    help="skip full recomputation for batches larger than this (it is quadratic)")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny random Llama, 4 new tokens, batch 1, fp32: validates the script, not a benchmark")
    args = ap.parse_args(argv)
    cfg = SMOLLM2_135M
    if args.tiny:
        cfg, args.new_tokens, args.prompt, args.batches, args.dtypes = TINY_LLAMA, 4, 4, "1", "float32"
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shape = "TINY random Llama (validation only)" if args.tiny else "SmolLM2-135M shape (random weights)"
    print(f"# decode tokens/s, {shape}, prompt {args.prompt}, "
          f"{args.new_tokens} new tokens, greedy, {args.threads} threads, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}")
    print("| dtype | batch | cache tok/s | recompute tok/s | speed-up |")
    print("|---|---|---|---|---|")
    dtypes, batches = args.dtypes.split(","), [int(x) for x in args.batches.split(",")]
    bar = progress(desc="bench_cache", total=len(dtypes) * len(batches), unit="point")
    for dt in dtypes:
        model = DecoderLM(cfg).eval().to(getattr(torch, dt))
        for b in batches:
            prompt = torch.randint(0, cfg.vocab_size, (b, args.prompt))
            decode_cached(model, prompt[:, :4], 4)  # warm-up
            tc = decode_cached(model, prompt, args.new_tokens)
            cached = b * args.new_tokens / tc
            if b <= args.skip_recompute_above:
                tr = decode_recompute(model, prompt, args.new_tokens)
                full = b * args.new_tokens / tr
                write_line(f"| {dt} | {b} | {cached:.1f} | {full:.1f} | {cached / full:.1f}x |")
            else:
                write_line(f"| {dt} | {b} | {cached:.1f} | skipped | |")
            bar.update(1)
    bar.close()


if __name__ == "__main__":
    main()
