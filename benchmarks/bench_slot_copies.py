"""K/V slot copies alone (beam reorders, compaction): `KVCache.copy_slots`'s two ways of copying.

    python -m benchmarks.bench_slot_copies

Disjoint source and target slots (every copy the engines make) take one `copy_` per slot over all
layers (`_copy_per_slot`); overlapping ones gather each layer's slots first (`_copy_gathered`). Both are
timed on the same copies, with lengths drawn around the given mean, without and with the cross-attention
K/V (up to each source's length). A benchmark: numbers, no assertions.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from model.kv_cache import KVCache
from model.progress import progress, write_line


def median_ms(fn, n: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[n // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--positions", type=int, nargs="+", default=[24, 60], help="mean positions per copy")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--src-len", type=int, default=40, help="source tokens per slot (cross K/V)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--tiny", action="store_true", help="a tiny cache, few copies and iterations: validates the script")
    args = ap.parse_args()
    if args.tiny:
        args.copies, args.positions, args.layers, args.slots, args.heads, args.head_dim = [2, 4], [6], 2, 16, 2, 8
        args.max_len, args.src_len, args.iters = 16, 4, 3
    torch.set_num_threads(args.threads)
    cache = KVCache(args.layers, args.slots, args.heads, args.max_len, args.head_dim, cross_len=args.max_len,
                    dtype=getattr(torch, args.dtype))
    cache.src_len.fill_(args.src_len)
    rng = random.Random(0)
    print(f"KVCache({args.layers}, {args.slots}, {args.heads}, {args.max_len}, {args.head_dim}, cross_len="
          f"{args.max_len}), {args.dtype}, {args.threads} threads, sources of {args.src_len} tokens, torch "
          f"{torch.__version__}\n")
    print("| copies | ~positions | gathered / with cross K/V (ms) | per slot / with cross K/V (ms) |")
    print("|---|---|---|---|")
    bar = progress(desc="bench_slot_copies", total=len(args.copies) * len(args.positions), unit="point")
    for n in args.copies:
        for mean in args.positions:
            slots = rng.sample(range(args.slots), 2 * n)
            src, dst = slots[:n], slots[n:]
            lengths = [min(args.max_len, max(1, round(rng.gauss(mean, mean / 3)))) for _ in range(n)]
            cross = [args.src_len] * n
            self_bufs = [(cache.k, lengths), (cache.v, lengths)]
            all_bufs = self_bufs + [(cache.cross_k, cross), (cache.cross_v, cross)]
            ms = [median_ms(lambda f=f, b=b, s=src, d=dst: f(b, s, d), args.iters)
                  for f in (cache._copy_gathered, cache._copy_per_slot) for b in (self_bufs, all_bufs)]
            write_line(f"| {n} | {mean} | {ms[0]:.3f} / {ms[1]:.3f} | {ms[2]:.3f} / {ms[3]:.3f} |")
            bar.update(1)
    bar.close()


if __name__ == "__main__":
    main()
