"""lm-eval's `local-completions` against the running service vs lm-eval scoring the same weights in-process
(issue 22): a loglikelihood (multiple-choice) task and a generate-until task from local files
(loadtests/data/lm_eval/), the same accuracy within 1 item in 500.

The service: the app (the same FastAPI object Ray Serve runs) on loopback with SmolLM2-135M-Instruct in
float32, served by uvicorn in this process. lm-eval sends token ids (`tokenized_requests`), scoring with
echo + logprobs + max_tokens 1; its tokenizer is ours, loaded by transformers from the converted
checkpoint's tokenizer.json (no hub download). The reference: benchmarks/lm_eval_reference.py, full forwards
of the same weights, no engine. Prints each task's metrics for both, the items where they differ, and exits
1 if a metric differs by more than 1/500.

Run from the repository root (the task files name their data relative to it):

    python -m benchmarks.lm_eval_parity [--limit N] [--num-concurrent 8] [--batch-size 4]

The same local-completions run by lm-eval's command line against `make serve` (or this app):

    lm_eval --model local-completions --include_path loadtests/data/lm_eval --tasks attnserve_mc,attnserve_gen \\
      --model_args model=smollm2-135m-instruct,base_url=http://127.0.0.1:8000/v1/completions,\\
    tokenizer_backend=huggingface,tokenizer=$HOME/.cache/attnserve/checkpoints/smollm2-135m-instruct-float32,\\
    num_concurrent=8,max_retries=1
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parents[1] / "loadtests" / "data" / "lm_eval"
TASKS = ["attnserve_mc", "attnserve_gen"]
TOLERANCE = 1 / 500
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tokenizer and the datasets are local files
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@contextmanager
def serve(model, tok, threads: int):
    """Base URL of the app, served by uvicorn on loopback in a background thread."""
    import socket

    import uvicorn

    from service.api.app import create_app
    from service.api.backends import Backends
    from service.config import GENERATOR_ID, TRANSLATOR_ID
    from service.engine.config import EngineConfig
    from service.engine.generation import GenerationEngine
    from service.frontend.generator import GeneratorFrontend

    engine = GenerationEngine(model, tok, EngineConfig(max_slots=16, max_seq_len=2048, threads=threads),
                              eos_ids=tok.stop_ids(), name=GENERATOR_ID)
    backends = Backends(generator=GeneratorFrontend(engine, tok, name=GENERATOR_ID, chat_template=tok.chat_template),
                        unavailable={TRANSLATOR_ID: "not needed here"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(backends, None, manage_engines=True, api_keys=[]),
                                           host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="lm-eval-service", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the service did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def evaluate(model, model_args: dict | None, tasks: list[str], limit: int | None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, limit=limit, log_samples=True,
                           task_manager=TaskManager(include_path=str(TASKS_DIR)), bootstrap_iters=0)


def metrics(result: dict, task: str) -> dict[str, float]:
    return {k.split(",")[0]: v for k, v in result["results"][task].items()
            if isinstance(v, float) and "stderr" not in k}


def per_item(result: dict, task: str) -> dict[int, tuple]:
    """doc id -> (its metric values, what the model answered: generated text, or each choice's log-likelihood)."""
    out = {}
    for s in result["samples"][task]:
        scores = tuple(s[m] for m in ("acc", "acc_norm", "exact_match") if m in s)
        resp = s["filtered_resps"]
        out[s["doc_id"]] = (scores, resp[0] if isinstance(resp[0], str) else [float(r[0]) for r in resp])
    return out


def compare(served: dict, reference: dict, tasks: list[str]) -> tuple[list[str], bool]:
    lines = ["| task | metric | local-completions (service) | in-process reference | difference | items |",
             "|---|---|---|---|---|---|"]
    notes, ok = [], True
    for task in tasks:
        a, b = metrics(served, task), metrics(reference, task)
        items = len(served["samples"][task])
        for name in a:
            diff = a[name] - b[name]
            ok &= abs(diff) <= TOLERANCE + 1e-12
            lines.append(f"| {task} | {name} | {a[name]:.4f} | {b[name]:.4f} | {diff:+.4f} | {items} |")
        pa, pb = per_item(served, task), per_item(reference, task)
        differing = [d for d in pa if pa[d][0] != pb[d][0]]
        note = f"{task}: {len(differing)} of {items} items scored differently"
        if all(isinstance(pa[d][1], list) for d in pa):
            gap = max(abs(x - y) for d in pa for x, y in zip(pa[d][1], pb[d][1], strict=True))
            note += f"; largest log-likelihood difference of a choice {gap:.2e}"
        else:
            note += f"; {sum(pa[d][1] != pb[d][1] for d in pa)} generated answers differ in text"
        notes.append(note + "".join(f"\n  doc {d}: service {pa[d]} vs reference {pb[d]}" for d in differing[:10]))
    return lines + [""] + notes, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="first N items of each task (all by default)")
    ap.add_argument("--tasks", nargs="+", default=TASKS, choices=TASKS)
    ap.add_argument("--num-concurrent", type=int, default=8, help="lm-eval's concurrent requests")
    ap.add_argument("--batch-size", type=int, default=1, help="lm-eval's prompts per request")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (engine and reference)")
    args = ap.parse_args(argv)

    import torch

    from benchmarks.lm_eval_reference import ReferenceLM
    from model.checkpoint import load_checkpoint, load_tokenizer
    from model.importers.smollm2 import ensure_smollm2
    from service.config import GENERATOR_ID

    torch.set_num_threads(args.threads)
    d = ensure_smollm2("float32")
    model, tok = load_checkpoint(d, dtype=torch.float32), load_tokenizer(d)
    t0 = time.perf_counter()
    with serve(model, tok, args.threads) as url:
        served = evaluate("local-completions", {
            "model": GENERATOR_ID, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": str(d), "num_concurrent": args.num_concurrent, "batch_size": args.batch_size, "max_retries": 1,
            "timeout": 600},
            args.tasks, args.limit)
    t1 = time.perf_counter()
    reference = evaluate(ReferenceLM(model, tok, tok.stop_ids()), None, args.tasks, args.limit)
    t2 = time.perf_counter()
    lines, ok = compare(served, reference, args.tasks)
    print("\n".join(lines))
    print(f"local-completions {t1 - t0:.0f} s, reference {t2 - t1:.0f} s; "
          f"{'within' if ok else 'NOT within'} 1 item in 500")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
