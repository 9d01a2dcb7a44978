"""Does a translator checkpoint underfit or overfit? Per-token loss on training pairs against dev pairs.

Loss is plain cross-entropy (no label smoothing, no dropout: the model in eval mode), per target token, on a
fixed sample of the training pairs of each source (HK, TED) and the first pairs of the matching dev split, each
direction on its own. Training loss close to dev loss, and high, means the model cannot fit even what it trains
on: more capacity or less regularisation; a training loss far below dev loss means more regularisation.

    python -m benchmarks.translate_fit --model weights/attnserve-zh-en --pairs 600
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import torch

from model.checkpoint import load_checkpoint, load_tokenizer
from model.training import translate_data
from model.training.train_translate import collate, make_batches, make_examples, token_loss

DEV_SPLIT = {"hk": "dev", "ted": "ted_dev"}


def sample_train(source: str, n: int, directory: Path | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """n training pairs of one source (train.source names each pair's source), a fixed sample."""
    pairs = translate_data.read_split("train", directory)
    sources = translate_data.read_sources(directory)
    idx = [i for i, s in enumerate(sources[:len(pairs)]) if s == source]
    if not idx:
        raise ValueError(f"no training pairs from source {source!r}")
    return [pairs[i] for i in random.Random(seed).sample(idx, min(n, len(idx)))]


@torch.no_grad()
def token_nll(model, tok, pairs: list[tuple[str, str]], into: str, max_len: int = 128) -> float:
    """Mean negative log-likelihood per target token of translating `pairs` into `into`."""
    examples = make_examples(pairs, tok, max_len, [into] * len(pairs))
    pad = model.cfg.pad_id
    total, count = 0.0, 0
    for batch in make_batches(examples, 6000, random.Random(1)):
        src, tgt_in, tgt_out = collate(examples, batch, pad)
        n = int((tgt_out != pad).sum())
        total += token_loss(model(src, tgt_in), tgt_out, pad, 0.0).item() * n  # mean over n real tokens
        count += n
    return total / count


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="weights/attnserve-zh-en")
    ap.add_argument("--pairs", type=int, default=600, help="pairs per set")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data", type=Path, default=None, help="data folder (default $ATTNSERVE_HOME/data/translate)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_checkpoint(args.model).eval(), load_tokenizer(args.model)
    print("| source | into | train nats/token | dev nats/token | dev - train |\n|---|---|---|---|---|")
    for source, split in DEV_SPLIT.items():
        sets = {"train": sample_train(source, args.pairs, args.data),
                "dev": translate_data.read_split(split, args.data)[:args.pairs]}
        for into in ("en", "zh"):
            train, dev = (token_nll(model, tok, sets[k], into) for k in ("train", "dev"))
            cells = [f"{x:.3f} (ppl {math.exp(x):.1f})" for x in (train, dev)]
            print(f"| {source} | {into} | {cells[0]} | {cells[1]} | {dev - train:+.3f} |", flush=True)


if __name__ == "__main__":
    main()
