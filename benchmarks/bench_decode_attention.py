"""Decode attention alone at one step's shape: model.attention.decode_attention on a strided slot-cache view.

    python -m benchmarks.bench_decode_attention --rows 38 --positions 500

Prints ms per layer (both products + softmax) and the K+V bytes read per second, next to two
variants (scores as k @ q^T; a contiguous copy of K/V first). A benchmark: numbers, no assertions.
"""

from __future__ import annotations

import argparse
import time

import torch

from model.attention import decode_attention
from model.progress import progress, write_line


def variants(q, k, v):
    b, h, _, d = q.shape
    hkv = k.shape[1]

    def k_times_q():  # (B, Hkv, L, D) @ (B, Hkv, D, G): the tall product instead of the wide one
        qg = q.view(b, hkv, h // hkv, d)
        scores = (k @ qg.transpose(-1, -2)).transpose(-1, -2) * d ** -0.5  # (B, Hkv, G, L)
        return (torch.softmax(scores, -1) @ v).view(b, h, 1, d)

    return {"engine (decode_attention)": lambda: decode_attention(q, k, v, None),
            "k @ q^T": k_times_q,
            "contiguous K/V first": lambda: decode_attention(q, k.contiguous(), v.contiguous(), None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=38)
    ap.add_argument("--positions", type=int, default=500)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=2048, help="the cache's positions per slot (view stride)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape and 3 iterations: validates the script only")
    args = ap.parse_args()
    if args.tiny:
        args.rows, args.positions, args.kv_heads, args.heads, args.head_dim, args.max_len, args.iters = \
            2, 16, 2, 4, 16, 32, 3
    torch.set_num_threads(args.threads)
    b, n, d = args.rows, args.positions, args.head_dim
    cache = torch.randn(2, b, args.kv_heads, args.max_len, d)  # (K/V, S, Hkv, max_len, D)
    k, v = cache[0, :, :, :n], cache[1, :, :, :n]  # (B, Hkv, L, D) views, as the engine reads them
    q = torch.randn(b, args.heads, 1, d)  # (B, H, 1, D)
    ref = decode_attention(q, k, v, None)
    kv_bytes = 2 * k.numel() * k.element_size()
    print(f"{b} rows x {n} positions, {args.heads} / {args.kv_heads} heads of {d}, fp32, {args.threads} threads\n")
    print("| variant | ms per layer | K+V GB/s |\n|---|---|---|")
    for name, fn in progress(variants(q, k, v).items(), desc="bench_decode_attention", unit="variant"):
        assert torch.allclose(fn(), ref, atol=1e-4), name
        for _ in range(3):
            fn()
        t = time.perf_counter()
        for _ in range(args.iters):
            fn()
        dt = (time.perf_counter() - t) / args.iters
        write_line(f"| {name} | {dt * 1e3:.2f} | {kv_bytes / dt / 1e9:.1f} |")


if __name__ == "__main__":
    main()
