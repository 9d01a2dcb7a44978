"""Where an engine step's time goes (issue 5's "profile, say where the time goes"): not a benchmark.

Runs the GenerationEngine in continuous mode on the bench_engine workload (SmolLM2-135M-Instruct when
converted, else random weights of its shape) with N closed-loop clients and reports, through the engine's
step hooks, wall time split into prefill forward, decode forward, sampling, slot copies, the rest of the
step and the time outside steps (planning, delivery, the event loop); then torch.profiler's top operators
by self CPU time over a window of steps.

    python -m benchmarks.profile_engine --clients 16 --requests 32 --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import time

from benchmarks.bench_engine import load_model, workload
from benchmarks.step_profiler import StepProfiler
from model.progress import progress


async def run(args) -> None:
    from service.engine.config import EngineConfig
    from service.engine.cpu_runtime import single_threaded_caller
    from service.engine.generation import GenerationEngine
    from service.engine.types import GenerateRequest, SamplingParams

    single_threaded_caller()  # the engine runs args.threads on its own thread
    model, tok, eos, label, _ = load_model(args.dtype, args.tiny)
    if args.quantization != "none":
        from model.quantize import quantize_decoder

        quantize_decoder(model, tok, args.quantization)
        label += f", {args.quantization}"
    cfg = EngineConfig(max_slots=args.clients, max_seq_len=args.prompt[1] + args.output[1] + 1, mode="continuous",
                       dtype=args.dtype, threads=args.threads, decode_threads=args.decode_threads,
                       prefill_chunk=args.prefill_chunk,
                       prefill_budget=args.prefill_budget, compile=args.compile)
    engine = GenerationEngine(model, tok, cfg, eos_ids=eos)
    hooks = StepProfiler(lambda plan: len(plan.prefill) + len(plan.decode), args.profile_from, args.profile_steps)
    engine.hooks = hooks

    work = workload(args, model.cfg.vocab_size)
    await engine.start()

    async def client(queue):
        while queue:
            prompt, n = queue.pop()
            req = GenerateRequest(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
            async for _ in engine.submit(req):
                pass
            bar.update(1)

    queue = list(reversed(work))
    bar = progress(desc="profile_engine", total=len(work), unit="req")
    t0 = time.perf_counter()
    await asyncio.gather(*(client(queue) for _ in range(args.clients)))
    wall = time.perf_counter() - t0
    bar.close()
    await engine.stop()
    batch_sizes = hooks.rows
    steps = len(batch_sizes)
    out_tokens = sum(n for _, n in work)
    print(f"model: {label}; dtype {args.dtype}; threads {args.threads}; clients {args.clients}; "
          f"{len(work)} requests, {out_tokens} output tokens in {wall:.1f} s = {out_tokens / wall:.1f} tok/s")
    print(f"{steps} steps, mean batch {sum(batch_sizes) / max(steps, 1):.1f}, "
          f"{1000 * wall / max(steps, 1):.1f} ms/step")
    hooks.report(("prefill forward", "decode forward", "sampling", "slot copies"), wall)
    table = hooks.top_ops(args.top)
    if table is not None:
        print(f"\ntorch.profiler, {args.profile_steps} steps from step {args.profile_from}, top operators by self CPU:")
        print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, nargs=2, default=[16, 256])
    ap.add_argument("--output", type=int, nargs=2, default=[16, 256])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-threads", type=int, default=None, help="EngineConfig.decode_threads (default: --threads)")
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4"], help="model/quantize.py")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step (EngineConfig.compile)")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--prefill-budget", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-from", type=int, default=50, help="first profiled step")
    ap.add_argument("--profile-steps", type=int, default=40)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny random model: validates the script, not a profile")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
