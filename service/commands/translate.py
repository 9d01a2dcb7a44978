"""`attnserve translate TEXT...` (flags: `--help`) runs the engine behind `/v1/translate` in this process
(service/local.py), with the served translator's settings from the Serve config: the same text gives the
same translation here and over HTTP.
"""

import io
import sys

from model.progress import progress
from model.translation import DEFAULT_BEAM_SIZE, DEFAULT_NO_REPEAT_NGRAM
from service.commands import CommandError, as_command_error, check_decoding_flags

# the request's fields as this command's flags: the translator's refusals name the flag
_FLAGS = {"beam_size": "--beam", "max_length": "--max-length", "source_lang": "--from", "target_lang": "--to",
         "length_penalty": "--length-penalty", "no_repeat_ngram": "--no-repeat-ngram",
         "min_length_ratio": "--min-length-ratio"}


def add_arguments(p):
    p.add_argument("text", nargs="*", help="texts to translate (default: one per line on stdin; blank lines stay "
                   "blank, so output lines match input lines)")
    p.add_argument("--to", choices=["en", "zh"], help="target language (default: the other one, detected)")
    p.add_argument("--from", dest="source", choices=["en", "zh"],
                   help="source language of every sentence (default: detected per text and sentence)")
    p.add_argument("--beam", type=int, default=DEFAULT_BEAM_SIZE, help="beam size (1 = greedy)")
    p.add_argument("--no-repeat-ngram", type=int, default=DEFAULT_NO_REPEAT_NGRAM,
                   help="forbid repeating any n-gram of this size in an output (0 = off)")
    # left out, the request's defaults (model/translation.py), as over HTTP
    p.add_argument("--length-penalty", type=float, help="beam search's GNMT length penalty alpha")
    p.add_argument("--min-length-ratio", type=float,
                   help="no end of a sentence's translation before this x its source's tokens")
    p.add_argument("--max-length", type=int, help="target tokens per sentence (default: relative to the source)")
    p.add_argument("--model", help="checkpoint folder (default: the served translator's)")
    p.add_argument("--config", help="Serve config whose translator settings to use (default: deploy/serve_config.yaml)")


def run(args) -> int:
    from service import local
    from service.engine.types import RequestRejected
    from service.models import ModelUnavailable

    options = check_decoding_flags(no_repeat_ngram=args.no_repeat_ngram, length_penalty=args.length_penalty,
                                   min_length_ratio=args.min_length_ratio)
    if args.max_length is not None:  # its bound is the engine's positions: checked there
        options["max_length"] = args.max_length
    from_stdin = not args.text
    if args.text:
        lines = args.text
        if empty := [i for i, t in enumerate(lines) if not t.strip()]:  # as /v1/translate answers
            raise CommandError(f"text[{empty[0]}] is empty")
    else:
        lines = _stdin_lines()
    for i, t in enumerate(lines):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:  # bytes that were not UTF-8 (kept as lone surrogates)
            raise CommandError(f"text[{i}] is not UTF-8 text") from None
    texts = [t for t in lines if t.strip()]  # as given: /v1/translate keeps a text's blank lines too
    if not texts:
        raise CommandError("no text given")
    with as_command_error(RequestRejected, ModelUnavailable, OSError, ValueError):
        translator = local.load_translator(local.translator_spec(args.model, config=args.config))
        # a file on stdin can take minutes: the texts done on stderr (stdout keeps the translations)
        with progress(desc="translate", total=len(texts), unit="text", disable=len(texts) < 2) as bar:
            result = local.translate(translator, texts, target_lang=args.to, source_lang=args.source,
                                     beam_size=args.beam, progress=lambda n: bar.update(n - bar.n),
                                     field_names=_FLAGS, **options)
    outputs = iter(result.translations)
    for t in lines:
        out = next(outputs) if t.strip() else ""
        # a stdin line holding a Unicode line break (U+2028, U+0085) is translated line by line, printed as one
        print(out.replace("\n", " ") if from_stdin else out)
    return 0


def _stdin_lines() -> list[str]:
    if sys.stdin is None:
        raise CommandError("no text given")
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # already text (a StringIO)
        return [line.rstrip("\r\n") for line in sys.stdin]
    # the bytes decoded here, not by sys.stdin: its decoder counts from the chunk it is on, and under
    # C.UTF-8 it lets the bytes through as surrogates
    data = raw.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise CommandError(f"stdin is not UTF-8 text ({e.reason} at byte {e.start}, line {line})") from None
    return [line.rstrip("\r\n") for line in io.StringIO(text, newline="\n")]  # lines end at \n, as sys.stdin's
