"""Translator benchmark: our TranslationEngine vs transformers MarianMTModel.generate vs CTranslate2
Translator.translate_batch, on the same weights and the same sentences, greedy and beam search.

Weights: the translator checkpoint (default weights/attnserve-zh-en) exported once to the Hugging Face
Marian layout (`model.importers.marian.export_marian`) and converted from there to CTranslate2
(`benchmarks/ct2_convert.py`), under `$ATTNSERVE_HOME/bench/`. Sentences: --requests lines of the held-out
split (`$ATTNSERVE_HOME/data/translate/test.tsv`, fixed seed), alternately the English side (-> zh) and
the Chinese side (-> en), each its own one-text request.

Our engine: --clients closed-loop callers, continuous (or static / serial) batching. Peers: static
batches of up to --clients sentences in arrival order, max target length = the largest of the engine's
per-sentence limits in the batch (1.5 x source + 10); CTranslate2 with the suffix `:inter` runs --threads
batches of clients/threads sentences at once, one thread each (its inter_threads layout); `--replicas N` runs
our engine as N processes of threads/N threads with clients/N clients each, every N-th sentence to each, started
together: the served layout (deploy/serve_config.yaml: two replicas, one thread each). Latency = request
submit -> result (peers: batch submit -> result). Output tokens = target tokens without bos/eos. Each run in
its own subprocess (peak RSS = VmHWM of that process). Length penalty: ours is GNMT's ((5+len)/6)^alpha;
transformers and CTranslate2 divide by len^alpha, so beam outputs may differ slightly; greedy outputs use no penalty.

    python -m benchmarks.bench_translate --beams 1 4 --peers hf:float32 ct2:float32 ct2:int8
    python -m benchmarks.bench_translate --beams 1 --peers ct2:float32 --compile compiled --repeat 3  # ratio per round
    python -m benchmarks.bench_translate --beams 1 --peers ct2:float32 ct2:float32:inter  # CTranslate2's two layouts
    python -m benchmarks.bench_translate --beams 4 --compile compiled --kv-dtype auto bfloat16 --peers  # cache dtypes
    python -m benchmarks.bench_translate --compile compiled --replicas 1 2 --peers ct2:float32:inter  # served layout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_engine import engine_label, pct, peak_rss_mb
from model.paths import SHIPPED_TRANSLATOR
from model.translation import DEFAULT_LENGTH_PENALTY

ROOT = Path(__file__).resolve().parents[1]


def workload(args, tok, cfg) -> list[dict]:
    """text, target lang, source ids (as the engine encodes them) and the engine's max target length, for
    sentences alternately English -> zh and Chinese -> en whose source fits."""
    from model import paths
    from model.decoding import max_len_for
    from model.translation import encode_source

    lines = (paths.home() / "data" / "translate" / "test.tsv").read_text(encoding="utf-8").splitlines()
    rng = random.Random(args.seed)
    out: list[dict] = []
    while len(out) < args.requests:
        en, zh = (lines[rng.randrange(len(lines))].split("\t") + [""])[:2]
        text, tgt = (en, "zh") if len(out) % 2 == 0 else (zh, "en")
        src = encode_source(tok, text, tgt)
        if text.strip() and len(src) <= cfg.max_src_len:
            out.append(dict(text=text, tgt=tgt, src=src, max_len=max_len_for(len(src), 1.5, 10, cfg.max_tgt_len - 1)))
    return out


def load(checkpoint: Path):
    from model.checkpoint import load_checkpoint, load_tokenizer

    return load_checkpoint(checkpoint), load_tokenizer(checkpoint)


def result(name, beam, dtype, wall, out_tokens, latencies, n) -> dict:
    return dict(engine=name, beam=beam, dtype=dtype, wall_s=wall, out_tok_s=out_tokens / wall, sent_s=n / wall,
                lat_p50=pct(latencies, 0.5), lat_p95=pct(latencies, 0.95), rss_mb=peak_rss_mb())


async def run_ours(args, mode: str, dtype: str, step: str = "eager", kv: str = "auto") -> dict:
    from service.engine.config import EngineConfig
    from service.engine.translation import TranslationEngine
    from service.engine.types import TranslateRequest
    from service.frontend.translator import TranslationFrontend

    model, tok = load(args.checkpoint)
    jobs = [(j["text"], j["tgt"]) for j in json.loads(args.workload.read_text())]
    shard, shards = map(int, (args.shard or "0/1").split("/"))
    jobs = jobs[shard::shards]
    cfg = EngineConfig(max_slots=args.clients * args.beam, max_seq_len=model.cfg.max_tgt_len, mode=mode, dtype=dtype,
                       threads=args.threads, max_waiting=args.requests + 1, compile=step == "compiled", kv_dtype=kv)
    engine = TranslationEngine(model, cfg)
    translator = TranslationFrontend(engine, tok)
    await engine.start()
    queue = list(reversed(jobs))
    lat, out = [], 0

    async def client():
        nonlocal out
        while queue:
            text, tgt = queue.pop()
            t0 = time.perf_counter()
            r = await translator.translate(TranslateRequest([text], target_lang=tgt, beam_size=args.beam,
                                                             length_penalty=args.length_penalty))
            lat.append(time.perf_counter() - t0)
            out += r.usage.completion_tokens

    await translator.translate(TranslateRequest(["warm-up"], target_lang="zh", beam_size=args.beam))
    if shards > 1:  # every replica loaded and warm before any starts timing
        (Path(args.barrier) / str(shard)).touch()
        while len(list(Path(args.barrier).iterdir())) < shards:
            await asyncio.sleep(0.01)
    start = time.time()
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.clients)))
    wall = time.perf_counter() - t0
    await engine.stop()
    label = dtype if kv == "auto" else f"{dtype}, kv {kv}"
    r = result(engine_label(engine, mode), args.beam, label, wall, out, lat, len(jobs))
    return r | dict(start=start, out_tokens=out, latencies=lat) if shards > 1 else r


def merge_replicas(parts: list[dict]) -> dict:
    """One row for replicas timed together: throughput over the span from the first start to the last end,
    latency percentiles over all their requests, RSS summed (each replica holds its own model and cache)."""
    wall = max(p["start"] + p["wall_s"] for p in parts) - min(p["start"] for p in parts)
    lat = [x for p in parts for x in p["latencies"]]
    n = round(sum(p["sent_s"] * p["wall_s"] for p in parts))
    row = result(f"{parts[0]['engine']}, {len(parts)} processes", parts[0]["beam"], parts[0]["dtype"], wall,
                 sum(p["out_tokens"] for p in parts), lat, n)
    return row | dict(rss_mb=sum(p["rss_mb"] for p in parts))


def run_peer(args, peer: str, dtype: str, layout: str = "intra") -> dict:
    """Static batches through transformers or CTranslate2; sources tokenized exactly as the engine does.
    Layout "inter" (CTranslate2 only): --threads batches of clients/threads sentences in flight at once, one
    thread each (CTranslate2's inter_threads), so as many sentences are in flight as with one batch."""
    jobs = json.loads(args.workload.read_text())  # tokenized by the parent: this child never imports torch
    ids = json.loads((args.marian_dir / "config.json").read_text())
    parse_peer(f"{peer}:{dtype}:{layout}")
    in_flight = args.threads if layout == "inter" else 1
    submit = _hf(args, dtype, ids) if peer == "hf" else _ct2(args, dtype, in_flight)
    submit([jobs[0]["src"]], 4)()  # warm-up
    size = max(1, args.clients // in_flight)
    lat, out, pending = [], 0, []

    def finish_oldest():
        nonlocal out
        t, n, wait = pending.pop(0)
        out += wait()
        lat.extend([time.perf_counter() - t] * n)  # submit -> result, waited for in submission order

    t0 = time.perf_counter()
    for i in range(0, len(jobs), size):
        batch = jobs[i: i + size]
        if len(pending) == in_flight:
            finish_oldest()
        t = time.perf_counter()
        pending.append((t, len(batch), submit([j["src"] for j in batch], max(j["max_len"] for j in batch))))
    while pending:
        finish_oldest()
    wall = time.perf_counter() - t0
    name = "transformers generate (static)" if peer == "hf" else "CTranslate2 translate_batch (static)"
    if in_flight > 1:
        name = f"CTranslate2 translate_batch (static, {in_flight} batches of {size} in flight)"
    return result(name, args.beam, dtype, wall, out, lat, len(jobs))


def _hf(args, dtype: str, ids: dict):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.MarianMTModel.from_pretrained(str(args.marian_dir), dtype=getattr(torch, dtype)).eval()

    def translate(batch: list[list[int]], max_len: int) -> int:
        width = max(len(s) for s in batch)
        pad, eos = ids["pad_token_id"], ids["eos_token_id"]
        src = torch.tensor([s + [pad] * (width - len(s)) for s in batch])  # (B, S) right-padded
        with torch.inference_mode():
            out = model.generate(input_ids=src, attention_mask=src != pad, num_beams=args.beam,
                                 do_sample=False, max_new_tokens=max_len,
                                 length_penalty=args.length_penalty if args.beam > 1 else 1.0)
        n = 0
        for row in out[:, 1:].tolist():  # drop the decoder start token
            n += row.index(eos) if eos in row else sum(t != pad for t in row)
        return lambda: n

    return translate


def _ct2(args, compute_type: str, inter: int = 1):
    """Submits a batch, returns a wait() -> output tokens; `inter` > 1: that many workers of
    threads/inter threads each, batches run asynchronously."""
    import ctranslate2

    vocab = json.loads((args.marian_dir / "vocab.json").read_text())
    pieces = sorted(vocab, key=vocab.get)
    tr = ctranslate2.Translator(str(args.ct2_dir), device="cpu", compute_type=compute_type,
                                intra_threads=max(1, args.threads // inter), inter_threads=inter)

    def submit(batch: list[list[int]], max_len: int):
        res = tr.translate_batch([[pieces[i] for i in s] for s in batch], beam_size=args.beam,
                                 max_decoding_length=max_len, asynchronous=inter > 1,
                                 length_penalty=args.length_penalty if args.beam > 1 else 1.0)
        if inter > 1:
            return lambda: sum(len(r.result().hypotheses[0]) for r in res)
        n = sum(len(r.hypotheses[0]) for r in res)
        return lambda: n

    return submit


def parse_peer(spec: str) -> tuple[str, str, str]:
    """A peer spec, hf:<dtype> or ct2:<dtype>[:inter] -> (peer, dtype, layout); a mistyped one stops the
    benchmark here, before any export or run."""
    parts = spec.split(":")
    peer, dtype, layout = (parts + ["intra"])[:3] if len(parts) in (2, 3) else ("", "", "")
    if peer not in ("hf", "ct2") or not dtype or layout not in ("intra", "inter") or (layout, peer) == ("inter", "hf"):
        raise SystemExit(f"unknown peer {spec!r}: use hf:<float32|bfloat16> or ct2:<float32|int8|...>[:inter]")
    return peer, dtype, layout


def prepare(args, peers: list[str]) -> dict[str, list[str]]:
    """Export to Marian / convert to CTranslate2 once per checkpoint version; child arguments per peer."""
    from benchmarks.bench_peers import bench_dir
    from benchmarks.ct2_convert import convert
    from model.importers.marian import export_marian

    parsed = {spec: parse_peer(spec) for spec in peers}

    st = (args.checkpoint / "model.safetensors").stat()
    key = f"{args.checkpoint.name}-{st.st_size}-{int(st.st_mtime)}" if not args.tiny else None
    root = Path(args.workdir) if args.tiny else bench_dir("")
    marian = root / f"{key or 'tiny'}-marian"
    if not (marian / "model.safetensors").is_file():
        export_marian(*load(args.checkpoint), marian)
    extra = {}
    for spec in peers:
        peer, dtype, _ = parsed[spec]
        extra[spec] = ["--marian-dir", str(marian)]
        if peer == "ct2":
            d = root / f"{key or 'tiny'}-ct2-{dtype}"
            if not (d / "model.bin").is_file():
                convert(marian, d, quantization=dtype)
            extra[spec] += ["--ct2-dir", str(d)]
    return extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(SHIPPED_TRANSLATOR))
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients = peers' batch size")
    ap.add_argument("--requests", type=int, default=64, help="sentences (one per request)")
    ap.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--modes", nargs="*", default=["continuous"])
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--compile", nargs="+", default=["eager"], choices=["eager", "compiled"],
                    help="our decode step: eager, or torch.compile'd (EngineConfig.compile); both = side by side")
    ap.add_argument("--kv-dtype", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                    help="our K/V cache's dtype (EngineConfig.kv_dtype; auto = the compute dtype)")
    ap.add_argument("--peers", nargs="*", default=["hf:float32", "ct2:float32", "ct2:int8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1],
                    help="our engine as N processes of threads/N threads and clients/N clients each (N divides both)")
    ap.add_argument("--length-penalty", type=float, default=DEFAULT_LENGTH_PENALTY,
                    help="beam search's length penalty alpha, for every engine (default: the service's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of every run, alternating which runs first; prints each round's ours/peer ratio")
    ap.add_argument("--tiny", action="store_true", help="random tiny checkpoint: validates the script only")
    for internal in ("--run", "--beam", "--marian-dir", "--ct2-dir", "--workdir", "--workload", "--shard", "--barrier"):
        ap.add_argument(internal, help=argparse.SUPPRESS)
    args = ap.parse_args()
    for name in ("checkpoint", "marian_dir", "ct2_dir", "workload"):
        if getattr(args, name):
            setattr(args, name, Path(getattr(args, name)))
    if args.run:
        args.beam = int(args.beam)
        parts = args.run.split(":")
        if parts[0] == "ours":  # the engine sets args.threads on its own thread; this one stays at 1
            from service.engine.cpu_runtime import single_threaded_caller

            single_threaded_caller()
        elif parts[0] != "ct2":
            import torch

            torch.set_num_threads(args.threads)
        r = asyncio.run(run_ours(args, *parts[1:5])) if parts[0] == "ours" else run_peer(args, *parts)
        print(json.dumps(r))
        return
    with tempfile.TemporaryDirectory(prefix="attnserve-bench-tr-") as tmp:
        if args.tiny:
            sys.path.insert(0, str(ROOT / "tests"))
            from serve_fixture import tiny_checkpoints

            args.checkpoint, args.workdir = tiny_checkpoints(Path(tmp))[1], tmp
        elif not (args.checkpoint / "config.json").is_file():
            raise SystemExit(f"no translator checkpoint at {args.checkpoint} (train one, or pass --checkpoint)")
        if any(n < 1 or args.threads % n or args.clients % n for n in args.replicas):
            raise SystemExit(f"--replicas {args.replicas}: each must divide --threads and --clients")
        specs = {f"ours:{m}:{d}:{c}:{kv}" + (f":x{n}" if n > 1 else ""): [] for d in args.dtype for m in args.modes
                 for c in args.compile for kv in args.kv_dtype for n in args.replicas}
        specs |= prepare(args, args.peers)
        model, tok = load(args.checkpoint)
        args.workload = Path(tmp) / "workload.json"
        args.workload.write_text(json.dumps(workload(args, tok, model.cfg), ensure_ascii=False))
        del model
        from model.progress import progress, write_line  # here: the children's RSS is measured

        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        rows = []
        bar = progress(desc="bench_translate", total=args.repeat * len(args.beams) * len(specs), unit="run")
        for rnd in range(args.repeat):
            order = list(specs.items())
            if rnd % 2:  # alternate who runs first: a shared host drifts over minutes
                order.reverse()
            for beam in args.beams:
                for spec, extra in order:
                    n = int(spec.rsplit(":x", 1)[1]) if ":x" in spec else 1
                    cmd = [sys.executable, "-m", "benchmarks.bench_translate", "--run", spec, "--beam", str(beam),
                           "--checkpoint", str(args.checkpoint), "--clients", str(args.clients // n), "--requests",
                           str(args.requests), "--threads", str(args.threads // n), "--workload",
                           str(args.workload), "--length-penalty", str(args.length_penalty), *extra]
                    bar.set_postfix_str(f"round {rnd + 1}, {spec} beam {beam}")
                    run = Path(tempfile.mkdtemp(dir=tmp))  # each child's output in files: no pipe fills up
                    (run / "barrier").mkdir()
                    procs = []
                    for i in range(n):
                        shard = ["--shard", f"{i}/{n}", "--barrier", str(run / "barrier")] if n > 1 else []
                        with open(run / f"{i}.out", "w") as out, open(run / f"{i}.err", "w") as err:
                            procs.append(subprocess.Popen(cmd + shard, stdout=out, stderr=err, cwd=ROOT,
                                                          env=env | {"OMP_NUM_THREADS": str(args.threads // n)}))
                    failed = None  # a replica that fails leaves the others waiting at the barrier: stop them
                    while any(p.poll() is None for p in procs):
                        failed = next((i for i, p in enumerate(procs) if p.returncode), failed)
                        if failed is not None:
                            for p in procs:
                                p.kill()
                        time.sleep(0.1)
                    failed = next((i for i, p in enumerate(procs) if p.returncode), None) if failed is None else failed
                    bar.update(1)
                    if failed is not None:
                        err = (run / f"{failed}.err").read_text()
                        write_line(f"# {spec} beam {beam} FAILED:\n{err[-3000:]}", file=sys.stderr)
                        continue
                    parts = [json.loads((run / f"{i}.out").read_text().strip().splitlines()[-1]) for i in range(n)]
                    rows.append((merge_replicas(parts) if n > 1 else parts[0]) | dict(spec=spec, round=rnd + 1))
                    write_line(f"# round {rnd + 1}, {spec} beam {beam}: {rows[-1]['sent_s']:.2f} sentences/s",
                               file=sys.stderr)
        bar.close()
    label = "TINY random checkpoint (validation only)" if args.tiny else str(args.checkpoint)
    print(f"Translator: {label}; {args.clients} clients, {args.requests} sentences (half en->zh, half zh->en), "
          f"threads {args.threads}, seed {args.seed}\n")
    rounds = args.repeat > 1
    print(("| round " if rounds else "") + "| engine | beam | dtype | sentences/s | output tok/s "
          "| latency p50 / p95 (s) | peak RSS (MB) | wall (s) |")
    print("|---" * (8 + rounds) + "|")
    for r in rows:
        print((f"| {r['round']} " if rounds else "") + f"| {r['engine']} | {r['beam']} | {r['dtype']} | "
              f"{r['sent_s']:.2f} | {r['out_tok_s']:.1f} | {r['lat_p50']:.2f} / {r['lat_p95']:.2f} | "
              f"{r['rss_mb']:.0f} | {r['wall_s']:.1f} |")
    for line in ratio_lines(rows):
        print(line)


def ratio_lines(rows: list[dict]) -> list[str]:
    """Ours / each peer in sentences/s, per beam, from runs of the same round only (a shared host drifts):
    each round's ratio and their median."""
    out = []
    for beam in sorted({r["beam"] for r in rows}):
        at = [r for r in rows if r["beam"] == beam]
        for ours in sorted({r["spec"] for r in at if r["spec"].startswith("ours:")}):
            for peer in sorted({r["spec"] for r in at if not r["spec"].startswith("ours:")}):
                ratios = []
                for rnd in sorted({r["round"] for r in at}):
                    a = [r["sent_s"] for r in at if r["round"] == rnd and r["spec"] == ours]
                    b = [r["sent_s"] for r in at if r["round"] == rnd and r["spec"] == peer]
                    if a and b:
                        ratios.append(a[0] / b[0])
                if not ratios:
                    continue
                line = f"\nbeam {beam}: {ours} / {peer} = " + " / ".join(f"{x:.2f}x" for x in ratios)
                if len(ratios) > 1:
                    line += f" (median {statistics.median(ratios):.2f}x over {len(ratios)} rounds)"
                out.append(line)
    return out

if __name__ == "__main__":
    main()
