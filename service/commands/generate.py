"""attnserve generate "prompt" [--chat] [--max-tokens N] [--temperature T] [--top-p P] [--seed S]

Streams a completion from the local SmolLM2 model to the terminal, without Ray: one KV-cache slot,
prefill the prompt in one forward pass, then one token per step, sampled by the engine's
`sample_next` and printed through the incremental detokenizer (never half a UTF-8 character).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator


def add_arguments(p):
    p.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--system", help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, help="seed for sampling (same seed, same text)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--quantization", choices=["none", "int8", "int4", "auto"], default="none",
                   help="int8 / int4 linears (model/quantize.py); auto = the fastest on this CPU")


def stream(model, tokenizer, prompt_ids: list[int], params, stop_ids: set[int],
           stats: dict | None = None) -> Iterator[str]:
    """Yield text deltas of one sequence. `stats` (if given) receives prefill_s, decode_s, tokens."""
    import torch

    from model.tokenizer import IncrementalDetokenizer
    from service.engine.sampling import make_generator, sample_next

    n = len(prompt_ids)
    max_len = n + params.max_new_tokens
    if max_len > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({n} tokens) + max tokens ({params.max_new_tokens}) exceeds the model's "
                         f"context of {model.cfg.max_seq_len}")
    cache = model.new_cache(1, max_len)
    gen = make_generator(params.seed)
    detok = IncrementalDetokenizer(tokenizer, skip_ids=stop_ids)
    history: list[int] = list(prompt_ids)
    stats = stats if stats is not None else {}
    t0 = time.perf_counter()
    with torch.inference_mode():
        tokens = torch.tensor([prompt_ids])  # (1, T)
        positions = torch.arange(n)[None]  # (1, T)
        logits = model(tokens, positions, cache, [0], output_index=torch.tensor([n - 1]))  # (1, V)
        stats["prefill_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        generated = 0
        for step in range(params.max_new_tokens):
            tok = sample_next(logits.float(), [params], [gen], [history])[0]
            history.append(tok)
            generated += 1
            stats["tokens"] = generated
            if tok in stop_ids and not params.ignore_eos:
                break
            delta = detok.push(tok)
            if delta:
                yield delta
            if step + 1 < params.max_new_tokens:
                pos = torch.tensor([[n + step]])  # (1, 1)
                logits = model(torch.tensor([[tok]]), pos, cache, [0], output_index=torch.tensor([0]))
        stats["decode_s"] = time.perf_counter() - t1
        stats["ids"] = history[n:]
    tail = detok.flush()
    if tail:
        yield tail


def run(args) -> int:
    import torch

    from model.chat import render_chat
    from model.importers.smollm2 import load_smollm2
    from service.engine.types import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        print("attnserve generate: empty prompt", file=sys.stderr)
        return 2
    if args.max_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        print("attnserve generate: need --max-tokens >= 1, --temperature >= 0, 0 < --top-p <= 1", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model, tok = load_smollm2(args.dtype, log=lambda m: print(m, file=sys.stderr))
    label = args.dtype
    if args.quantization != "none":
        from model.quantize import choose_quantization, quantize_decoder

        mode = choose_quantization(model.embed.weight.dtype) if args.quantization == "auto" else args.quantization
        quantize_decoder(model, tok, mode)
        label = f"{args.dtype}, {mode} linears"
    print(f"[loaded smollm2-135m-instruct {label} in {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        prompt = render_chat(tok.chat_template, messages, add_generation_prompt=True)
    ids = tok.encode(prompt)
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    stats: dict = {}
    try:
        for delta in stream(model, tok, ids, params, tok.stop_ids(), stats):
            sys.stdout.write(delta)
            sys.stdout.flush()
    except ValueError as e:
        print(f"attnserve generate: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    n = stats.get("tokens", 0)
    print(f"[prompt {len(ids)} tokens in {stats['prefill_s']:.2f} s; {n} new tokens in {stats['decode_s']:.2f} s"
          f" = {n / max(stats['decode_s'], 1e-9):.1f} tok/s]", file=sys.stderr)
    return 0
