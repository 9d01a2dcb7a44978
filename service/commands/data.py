"""attnserve data prepare translate [--out DIR] [--heldout-sentences 1000];
attnserve data sample translate [--n 50] [--seed 50]"""


def add_arguments(p):
    p.add_argument("action", choices=["prepare", "sample"],
                   help="prepare: build the corpus; sample: print random aligned TED pairs (to check by hand)")
    p.add_argument("dataset", choices=["translate"])
    p.add_argument("--out", help="data folder (default $ATTNSERVE_HOME/data/translate)")
    p.add_argument("--heldout-sentences", type=int, default=1000,
                   help="prepare: TED pairs in each of ted_test and ted_dev (whole talks until at least this many)")
    p.add_argument("--n", type=int, default=50, help="sample: how many pairs")
    p.add_argument("--seed", type=int, default=50, help="sample: random seed")


def run(args) -> int:
    from pathlib import Path

    from model.training import translate_data

    out = Path(args.out) if args.out else None
    if args.action == "prepare":
        translate_data.prepare(out, heldout_sentences=args.heldout_sentences)
        return 0
    for k, (en, zh) in enumerate(translate_data.alignment_sample(args.n, args.seed, out), 1):
        print(f"{k}. ZH {zh}\n   EN {en}")
    return 0
