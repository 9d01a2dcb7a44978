"""Where an engine step's time goes (issue 5's "profile, say where the time goes"): not a benchmark.

Runs the GenerationEngine in continuous mode on the bench_engine workload (SmolLM2-135M-Instruct when
converted, else random weights of its shape) with N closed-loop clients and reports, per engine step:
wall time split into prefill forward, decode forward, sampling, and the rest of the step (planning,
delivery, the event loop); then torch.profiler's top operators by self CPU time over a window of steps.

    python -m benchmarks.profile_engine --clients 16 --requests 32 --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict

from benchmarks.bench_engine import load_model, workload
from model.progress import progress


class Timers:
    def __init__(self):
        self.total = defaultdict(float)
        self.count = defaultdict(int)

    def wrap(self, name_of, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                name = name_of(*a, **kw)
                self.total[name] += time.perf_counter() - t0
                self.count[name] += 1
        return timed

    def report(self, names, rest: str, steps: int, wall: float) -> None:
        """Markdown table: each timed part, the rest of `execute (whole)`, and the time outside it."""
        print("\n| part of a step | total s | % of wall | calls | ms/call |\n|---|---|---|---|---|")
        whole = self.total["execute (whole)"]
        parts = [(k, self.total[k], self.count[k]) for k in names]
        parts.append((rest, whole - sum(v for _, v, _ in parts), steps))
        parts.append(("outside _execute (plan, deliver, event loop)", wall - whole, steps))
        for k, v, n in parts:
            print(f"| {k} | {v:.2f} | {100 * v / wall:.1f} | {n} | {1000 * v / max(n, 1):.3f} |")


async def run(args) -> None:
    import torch

    import service.engine.generation as gen_mod
    from service.engine.config import EngineConfig
    from service.engine.cpu_runtime import single_threaded_caller
    from service.engine.generation import GenerationEngine
    from service.engine.types import GenerateRequest, SamplingParams

    single_threaded_caller()  # the engine runs args.threads on its own thread
    model, tok, eos, label, _ = load_model(args.dtype, args.tiny)
    cfg = EngineConfig(max_slots=args.clients, max_seq_len=args.prompt[1] + args.output[1] + 1, mode="continuous",
                       dtype=args.dtype, threads=args.threads, prefill_chunk=args.prefill_chunk,
                       prefill_budget=args.prefill_budget, compile=args.compile)
    engine = GenerationEngine(model, tok, cfg, eos_ids=eos)
    t = Timers()
    model.forward = t.wrap(lambda tokens, *a, **kw: "decode forward" if tokens.shape[1] == 1 else "prefill forward",
                           model.forward)
    gen_mod.sample_next = t.wrap(lambda *a, **kw: "sampling", gen_mod.sample_next)
    engine.cache.copy_slots = t.wrap(lambda *a, **kw: "slot copies (compaction)", engine.cache.copy_slots)
    engine._execute = t.wrap(lambda *a, **kw: "execute (whole)", engine._execute)
    batch_sizes: list[int] = []
    plan = engine._plan

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    window = {"on": False, "done": False}

    def counting_plan():
        p = plan()
        if p is not None:
            batch_sizes.append(len(p.prefill) + len(p.decode))
        return p
    engine._plan = counting_plan
    execute = engine._execute

    def profiled_execute(p):  # the worker thread: torch.profiler records the thread it starts on
        n = len(batch_sizes)
        if n == args.profile_from and not window["on"]:
            prof.start()
            window["on"] = True
        elif n == args.profile_from + args.profile_steps and window["on"]:
            prof.stop()
            window.update(on=False, done=True)
        return execute(p)
    engine._execute = profiled_execute

    work = workload(args, model.cfg.vocab_size)
    await engine.start()
    if engine.compiled is not None:  # compiled in start(): the decode step no longer calls model.forward
        engine.compiled.decode = t.wrap(lambda *a, **kw: "decode forward", engine.compiled.decode)

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
    if window["on"]:
        prof.stop()
    steps = len(batch_sizes)
    out_tokens = sum(n for _, n in work)
    print(f"model: {label}; dtype {args.dtype}; threads {args.threads}; clients {args.clients}; "
          f"{len(work)} requests, {out_tokens} output tokens in {wall:.1f} s = {out_tokens / wall:.1f} tok/s")
    print(f"{steps} steps, mean batch {sum(batch_sizes) / max(steps, 1):.1f}, "
          f"{1000 * wall / max(steps, 1):.1f} ms/step")
    t.report(("prefill forward", "decode forward", "sampling", "slot copies (compaction)"),
             "rest of _execute (tensors in, tokens out)",
             steps, wall)
    if steps <= args.profile_from:  # the profiler window never opened (e.g. --profile-from 100000)
        return
    print(f"\ntorch.profiler, {args.profile_steps} steps from step {args.profile_from}, top operators by self CPU:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, nargs=2, default=[16, 256])
    ap.add_argument("--output", type=int, nargs=2, default=[16, 256])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
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
