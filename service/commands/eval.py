"""`attnserve eval translate`: BLEU and chrF of a translator on the held-out splits (flags: `--help`)."""

from service.commands import CommandError, as_command_error, check_at_least_one, check_decoding_flags


def add_arguments(p):
    p.add_argument("task", choices=["translate"])
    p.add_argument("--model", help="checkpoint folder (default: the shipped translator)")
    p.add_argument("--out", help="JSON report path (default: docs/translate_eval.json in the repository)")
    p.add_argument("--beams", default="1,4", help="comma-separated beam sizes (1 = greedy)")
    p.add_argument("--limit", type=int, help="only the first N pairs")
    p.add_argument("--split", choices=["test", "dev", "ted_test", "ted_dev"], default="test",
                   help="held-out split to score (choose between checkpoints on dev / ted_dev, report the tests)")
    p.add_argument("--data", help="data folder (default $ATTNSERVE_HOME/data/translate)")
    p.add_argument("--no-repeat-ngram", type=int, default=None,
                   help="decoding option (default: the service's, model/translation.py)")
    p.add_argument("--length-penalty", type=float, default=None,
                   help="beam search's GNMT length penalty alpha (default: the service's, model/translation.py)")
    p.add_argument("--min-length-ratio", type=float, default=None,
                   help="no end of a translation before this x its source's tokens (default: the service's)")


def run(args) -> int:
    from pathlib import Path

    from model import paths
    from model.training.eval_translate import evaluate
    from service import local
    from service.engine.types import EngineError
    from service.models import ModelUnavailable

    try:
        beams = tuple(int(b) for b in args.beams.split(","))
    except ValueError:
        beams = ()
    if not beams or not all(1 <= b <= 32 for b in beams):
        raise CommandError(f"--beams takes comma-separated beam sizes in 1..32, got {args.beams!r}")
    check_at_least_one(limit=args.limit)
    options = check_decoding_flags(length_penalty=args.length_penalty, no_repeat_ngram=args.no_repeat_ngram,
                                   min_length_ratio=args.min_length_ratio)
    out = Path(args.out) if args.out else paths.REPO_ROOT / "docs" / "translate_eval.json"
    if out.is_dir() or any(p.exists() and not p.is_dir() for p in out.parents):
        raise CommandError(f"--out {out} cannot be written (a folder, or under a file)")
    checkpoint = args.model or paths.SHIPPED_TRANSLATOR
    with as_command_error(ModelUnavailable, OSError, ValueError):
        translator = local.load_translator(local.translator_spec(checkpoint))

    def translate(texts: list[str], target_lang: str, beam_size: int, done) -> list[str]:
        """The translator behind /v1/translate, with the served decoding defaults; done(n) as texts finish."""
        return local.translate(translator, texts, target_lang=target_lang, beam_size=beam_size, progress=done,
                               **options).translations

    # the prepared data: missing or torn; a bad checkpoint; a decoding option the engine refuses
    with as_command_error(FileNotFoundError, ValueError, EngineError):
        evaluate(checkpoint, out, translate=translate, beams=beams, limit=args.limit, split=args.split,
                 data_dir=Path(args.data) if args.data else None)
    return 0
