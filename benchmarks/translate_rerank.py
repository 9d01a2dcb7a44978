"""Would reranking the beam's n-best list by the reverse direction help? (noisy channel, Yee et al. 2019)

The translator is bidirectional, so the same model scores the source given each hypothesis: a hypothesis
that drops part of the source explains it badly. Each hypothesis gets `forward + λ · reverse / source tokens`
(forward: the beam's length-penalised log-probability; reverse: log P(source | hypothesis)); λ is picked on
the first `--tune` pairs of the split and reported on the rest, against plain beam search at `--base-beam`.
The oracle row picks each source's hypothesis with the best sentence BLEU: the ceiling of any reranker.
Offline decoding (model/generate.py, the same beam rules as the engine), whole pairs (no sentence split).

    python -m benchmarks.translate_rerank --model weights/attnserve-zh-en --split ted_dev --into en
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from model.checkpoint import load_checkpoint, load_tokenizer
from model.generate import beam_search, pad_batch
from model.punctuation import postprocess
from model.training import translate_data
from model.translation import encode_source, other


@torch.inference_mode()
def reverse_logprob(model, tok, source: list[int], hypotheses: list[list[int]], source_lang: str) -> list[float]:
    """log P(source | hypothesis) for each hypothesis: the model translating it back into `source_lang`.
    source: the source's token ids (no tag, no EOS); hypotheses: target ids (no BOS/EOS)."""
    cfg = model.cfg
    tag = encode_source(tok, "", source_lang)[0]  # the tag of the reverse direction
    srcs = [[tag, *h[: cfg.max_src_len - 2], tok.eos_id] for h in hypotheses]
    src, src_mask = pad_batch(srcs, cfg.pad_id)
    n = len(hypotheses)
    tgt_in = torch.tensor([[cfg.bos_id, *source]] * n)  # (n, T)
    tgt_out = torch.tensor([[*source, cfg.eos_id]] * n)
    logp = torch.log_softmax(model(src, tgt_in, src_mask).float(), -1)  # (n, T, V)
    return logp.gather(-1, tgt_out[..., None])[..., 0].sum(-1).tolist()


def nbest(model, tok, texts: list[str], into: str, beam: int, batch: int = 16, label: str = "") -> list[dict]:
    """Per text: its source length and its beam's hypotheses (text, forward and reverse scores), best first."""
    out, t0 = [], time.perf_counter()
    for i in range(0, len(texts), batch):
        ids = [encode_source(tok, t, into, model.cfg.max_src_len) for t in texts[i:i + batch]]
        for src, hyps in zip(ids, beam_search(model, ids, beam_size=beam), strict=True):
            rev = reverse_logprob(model, tok, src[1:-1], [h.tokens for h in hyps], other(into))
            out.append({"src_len": len(src) - 1, "hyps": [
                {"text": postprocess(tok.decode(h.tokens), into), "fwd": h.score, "rev": r}
                for h, r in zip(hyps, rev, strict=True)]})
        print(f"\r{label} beam {beam}: {len(out)}/{len(texts)} sources, {time.perf_counter() - t0:.0f} s",
              end="", flush=True)
    print()
    return out


def rerank(records: list[dict], lam: float) -> list[str]:
    return [max(r["hyps"], key=lambda h: h["fwd"] + lam * h["rev"] / r["src_len"])["text"] for r in records]


def main(argv=None) -> None:
    import sacrebleu

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="weights/attnserve-zh-en")
    ap.add_argument("--split", default="ted_dev")
    ap.add_argument("--into", choices=("en", "zh"), default="en")
    ap.add_argument("--beam", type=int, default=8, help="n-best size to rerank")
    ap.add_argument("--base-beam", type=int, default=4, help="plain beam search to compare with")
    ap.add_argument("--tune", type=int, default=500, help="first pairs, to pick λ on")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--lambdas", default="0.25,0.5,1,1.5,2,3,5")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", type=Path, default=None, help="data folder (default $ATTNSERVE_HOME/data/translate)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_checkpoint(args.model).eval(), load_tokenizer(args.model)
    pairs = translate_data.read_split(args.split, args.data)[: args.limit]
    if not 0 < args.tune < len(pairs):
        raise SystemExit(f"--tune must leave pairs on both sides: 0 < {args.tune} < {len(pairs)}")
    texts = [zh if args.into == "en" else en for en, zh in pairs]
    refs = [en if args.into == "en" else zh for en, zh in pairs]
    parts = {"tune": slice(0, args.tune), "rest": slice(args.tune, None)}

    def bleu(outputs: list[str], part: str) -> float:
        return sacrebleu.corpus_bleu(outputs[parts[part]], [refs[parts[part]]],
                                     tokenize="zh" if args.into == "zh" else "13a").score

    base = [r["hyps"][0]["text"] for r in nbest(model, tok, texts, args.into, args.base_beam, label="base")]
    records = nbest(model, tok, texts, args.into, args.beam, label="n-best")
    lam = max((float(x) for x in args.lambdas.split(",")), key=lambda x: bleu(rerank(records, x), "tune"))
    oracle = [max(r["hyps"], key=lambda h: sacrebleu.sentence_bleu(h["text"], [ref]).score)["text"]
              for r, ref in zip(records, refs, strict=True)]
    rows = [(f"beam {args.base_beam}", base), (f"beam {args.beam}, top", rerank(records, 0.0)),
            (f"beam {args.beam}, reranked (λ {lam:g}, picked on tune)", rerank(records, lam)),
            (f"beam {args.beam}, oracle", oracle)]
    print(f"{args.split} into {args.into}, {args.model}: BLEU on the first {args.tune} (tune) / the other "
          f"{len(pairs) - args.tune} (rest)")
    print("| decoding | tune | rest |\n|---|---|---|")
    for name, outputs in rows:
        print(f"| {name} | {bleu(outputs, 'tune'):.2f} | {bleu(outputs, 'rest'):.2f} |")


if __name__ == "__main__":
    main()
