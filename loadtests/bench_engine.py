"""Engine-only benchmark (`make bench-engine`): continuous vs static vs serial batching.

N concurrent closed-loop clients share R generation requests with prompt and output lengths drawn
from fixed-seed ranges (greedy, ignore_eos, so every mode does the same work). Each mode runs in
its own subprocess (clean peak RSS, no warm caches shared). Prints a markdown table: output tok/s,
req/s, TTFT p50/p95, inter-token latency p50/p95, peak RSS. Uses the converted SmolLM2-135M-Instruct
checkpoint when present, else random weights of the same shape (labelled as such).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import resource
import subprocess
import sys
import time

import torch


def load_model(dtype: str):
    from model.importers.smollm2 import checkpoint_dir, is_converted

    d = checkpoint_dir("float32")
    if is_converted(d):
        from model.checkpoint import load_checkpoint, load_tokenizer

        tok = load_tokenizer(d)
        return load_checkpoint(d, dtype=getattr(torch, dtype)), tok, {tok.eos_id}, f"SmolLM2-135M-Instruct ({d.name})"
    from model.config import SMOLLM2_135M
    from model.decoder import DecoderLM

    class ByteTok:  # random weights: any id decodes to one character
        vocab_size, bos_id, eos_id, pad_id = SMOLLM2_135M.vocab_size, None, None, None

        def decode(self, ids):
            return "".join(chr(65 + i % 26) for i in ids)

    torch.manual_seed(0)
    return DecoderLM(SMOLLM2_135M), ByteTok(), set(), "RANDOM weights, SmolLM2-135M shape (no checkpoint found)"


def workload(args) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(*args.prompt))], rng.randint(*args.output))
            for _ in range(args.requests)]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_mode(args) -> dict:
    from service.engine.config import EngineConfig
    from service.engine.generation import GenerationEngine
    from service.engine.types import GenerateRequest, SamplingParams

    torch.set_num_threads(args.threads)
    model, tok, eos, label = load_model(args.dtype)
    cfg = EngineConfig(max_slots=args.clients, max_seq_len=args.prompt[1] + args.output[1] + 1, mode=args.mode,
                       dtype=args.dtype, threads=args.threads, max_waiting=args.requests + 1,
                       prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget)
    engine = GenerationEngine(model, tok, cfg, eos_ids=eos)
    await engine.start()
    jobs = workload(args)
    queue = list(reversed(jobs))
    ttft, itl, out_tokens = [], [], 0

    async def client():
        nonlocal out_tokens
        while queue:
            prompt, n = queue.pop()
            t0 = time.perf_counter()
            last = None
            req = GenerateRequest(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
            async for ev in engine.submit(req):
                now = time.perf_counter()
                if ev.token_ids:
                    if last is None:
                        ttft.append(now - t0)
                    else:
                        itl.append(now - last)
                    last = now
                if ev.finished:
                    out_tokens += ev.usage.completion_tokens

    # warm-up: one short request (first-call allocations)
    async for _ in engine.submit(GenerateRequest([100] * 8, SamplingParams(max_new_tokens=2, ignore_eos=True))):
        pass
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.clients)))
    wall = time.perf_counter() - t0
    await engine.stop()
    return dict(mode=args.mode, label=label, wall_s=wall, out_tok_s=out_tokens / wall, req_s=len(jobs) / wall,
                ttft_p50=pct(ttft, 0.5), ttft_p95=pct(ttft, 0.95), itl_p50=pct(itl, 0.5), itl_p95=pct(itl, 0.95),
                rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, out_tokens=out_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--modes", nargs="+", default=["continuous", "static", "serial"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--prefill-budget", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # internal: run one mode, print JSON
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(asyncio.run(run_mode(args))))
        return
    rows = []
    for mode in args.modes:
        cmd = [sys.executable, "-m", "loadtests.bench_engine", "--mode", mode] + [
            a for a in sys.argv[1:] if a != "--modes" and a not in args.modes]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
        print(f"# {mode}: {rows[-1]['out_tok_s']:.1f} output tok/s", file=sys.stderr)
    print(f"Model: {rows[0]['label']}; dtype {args.dtype}; torch threads {args.threads}; "
          f"{args.clients} clients, {args.requests} requests, prompt {args.prompt[0]}-{args.prompt[1]}, "
          f"output {args.output[0]}-{args.output[1]} tokens, greedy, ignore_eos, seed {args.seed}; "
          f"{platform.machine()} {torch.get_num_threads()} threads available, torch {torch.__version__}\n")
    print("| mode | output tok/s | req/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | peak RSS (MB) | wall (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['out_tok_s']:.1f} | {r['req_s']:.2f} | {r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} "
              f"| {r['itl_p50'] * 1e3:.0f} / {r['itl_p95'] * 1e3:.0f} | {r['rss_mb']:.0f} | {r['wall_s']:.1f} |")


if __name__ == "__main__":
    main()
