"""Where a translation engine step's time goes (issue 5): not a benchmark.

Runs the TranslationEngine (continuous, greedy or beam) on bench_translate's workload (held-out
sentences, alternately en->zh and zh->en, one per request) with N closed-loop clients and reports,
per step (the engine's step hooks): encoder pass, decoder forward, hypothesis advance (argmax / beam
bookkeeping), slot copies, the rest of the step, and time outside steps (plan, deliver, event loop);
then torch.profiler's top operators by self CPU time over a window of steps.

    python -m benchmarks.profile_translate --clients 64 --requests 256 --beam 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.step_profiler import StepProfiler
from model.paths import SHIPPED_TRANSLATOR
from model.progress import progress

ROOT = Path(__file__).resolve().parents[1]


async def run(args) -> None:
    from benchmarks.bench_translate import load, workload
    from service.engine.config import EngineConfig
    from service.engine.cpu_runtime import single_threaded_caller
    from service.engine.translation import TranslationEngine
    from service.engine.types import TranslateRequest
    from service.frontend.translator import TranslationFrontend

    single_threaded_caller()
    model, tok = load(Path(args.checkpoint))
    jobs = workload(SimpleNamespace(requests=args.requests, seed=args.seed), tok, model.cfg)
    cfg = EngineConfig(max_slots=args.clients * args.beam, max_seq_len=model.cfg.max_tgt_len, mode="continuous",
                       dtype=args.dtype, threads=args.threads, max_waiting=args.requests + 1, compile=args.compile,
                       kv_dtype=args.kv_dtype)
    engine = TranslationEngine(model, cfg)
    translator = TranslationFrontend(engine, tok)
    hooks = StepProfiler(lambda step: sum(s.beam.k for s in step.sentences), args.profile_from, args.profile_steps)
    engine.hooks = hooks
    await engine.start()
    await translator.translate(TranslateRequest(["warm-up"], target_lang="zh", beam_size=args.beam))
    hooks.reset()
    queue = [(j["text"], j["tgt"]) for j in reversed(jobs)]
    out = 0

    async def client():
        nonlocal out
        while queue:
            text, tgt = queue.pop()
            r = await translator.translate(TranslateRequest([text], target_lang=tgt, beam_size=args.beam))
            out += r.usage.completion_tokens
            bar.update(1)

    bar = progress(desc="profile_translate", total=len(queue), unit="sentence")
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.clients)))
    wall = time.perf_counter() - t0
    bar.close()
    await engine.stop()
    rows = hooks.rows
    steps = len(rows)
    print(f"translator {args.checkpoint}; dtype {args.dtype}; threads {args.threads}; clients {args.clients}; "
          f"beam {args.beam}; {len(jobs)} sentences, {out} output tokens in {wall:.1f} s = {out / wall:.0f} tok/s")
    print(f"{steps} steps, mean rows {sum(rows) / max(steps, 1):.1f}, {1000 * wall / max(steps, 1):.2f} ms/step")
    hooks.report(("encoder", "decoder forward", "advance", "slot copies"), wall)
    table = hooks.top_ops(args.top)
    if table is not None:
        print(f"\ntorch.profiler, {args.profile_steps} steps from step {args.profile_from}, top operators by self CPU:")
        print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"tok_s": out / wall, "steps": steps, "wall": wall}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default=str(SHIPPED_TRANSLATOR))
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the K/V cache's dtype (EngineConfig.kv_dtype; auto = the compute dtype)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step (EngineConfig.compile)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-from", type=int, default=40, help="first profiled step")
    ap.add_argument("--profile-steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true",
                    help="a random tiny translator (sentences still from the test split): validates the script only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="attnserve-profile-tr-") as tmp:
        if args.tiny:
            sys.path.insert(0, str(ROOT / "tests"))
            from serve_fixture import tiny_checkpoints

            args.checkpoint = str(tiny_checkpoints(Path(tmp))[1])
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
