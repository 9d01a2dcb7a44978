"""Per-step cost of a JSON-schema token mask with each grammar library (issue 22, structured output).

16 rows, each under one of the shipped schemas (loadtests/data/schemas/, cycled), over the SmolLM2
vocabulary (49 152 tokens, built from our tokenizer's bytes). A step = fill the 16 rows' bitmasks, apply
them to a (16, V) float32 logits tensor, and advance every row by one token. The token is drawn at random
from the allowed ones (fixed seed): no model runs, so the figure is the grammar's own cost. A row that
finishes starts over with the next schema. Libraries alternate round by round (a shared host drifts).

Also reported: the tokenizer set-up, and the compile time of every schema (cold; the engine caches).

    python -m benchmarks.bench_grammar_mask --rows 16 --steps 300 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from loadtests.schemas import load_schemas


def tokenizer():
    from model.checkpoint import load_tokenizer
    from model.importers.smollm2 import ensure_smollm2

    return load_tokenizer(ensure_smollm2("float32"))


class LLGuidance:
    """The engine's own code path (service/engine/structured.py)."""

    name = "llguidance"

    def __init__(self, tok):
        from service.engine.structured import Grammars

        self.g = Grammars(tok, tok.vocab_size, tok.stop_ids())
        self.g.compile({"type": "object"})  # builds llguidance's tokenizer

    def compile(self, schema: dict):
        self.g.compile(schema)
        return schema

    def matcher(self, schema):
        return self.g.compile(schema)  # a copy of the cached template, as the engine does per request

    def fill(self, matchers) -> torch.Tensor:
        return self.g.fill(matchers)

    def advance(self, m, tok) -> bool:
        return self.g.advance(m, tok)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr

        specials = tok.special_ids
        vocab = [b"" if i in specials else t for i, t in enumerate(tok.token_bytes())]  # empty: never allowed
        self.xgr = xgr
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab),
                                      stop_token_ids=sorted(tok.stop_ids()))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)
        self.words = (len(vocab) + 31) // 32

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, matchers) -> torch.Tensor:
        bitmask = torch.empty(len(matchers), self.words, dtype=torch.int32)
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask

    def advance(self, m, tok) -> bool:
        assert m.accept_token(tok)
        return m.is_terminated()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok):
        import outlines_core as oc

        stops, specials = sorted(tok.stop_ids()), tok.special_ids
        words: dict[bytes, list[int]] = {}
        for i, t in enumerate(tok.token_bytes()):
            if i not in specials and t:
                words.setdefault(t, []).append(i)
        self.oc = oc
        self.vocab = oc.Vocabulary(stops[0], words)
        self.words = (tok.vocab_size + 31) // 32

    def compile(self, schema: dict):
        return self.oc.Index(self.oc.json_schema.build_regex_from_schema(json.dumps(schema), ""), self.vocab)

    def matcher(self, index):
        return self.oc.Guide(index)

    def fill(self, matchers) -> torch.Tensor:
        bitmask = torch.empty(len(matchers), self.words, dtype=torch.int32)
        for i, g in enumerate(matchers):
            row = bitmask[i]
            g.write_mask_into(row.data_ptr(), row.numel(), row.element_size())
        return bitmask

    def advance(self, g, tok) -> bool:
        g.advance(tok)
        return g.is_finished()


LIBS = {c.name: c for c in (LLGuidance, XGrammar, OutlinesCore)}


def run_steps(lib, grammars, rows: int, steps: int, vocab: int, seed: int) -> dict:
    from service.engine.structured import apply_bitmask

    rng = random.Random(seed)
    nxt = iter(range(10**9))
    matchers = [lib.matcher(grammars[next(nxt) % len(grammars)]) for _ in range(rows)]
    logits = torch.randn(rows, vocab)
    every = list(range(rows))
    mask_ms, apply_ms, advance_ms, finished = [], [], [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        bitmask = lib.fill(matchers)
        t1 = time.perf_counter()
        x = logits.clone()
        apply_bitmask(x, every, bitmask)
        t2 = time.perf_counter()
        picks = []
        for r in range(rows):  # a random allowed token: the workload, not timed
            ok = torch.isfinite(x[r]).nonzero()[:, 0].tolist()
            picks.append(ok[rng.randrange(len(ok))])
        t3 = time.perf_counter()
        done = [lib.advance(m, t) for m, t in zip(matchers, picks)]
        t4 = time.perf_counter()
        for r, d in enumerate(done):
            if d:
                finished += 1
                matchers[r] = lib.matcher(grammars[next(nxt) % len(grammars)])
        mask_ms.append((t1 - t0) * 1e3)
        apply_ms.append((t2 - t1) * 1e3)
        advance_ms.append((t4 - t3) * 1e3)
    total = [a + b + c for a, b, c in zip(mask_ms, apply_ms, advance_ms)]
    return {"step_ms": statistics.mean(total), "p50": statistics.median(total),
            "p95": sorted(total)[int(0.95 * len(total))], "mask_ms": statistics.mean(mask_ms),
            "apply_ms": statistics.mean(apply_ms), "advance_ms": statistics.mean(advance_ms), "finished": finished}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--libs", nargs="+", default=list(LIBS), choices=list(LIBS))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the engine's default is 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = tokenizer()
    schemas = load_schemas()
    libs, grammars, setup = {}, {}, {}
    for name in args.libs:
        t0 = time.perf_counter()
        lib = LIBS[name](tok)
        t1 = time.perf_counter()
        compiled, times = [], []
        for s in schemas:
            c0 = time.perf_counter()
            compiled.append(lib.compile(s))
            times.append((time.perf_counter() - c0) * 1e3)
        libs[name], grammars[name] = lib, compiled
        setup[name] = (t1 - t0, statistics.median(times), max(times))
        print(f"{name}: tokenizer {t1 - t0:.2f} s; compile per schema median {setup[name][1]:.1f} ms, "
              f"max {setup[name][2]:.1f} ms", flush=True)
    results: dict[str, list[dict]] = {n: [] for n in libs}
    for r in range(args.rounds):
        for name, lib in libs.items():
            results[name].append(run_steps(lib, grammars[name], args.rows, args.steps, tok.vocab_size, seed=r))
    print(f"\n{args.rows} rows, {args.steps} steps x {args.rounds} rounds, {len(schemas)} schemas, "
          f"V = {tok.vocab_size}, torch threads {args.threads}\n")
    print("| library | step ms (mean of rounds) | p50 | p95 | fill masks | apply | advance | tokenizer s "
          "| compile ms median / max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        m = {k: statistics.mean(x[k] for x in rs) for k in rs[0]}
        each = ", ".join(f"{x['step_ms']:.2f}" for x in rs)
        print(f"| {name} | {m['step_ms']:.2f} ({each}) | {m['p50']:.2f} "
              f"| {m['p95']:.2f} | {m['mask_ms']:.2f} | {m['apply_ms']:.2f} | {m['advance_ms']:.2f} "
              f"| {setup[name][0]:.2f} | {setup[name][1]:.1f} / {setup[name][2]:.1f} |")


if __name__ == "__main__":
    main()
