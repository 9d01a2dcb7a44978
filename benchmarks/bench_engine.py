"""Engine benchmark (`make bench-engine`): our engine's continuous / static / serial batching, and peers.

N concurrent closed-loop clients share R generation requests with prompt and output lengths drawn
from fixed-seed ranges (greedy, ignore_eos, so every run does the same work). Each run (one mode and
dtype of our GenerationEngine, or one peer: `hf:<dtype>` = transformers generate(), `ct2:<compute type>`
= CTranslate2 generate_batch, see benchmarks/bench_peers.py) goes in its own subprocess: honest peak
RSS, no thread settings or warm caches shared. Prints a markdown table: output tok/s, req/s, TTFT
p50/p95, inter-token latency p50/p95, peak RSS. Uses the converted SmolLM2-135M-Instruct checkpoint
when present, else random weights of the same shape (labelled as such); every run uses the same weights.

    python -m benchmarks.bench_engine --dtype float32 bfloat16 --peers hf:float32 hf:bfloat16 ct2:float32 ct2:int8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time

# torch is imported inside functions: the CTranslate2 child never loads it (honest RSS)
# --tiny: a small random Llama for validating the script in seconds (not a benchmark)
TINY = dict(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=1024,
            norm="rmsnorm", positions="rope", mlp="swiglu", attn_bias=False, mlp_bias=False, norm_bias=False,
            tie_embeddings=True)

HOW = ("How measured: our engine streams each request (TTFT = submit -> first token event, ITL = gaps "
       "between token events, one closed-loop client per slot; static mode admits a new batch only when the "
       "previous one has finished). Peers run static batches of up to `clients` requests in arrival order; "
       "each row generates max(outputs in its batch) tokens, only each request's own length is counted; "
       "their TTFT = batch start -> the request's first token, ITL = gaps between its tokens (stamped by a "
       "per-step StoppingCriteria in transformers, the per-token callback in CTranslate2). Peak RSS = VmHWM "
       "of each run's own process.")


class ByteTok:  # random weights: any id decodes to one character
    bos_id, eos_id, pad_id = None, None, None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def load_model(dtype: str = "float32", tiny: bool = False):
    """(model, tokenizer, eos ids, label, key): key names the weights for the peers' exported copies."""
    import torch

    from model.config import SMOLLM2_135M, DecoderConfig
    from model.decoder import DecoderLM
    from model.importers.smollm2 import checkpoint_dir, is_converted

    d = checkpoint_dir("float32")
    if not tiny and is_converted(d):
        from model.checkpoint import load_checkpoint, load_tokenizer

        tok = load_tokenizer(d)
        return (load_checkpoint(d, dtype=getattr(torch, dtype)), tok, {tok.eos_id},
                f"SmolLM2-135M-Instruct ({d.name})", "smollm2-135m-instruct")
    cfg = DecoderConfig(**TINY) if tiny else SMOLLM2_135M
    torch.manual_seed(0)
    model = DecoderLM(cfg).to(getattr(torch, dtype))
    if tiny:
        return model, ByteTok(cfg.vocab_size), set(), "TINY random Llama (validation only)", "tiny-random"
    return (model, ByteTok(cfg.vocab_size), set(), "RANDOM weights, SmolLM2-135M shape (no checkpoint found)",
            "random-smollm2-shape")


def workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    hi = min(40000, vocab_size)
    return [([rng.randrange(100, hi) for _ in range(rng.randint(*args.prompt))], rng.randint(*args.output))
            for _ in range(args.requests)]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: reset at exec, unlike ru_maxrss, which a child inherits from the
    parent it was forked from)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def result(engine: str, dtype: str, label: str, wall: float, out_tokens: int, n_requests: int,
           ttft: list[float], itl: list[float]) -> dict:
    return dict(engine=engine, dtype=dtype, label=label, wall_s=wall, out_tok_s=out_tokens / wall,
                req_s=n_requests / wall, ttft_p50=pct(ttft, 0.5), ttft_p95=pct(ttft, 0.95), itl_p50=pct(itl, 0.5),
                itl_p95=pct(itl, 0.95), rss_mb=peak_rss_mb(),
                out_tokens=out_tokens)


