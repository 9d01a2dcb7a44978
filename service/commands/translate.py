"""attnserve translate [--to en|zh] [--beam N] [--no-repeat-ngram N] TEXT...

Runs the engine behind `/v1/translate` in this process (service/local.py), with the served translator's
settings from the Serve config: the same text gives the same translation here and over HTTP.
"""

import sys

from model.translation import DEFAULT_BEAM_SIZE, DEFAULT_NO_REPEAT_NGRAM
from service.commands import CommandError


def add_arguments(p):
    p.add_argument("text", nargs="*", help="texts to translate (default: one per line on stdin)")
    p.add_argument("--to", choices=["en", "zh"], help="target language (default: the other one, detected)")
    p.add_argument("--beam", type=int, default=DEFAULT_BEAM_SIZE, help="beam size (1 = greedy)")
    p.add_argument("--no-repeat-ngram", type=int, default=DEFAULT_NO_REPEAT_NGRAM,
                   help="forbid repeating any n-gram of this size in an output (0 = off)")
    p.add_argument("--model", help="checkpoint folder (default: the served translator's)")
    p.add_argument("--config", help="Serve config whose translator settings to use (default: deploy/serve_config.yaml)")


def run(args) -> int:
    from service import local
    from service.engine.types import RequestRejected
    from service.models import ModelUnavailable

    texts = args.text or [line.strip() for line in sys.stdin if line.strip()]
    if not texts:
        raise CommandError("no text given")
    empty = [i for i, t in enumerate(texts) if not t.strip()]
    if empty:  # as /v1/translate answers: 400 naming the text
        raise CommandError(f"text[{empty[0]}] is empty")
    try:
        translator = local.load_translator(local.translator_spec(args.model, config=args.config))
        result = local.translate(translator, texts, target_lang=args.to, beam_size=args.beam,
                                 no_repeat_ngram=args.no_repeat_ngram)
    except (ModelUnavailable, RequestRejected, OSError, ValueError) as e:
        raise CommandError(str(e)) from e
    for out in result.translations:
        print(out)
    return 0
