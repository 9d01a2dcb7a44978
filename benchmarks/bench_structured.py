"""Structured output's cost in the continuous batch (issue 22): output tok/s at 16 streams with half the rows
constrained by a JSON schema vs none, and the inter-token latency of the rows that never are.

Engine only (SmolLM2-135M-Instruct, greedy). 16 closed-loop clients each send `--requests` chat requests
whose prompt is a shipped schema's description (loadtests/data/schemas/). In the `half` run the even
clients ask for JSON following that schema (llguidance token mask, service/engine/structured.py); the odd
clients never do: `--max-tokens` tokens with ignore_eos. In the `none` run the even clients send the same
prompts unconstrained, ignore_eos, each for exactly as many tokens as its JSON took in the `half` run just
before: both runs do the same prefills and decode the same number of tokens, so only the mask differs.
A first `half` run warms up (llguidance's tokenizer, schema compiles) and is not counted; then the two
alternate for `--rounds` (a shared host drifts). Also timed in each run: the grammar work (filling the
masks, applying them, advancing the matchers) against the whole of the engine's steps, a share that
other jobs on a shared host disturb less than tok/s.

    python -m benchmarks.bench_structured --clients 16 --requests 3 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from benchmarks.step_profiler import WHOLE, StepProfiler
from loadtests.schemas import load_schemas


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def build(args):
    from model.chat import render_chat
    from model.checkpoint import load_checkpoint, load_tokenizer
    from model.importers.smollm2 import ensure_smollm2
    from service.engine.config import EngineConfig
    from service.engine.generation import GenerationEngine

    d = ensure_smollm2("float32")
    tok = load_tokenizer(d)
    cfg = EngineConfig(max_slots=args.clients, max_seq_len=2048, threads=args.threads, dtype=args.dtype,
                       compile=args.compile)
    engine = GenerationEngine(load_checkpoint(d, dtype=cfg.torch_dtype), tok, cfg, eos_ids=tok.stop_ids())
    schemas = load_schemas()
    work = []  # per client: [(prompt ids, schema)]
    for c in range(args.clients):
        reqs = []
        for j in range(args.requests):
            s = schemas[(c * args.requests + j) % len(schemas)]
            text = f"{s['description']} Reply in JSON."
            reqs.append((tok.encode(render_chat(tok.chat_template, [{"role": "user", "content": text}], True)), s))
        work.append(reqs)
    return engine, work


async def run(engine, timer, work, args, mode: str, lengths: dict) -> dict:
    """mode half: even clients constrained (their lengths recorded); none: even clients unconstrained for the
    recorded lengths. Odd clients: unconstrained, --max-tokens each, in both."""
    from service.engine.types import GenerateRequest, SamplingParams

    itl: list[float] = []  # odd clients only
    tokens = 0

    async def client(c: int):
        nonlocal tokens
        for j, (ids, schema) in enumerate(work[c]):
            if c % 2 == 0 and mode == "half":
                p = SamplingParams(max_new_tokens=args.json_max_tokens, temperature=0, json_schema=schema)
            elif c % 2 == 0:
                p = SamplingParams(max_new_tokens=lengths[c, j], temperature=0, ignore_eos=True)
            else:
                p = SamplingParams(max_new_tokens=args.max_tokens, temperature=0, ignore_eos=True)
            n, last = 0, None
            async for ev in engine.submit(GenerateRequest(prompt_ids=ids, params=p)):
                now = time.perf_counter()
                if ev.token_ids and c % 2 == 1 and last is not None:
                    itl.append(now - last)
                if ev.token_ids:
                    last = now
                n += len(ev.token_ids)
                if ev.finished:
                    n = ev.usage.completion_tokens
            if c % 2 == 0 and mode == "half":
                lengths[c, j] = n
            tokens += n

    t0 = time.perf_counter()
    steps0, grammar0, step0 = engine.steps, timer.total["grammar"], timer.total[WHOLE]
    await asyncio.gather(*[client(c) for c in range(len(work))])
    wall = time.perf_counter() - t0
    steps = engine.steps - steps0
    return {"mode": mode, "tok_s": tokens / wall, "tokens": tokens, "wall": wall, "steps": steps,
            "itl_p50": pct(itl, 0.5) * 1e3, "itl_p95": pct(itl, 0.95) * 1e3,
            "step_ms": (timer.total[WHOLE] - step0) / steps * 1e3,
            "grammar_ms": (timer.total["grammar"] - grammar0) / steps * 1e3}


async def main_async(args) -> None:
    engine, work = build(args)
    timer = StepProfiler()  # the engine's "grammar" phase (masks, matcher advance) and whole steps
    engine.hooks = timer
    await engine.start()
    lengths: dict = {}
    try:
        warm = await run(engine, timer, work, args, "half", lengths)
        print(f"warm-up (not counted): {warm['tok_s']:.1f} tok/s, JSON lengths "
              f"{sorted(lengths.values())}", flush=True)
        rows = []
        for _ in range(args.rounds):
            for mode in ("none", "half"):
                r = await run(engine, timer, work, args, mode, lengths)
                rows.append(r)
                print(f"{mode}: {r['tok_s']:.1f} tok/s ({r['tokens']} tokens, {r['wall']:.1f} s, {r['steps']} steps, "
                      f"{r['step_ms']:.1f} ms/step of which grammar {r['grammar_ms']:.2f}), unconstrained ITL p50 "
                      f"{r['itl_p50']:.1f} ms, p95 {r['itl_p95']:.1f} ms", flush=True)
    finally:
        await engine.stop()
    none = [r for r in rows if r["mode"] == "none"]
    half = [r for r in rows if r["mode"] == "half"]
    ratios = [h["tok_s"] / n["tok_s"] for n, h in zip(none, half)]
    print(f"\n{args.clients} streams, {args.requests} requests each, {args.dtype}, compile={args.compile}, "
          f"threads={args.threads}, rounds={args.rounds}\n")
    print("| rows constrained | output tok/s (mean of rounds) | unconstrained rows' ITL p50 / p95 ms "
          "| engine step ms | of which grammar ms |")
    print("|---|---|---|---|---|")
    for name, rs in (("none", none), ("half", half)):
        each = ", ".join(f"{r['tok_s']:.1f}" for r in rs)
        m = {k: statistics.mean(r[k] for r in rs) for k in ("tok_s", "itl_p50", "itl_p95", "step_ms", "grammar_ms")}
        print(f"| {name} | {m['tok_s']:.1f} ({each}) | {m['itl_p50']:.1f} / {m['itl_p95']:.1f} "
              f"| {m['step_ms']:.1f} | {m['grammar_ms']:.2f} |")
    print(f"\nhalf / none, round by round: {', '.join(f'{x:.1%}' for x in ratios)}; "
          f"mean {statistics.mean(ratios):.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=3, help="requests per client per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens of each unconstrained request")
    ap.add_argument("--json-max-tokens", type=int, default=256, help="max_new_tokens of a constrained request")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="engine torch threads (the serving default is 1)")
    ap.add_argument("--compile", action="store_true", help="compiled decode steps (make serve's default)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