async def run_ours(args, mode: str, dtype: str, quantization: str = "none") -> dict:
    from service.engine.config import EngineConfig
    from service.engine.generation import GenerationEngine
    from service.engine.types import GenerateRequest, SamplingParams

    model, tok, eos, label, _ = load_model(dtype, args.tiny)
    if quantization != "none":
        from model.quantize import quantize_decoder

        quantize_decoder(model, tok, quantization)
        dtype = f"{dtype}+{quantization}"
    # a compiled step needs >= 2 slots (service/engine/compiled.py); one client uses one of them
    cfg = EngineConfig(max_slots=max(args.clients, 2), max_seq_len=args.prompt[1] + args.output[1] + 1, mode=mode,
                       dtype=dtype.split("+")[0], threads=args.threads, decode_threads=args.decode_threads,
                       max_waiting=args.requests + 1,
                       prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget,
                       kv_dtype=args.kv_dtype, prefill_max_padding=args.prefill_max_padding, compile=args.compile,
                       device=args.device)
    engine = GenerationEngine(model, tok, cfg, eos_ids=eos)
    await engine.start()
    jobs = workload(args, model.cfg.vocab_size)
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
    return result(engine_label(engine, mode), dtype, label, wall, out_tokens, len(jobs), ttft, itl)


def engine_label(engine, mode: str) -> str:
    """'attnserve <mode>', with the compile time when compiled; exits if compiling was asked for and failed."""
    if engine.config.compile and engine.compiled is None:
        raise SystemExit("compiling the decode step failed (see the log above)")
    compiled = f" (compiled, {engine.compiled.compile_seconds:.0f} s)" if engine.config.compile else ""
    return f"attnserve {mode}{compiled}"


def run_peer(args, peer: str, dtype: str) -> dict:
    from benchmarks import bench_peers

    vocab = json.loads((args.hf_dir / "config.json").read_text())["vocab_size"]
    jobs = workload(args, vocab)
    if peer == "hf":
        wall, out, ttft, itl = bench_peers.run_hf(args.hf_dir, dtype, jobs, args.clients)
        name = "transformers generate (static)"
    else:
        wall, out, ttft, itl = bench_peers.run_ct2(args.ct2_dir, dtype, args.threads, jobs, args.clients)
        name = "CTranslate2 generate_batch (static)"
    return result(name, dtype, args.label, wall, out, len(jobs), ttft, itl)


def run_one(args) -> dict:
    """The `--run SPEC` child: `ours:<mode>:<dtype>`, `hf:<dtype>` or `ct2:<compute type>`."""
    parts = args.run.split(":")
    if parts[0] == "ours":  # the engine sets args.threads on its own thread; this one stays at 1
        from service.engine.cpu_runtime import single_threaded_caller

        single_threaded_caller()
    elif parts[0] != "ct2":
        import torch

        torch.set_num_threads(args.threads)
    if parts[0] == "ours":
        return asyncio.run(run_ours(args, parts[1], parts[2], parts[3] if len(parts) > 3 else "none"))
    return run_peer(args, parts[0], parts[1])


def child_cmd(args, spec: str, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.bench_engine", "--run", spec, "--clients", str(args.clients),
           "--requests", str(args.requests), "--prompt", *map(str, args.prompt), "--output", *map(str, args.output),
           "--threads", str(args.threads), "--prefill-chunk", str(args.prefill_chunk),
           *(["--decode-threads", str(args.decode_threads)] if args.decode_threads else []),
           "--prefill-budget", str(args.prefill_budget), "--seed", str(args.seed), "--kv-dtype", args.kv_dtype,
           "--prefill-max-padding", str(args.prefill_max_padding), "--device", args.device] + (
               ["--compile"] if args.compile else [])
    return cmd + (["--tiny"] if args.tiny else []) + extra


def prepare_peers(args) -> tuple[str, dict[str, list[str]]]:
    """Export / convert the weights the peers need (once, cached); the extra child arguments per peer."""
    from pathlib import Path

    from benchmarks import bench_peers

    model, _, _, label, key = load_model("float32", args.tiny)
    hf_dir = bench_peers.ensure_hf(model, key)
    del model
    extra = {}
    for spec in args.peers:
        peer, dtype = spec.split(":")
        if peer == "hf":
            extra[spec] = ["--hf-dir", str(hf_dir), "--label", label]
        elif peer == "ct2":
            d = bench_peers.ensure_ct2(Path(hf_dir), key, dtype)
            extra[spec] = ["--hf-dir", str(hf_dir), "--ct2-dir", str(d), "--label", label]
        else:
            raise SystemExit(f"unknown peer {spec!r}: use hf:<float32|bfloat16> or ct2:<float32|int8|...>")
    return label, extra


