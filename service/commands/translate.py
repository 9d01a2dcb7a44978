"""attnserve translate [--to en|zh] [--beam N] TEXT..."""

import sys


def add_arguments(p):
    p.add_argument("text", nargs="*", help="sentences to translate (default: one per line on stdin)")
    p.add_argument("--to", choices=["en", "zh"], help="target language (default: the other one, detected)")
    p.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy)")
    p.add_argument("--model", help="checkpoint folder (default: the shipped translator)")


def run(args) -> int:
    from model import paths
    from model.translation import Translator

    texts = args.text or [line.strip() for line in sys.stdin if line.strip()]
    if not texts:
        print("attnserve translate: no text given", file=sys.stderr)
        return 2
    tr = Translator(args.model or paths.SHIPPED_WEIGHTS / "attnserve-zh-en")
    for out in tr.translate(texts, target_lang=args.to, beam_size=args.beam):
        print(out)
    return 0
