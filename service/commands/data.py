"""`attnserve data prepare|sample|backtranslate translate`: the translator's corpus, samples of it, synthetic
pairs (flags: `attnserve data --help`)."""

from service.commands import CommandError, as_command_error, check_at_least_one


def add_arguments(p):
    p.add_argument("action", choices=["prepare", "sample", "backtranslate"],
                   help="prepare: build the corpus; sample: print random aligned TED pairs (to check by hand); "
                        "backtranslate: add synthetic pairs from monolingual text (bt.tsv)")
    p.add_argument("dataset", choices=["translate"])
    p.add_argument("--out", help="data folder (default $ATTNSERVE_HOME/data/translate)")
    p.add_argument("--heldout-sentences", type=int, default=1000,
                   help="prepare: TED pairs in each of ted_test and ted_dev (whole talks until at least this many)")
    p.add_argument("--n", type=int, default=50, help="sample: how many pairs")
    p.add_argument("--seed", type=int, default=50, help="sample: random seed")
    p.add_argument("--sentences", type=int, default=30000,
                   help="backtranslate: monolingual sentences per language (resumes up to this many)")
    p.add_argument("--model", help="backtranslate: checkpoint folder (default: the served translator)")
    p.add_argument("--languages", default="zh,en",
                   help="backtranslate: which monolingual text to sample, by its language (comma-separated)")


def run(args) -> int:
    from pathlib import Path

    from model.training import translate_data
    from service.models import ModelUnavailable

    out = Path(args.out) if args.out else None
    check_at_least_one(n=args.n, sentences=args.sentences, heldout_sentences=args.heldout_sentences)
    with as_command_error(ModelUnavailable, OSError, ValueError):  # no checkpoint, data not prepared yet, ...
        if args.action == "prepare":
            translate_data.prepare(out, heldout_sentences=args.heldout_sentences)
            return 0
        if args.action == "backtranslate":
            return backtranslate(args, out)
        for k, (en, zh) in enumerate(translate_data.alignment_sample(args.n, args.seed, out), 1):
            print(f"{k}. ZH {zh}\n   EN {en}")
    return 0


def backtranslate(args, out) -> int:
    from model.training import back_translate
    from model.translation import LANGS
    from service import local

    languages = tuple(dict.fromkeys(args.languages.split(",")))  # "zh,zh" once: rows are counted before the loop
    if set(languages) - set(LANGS):
        raise CommandError(f"--languages takes one or both of {','.join(LANGS)}, got {args.languages!r}")
    from service.engine.aot_package import fingerprint

    translator = local.load_translator(local.translator_spec(args.model))

    def translate(texts: list[str], target_lang: str, done) -> list[str]:
        """Greedy, through the engine behind /v1/translate (its batch path, served decoding defaults)."""
        return local.translate(translator, texts, target_lang=target_lang, beam_size=1, progress=done).translations

    back_translate.build(translate, args.sentences, directory=out, languages=languages,
                         model=fingerprint(translator.engine.model))
    return 0
