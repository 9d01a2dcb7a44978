"""`attnserve generate "prompt"` (flags: `--help`) streams a completion from SmolLM2 to the terminal,
without Ray: the generator is built from the Serve config's spec as a replica builds it (each setting
overridable here), so the same request gives the same text here as from `/v1/generate` on this host.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from model.quantize import QUANTIZATIONS
from service.commands import CommandError, as_command_error, check_at_least_one


def add_arguments(p):
    p.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, help="new tokens at most (default: 128, or what the context has "
                   "left, as /v1/generate)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), at most 2")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this times the top one's probability")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off (default), at most 2")
    p.add_argument("--seed", type=int, help="seed for sampling (same seed, same text)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the output where this text would begin (not printed); repeatable")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], help="default: as served")
    p.add_argument("--quantization", choices=[*QUANTIZATIONS, "auto"], help="default: as served")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: as served")
    p.add_argument("--threads", type=int, help="torch threads (default: as served)")
    p.add_argument("--eager", action="store_true", help="do not compile the step (the service compiles it)")
    p.add_argument("--config", help="Serve config whose generator settings to use (default: deploy/serve_config.yaml)")
    p.add_argument("--model", help="checkpoint folder, ours or a Llama, Mistral, Qwen2 or GPT-2 folder as "
                   "transformers saves it (default: the served generator's)")


def stream_engine(engine, prompt_ids: list[int], params, stats: dict | None = None) -> Iterator[str]:
    """Start `engine` (a GenerationEngine, not started), yield the text deltas of one request, stop it.
    `stats` (if given) receives prefill_s (submit -> first token), decode_s, tokens (generated, a stop token
    included) and ids (the output's ids: no stop id). A request that does not fit raises RequestRejected
    naming the option."""
    from service.engine.types import GenerateRequest

    stats = stats if stats is not None else {}
    loop = asyncio.new_event_loop()
    events = reading = None
    try:
        loop.run_until_complete(engine.start())

        async def submit():
            names = {"max_new_tokens": "--max-tokens", "prompt_ids": "the prompt", "top_p": "--top-p",
                     "top_k": "--top-k", "min_p": "--min-p", "temperature": "--temperature",
                     "repetition_penalty": "--repetition-penalty", "seed": "--seed", "stop": "--stop"}
            return engine.submit(GenerateRequest(list(prompt_ids), params, field_names=names))

        events = loop.run_until_complete(submit())
        t0 = time.perf_counter()
        ids: list[int] = []
        stats.update(prefill_s=0.0, decode_s=0.0, tokens=0, ids=ids)
        while True:
            reading = asyncio.ensure_future(anext(events), loop=loop)  # a task, so Ctrl-C mid-read can cancel it below
            try:
                ev = loop.run_until_complete(reading)
            except StopAsyncIteration:
                break
            now = time.perf_counter()
            if not ids and ev.token_ids:
                stats["prefill_s"], t1 = now - t0, now
            ids.extend(ev.token_ids)
            stats["tokens"] = len(ids)
            if ids:
                stats["decode_s"] = now - t1
            if ev.text:
                yield ev.text
            if ev.finish_reason is not None:
                stats["tokens"] = ev.usage.completion_tokens  # a stop token counts, as in the API's usage
                break
    finally:
        try:
            if reading is not None and not reading.done():  # interrupted mid-read: the stream is still running
                reading.cancel()
                loop.run_until_complete(asyncio.gather(reading, return_exceptions=True))
            if events is not None:
                loop.run_until_complete(events.aclose())
        finally:
            loop.run_until_complete(engine.stop())
            loop.close()


def check_sampling_flags(args) -> None:
    """CommandError naming the flag where /v1/generate would answer 400 (its schema's bounds, before the
    model loads); --top-p and --max-tokens are the engine's to check, as for a request."""
    import pydantic

    from service.api.schemas import Sampling

    flags = {"temperature": "--temperature", "repetition_penalty": "--repetition-penalty", "top_k": "--top-k",
             "min_p": "--min-p", "seed": "--seed"}
    try:
        Sampling.model_validate({field: getattr(args, field) for field in flags})
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        msg = first["msg"].removeprefix("Input should be ")
        raise CommandError(f"{flags[first['loc'][0]]} must be {msg}, got {first['input']}") from None


def run(args) -> int:
    from model.quantize import quantization_of
    from service import local
    from service.api.native import DEFAULT_MAX_TOKENS
    from service.engine.cpu_runtime import single_threaded_caller
    from service.engine.types import EngineError, SamplingParams
    from service.models import ModelUnavailable, load_generator

    if args.system is not None and not args.chat:
        raise CommandError("--system needs --chat (a system message goes into the chat template)")
    check_at_least_one(max_tokens=args.max_tokens, threads=args.threads)
    check_sampling_flags(args)
    try:
        prompt = args.prompt if args.prompt is not None else sys.stdin.read() if sys.stdin is not None else ""
        prompt.encode("utf-8")  # bytes that were not UTF-8 come as lone surrogates
    except UnicodeError:
        raise CommandError("the prompt is not UTF-8 text") from None
    if not prompt.strip():
        raise CommandError("empty prompt")
    # load on this thread single-threaded: the engine's own thread runs the steps (service/engine/cpu_runtime.py)
    single_threaded_caller()
    t0 = time.perf_counter()
    with as_command_error(ModelUnavailable, OSError, RuntimeError, ValueError):  # CheckpointError is a ValueError
        spec = local.generator_spec(config=args.config, dtype=args.dtype, quantization=args.quantization,
                                    device=args.device, threads=args.threads, compile=False if args.eager else None,
                                    checkpoint=str(Path(args.model).resolve()) if args.model else None)
        generator = load_generator(spec, log=lambda m: print(m, file=sys.stderr))
    engine = generator.engine
    mode = quantization_of(engine.model)
    label = engine.config.dtype if mode == "none" else f"{engine.config.dtype}, {mode} linears"
    print(f"[loaded {generator.name} {label} in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    if engine.config.compile:
        print("[compiling the step (once per host) or loading it from $ATTNSERVE_HOME/compile]", file=sys.stderr)
    stats: dict = {}
    with as_command_error(EngineError):  # a rejection (the field named) or a failed step
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            ids = generator.encode_chat([*messages, {"role": "user", "content": prompt}])
        else:
            ids = generator.encode_prompt(prompt)
        room = engine.max_context - len(ids)  # as /v1/generate: 128 new tokens, fewer when the context ends sooner
        max_tokens = args.max_tokens if args.max_tokens is not None else max(1, min(DEFAULT_MAX_TOKENS, room))
        params = SamplingParams(max_new_tokens=max_tokens, temperature=args.temperature,
                                top_k=max(args.top_k, 0), top_p=args.top_p, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop)
        for delta in stream_engine(engine, ids, params, stats):
            sys.stdout.write(delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    n, decode_s = stats["tokens"], stats["decode_s"]
    rate = f" = {n / decode_s:.1f} tok/s" if decode_s > 0 else ""  # one token: it came with the prefill, no decode
    print(f"[prompt {len(ids)} tokens in {stats['prefill_s']:.2f} s; {n} new tokens in {decode_s:.2f} s{rate}]",
          file=sys.stderr)
    return 0
