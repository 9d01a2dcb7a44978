"""Does `compile: true` change what the translator says? Translate held-out sentences through the
TranslationEngine eagerly and compiled (same weights, dtype, batching), and compare: how many outputs
are identical, and sacreBLEU of each against the references (zh output with sacreBLEU's zh tokenizer).

    python -m benchmarks.check_compiled_translator --sentences 400 --dtype bfloat16 --beam 1
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from model.paths import SHIPPED_TRANSLATOR

ROOT = Path(__file__).resolve().parents[1]


async def translate_all(jobs, checkpoint: Path, dtype: str, beam: int, compile_: bool, clients: int,
                        threads: int = 2):
    from benchmarks.bench_translate import load
    from model.progress import progress
    from service.engine.config import EngineConfig
    from service.engine.translation import TranslationEngine
    from service.engine.types import TranslateRequest
    from service.frontend.translator import TranslationFrontend

    model, tok = load(checkpoint)
    cfg = EngineConfig(max_slots=clients * beam, max_seq_len=model.cfg.max_tgt_len, dtype=dtype, threads=threads,
                       max_waiting=len(jobs) + 1, compile=compile_)
    engine = TranslationEngine(model, cfg)
    translator = TranslationFrontend(engine, tok)
    await engine.start()
    if compile_ and engine.compiled is None:
        raise SystemExit("compiling failed (see the log)")
    out: list[str | None] = [None] * len(jobs)
    queue = list(reversed(range(len(jobs))))

    async def client():
        while queue:
            i = queue.pop()
            req = TranslateRequest([jobs[i]["text"]], target_lang=jobs[i]["tgt"], beam_size=beam)
            r = await translator.translate(req)
            out[i] = r.translations[0]
            bar.update(1)

    bar = progress(desc="compiled" if compile_ else "eager", total=len(jobs), unit="sentence")
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    bar.close()
    await engine.stop()
    return out, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(SHIPPED_TRANSLATOR))
    ap.add_argument("--sentences", type=int, default=400)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    ap.add_argument("--tiny", action="store_true",
                    help="a random tiny translator (sentences still from the test split): validates the script only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="attnserve-check-compiled-") as tmp:
        if args.tiny:
            sys.path.insert(0, str(ROOT / "tests"))
            from serve_fixture import tiny_checkpoints

            args.checkpoint = tiny_checkpoints(Path(tmp))[1]
        check(args)


def check(args) -> None:
    import sacrebleu

    from benchmarks.bench_translate import load, workload
    from model import paths
    from service.engine.cpu_runtime import single_threaded_caller

    single_threaded_caller()
    checkpoint = Path(args.checkpoint)
    model, tok = load(checkpoint)
    jobs = workload(SimpleNamespace(requests=args.sentences, seed=args.seed), tok, model.cfg)
    del model
    refs = {}
    for line in (paths.home() / "data" / "translate" / "test.tsv").read_text(encoding="utf-8").splitlines():
        en, zh = (line.split("\t") + [""])[:2]
        refs[en], refs[zh] = zh, en
    runs = {c: asyncio.run(translate_all(jobs, checkpoint, args.dtype, args.beam, c, args.clients, args.threads))
            for c in (False, True)}
    same = sum(a == b for a, b in zip(runs[False][0], runs[True][0], strict=True))
    print(f"{checkpoint}; {len(jobs)} test sentences (half each direction), {args.dtype}, beam {args.beam}, "
          f"{args.clients} clients\n")
    print(f"identical outputs eager vs compiled: {same} / {len(jobs)}\n")
    print("| engine | zh->en BLEU | en->zh BLEU | wall (s) |")
    print("|---|---|---|---|")
    for c, (outs, wall) in runs.items():
        bleu = {}
        for tgt, tokenize in (("en", "13a"), ("zh", "zh")):
            idx = [i for i, j in enumerate(jobs) if j["tgt"] == tgt]
            bleu[tgt] = sacrebleu.corpus_bleu([outs[i] for i in idx], [[refs[jobs[i]["text"]] for i in idx]],
                                              tokenize=tokenize).score
        print(f"| {'compiled' if c else 'eager'} | {bleu['en']:.2f} | {bleu['zh']:.2f} | {wall:.3f} |")


if __name__ == "__main__":
    main()