def device_note(device: str) -> str:
    """', on <GPU name>' when our engine ran on a GPU."""
    import torch

    return f"; our engine on {torch.cuda.get_device_name(torch.device(device))}" if device.startswith("cuda") else ""


def print_table(args, rows: list[dict]) -> None:
    import torch

    borrowed = f" (decode steps of 1-2 rows: {args.decode_threads})" if args.decode_threads else ""
    print(f"Model: {rows[0]['label']}; torch threads {args.threads}{borrowed}; {args.clients} clients, {args.requests} "
          f"requests, prompt {args.prompt[0]}-{args.prompt[1]}, output {args.output[0]}-{args.output[1]} tokens, "
          f"greedy, ignore_eos, seed {args.seed}; {platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}{device_note(args.device)}\n")
    print("| engine | dtype | output tok/s | req/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | peak RSS (MB) "
          "| wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['dtype']} | {r['out_tok_s']:.1f} | {r['req_s']:.2f} | {r['ttft_p50']:.2f} / "
              f"{r['ttft_p95']:.2f} | {r['itl_p50'] * 1e3:.0f} / {r['itl_p95'] * 1e3:.0f} | {r['rss_mb']:.0f} "
              f"| {r['wall_s']:.1f} |")
    if args.peers:
        print(f"\n{HOW}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients = slots = peers' batch size")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--modes", nargs="*", default=["continuous", "static", "serial"])
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                    help="dtypes of our engine (each mode runs in each)")
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "int4"],
                    help="linear layers of our engine (model/quantize.py); each runs in each mode and dtype")
    ap.add_argument("--peers", nargs="*", default=[],
                    help="e.g. hf:float32 hf:bfloat16 ct2:float32 ct2:int8 (same weights, static batches)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads; CTranslate2 intra_threads")
    ap.add_argument("--decode-threads", type=int, default=None,
                    help="EngineConfig.decode_threads: threads a decode step of 1-2 rows borrows (as served: 2 "
                         "with --threads 1)")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--prefill-budget", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="KV cache dtype (EngineConfig.kv_dtype; auto = the weights' dtype)")
    ap.add_argument("--prefill-max-padding", type=float, default=0.25,
                    help="EngineConfig.prefill_max_padding (1e9 = one padded prefill forward per step)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step (EngineConfig.compile)")
    ap.add_argument("--device", default="cpu", help="our engine's device (EngineConfig.device): cpu or cuda[:N]")
    ap.add_argument("--tiny", action="store_true", help="tiny random model: validates the script, not a benchmark")
    for internal in ("--run", "--hf-dir", "--ct2-dir", "--label"):  # the child's arguments
        ap.add_argument(internal, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        from pathlib import Path

        args.hf_dir = Path(args.hf_dir) if args.hf_dir else None
        args.ct2_dir = Path(args.ct2_dir) if args.ct2_dir else None
        print(json.dumps(run_one(args)))
        return
    specs = {f"ours:{m}:{d}:{q}": [] for q in args.quantization for d in args.dtype for m in args.modes}
    if args.peers:
        specs.update(prepare_peers(args)[1])
    from model.progress import progress, write_line  # here: the children's RSS is measured

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    rows = []
    bar = progress(desc="bench_engine", total=len(specs), unit="run")
    for spec, extra in specs.items():
        bar.set_postfix_str(spec)
        proc = subprocess.run(child_cmd(args, spec, extra), capture_output=True, text=True, env=env)
        bar.update(1)
        if proc.returncode != 0:
            write_line(f"# {spec} FAILED (rc {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        write_line(f"# {spec}: {rows[-1]['out_tok_s']:.1f} output tok/s", file=sys.stderr)
    bar.close()
    if rows:
        print_table(args, rows)
    if len(rows) < len(specs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
