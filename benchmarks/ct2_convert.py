"""Convert a folder written by model.importers.marian.export_marian to a CTranslate2 model.

CTranslate2's stock Marian loader assumes an original Marian model: the decoder starts from a zero
embedding (`start_from_zero_embedding`) and the last vocabulary row is a `<pad>` added by
transformers, which it drops. Neither holds for ours: we start from the bos token's embedding and
every row is a real token. So the converter below loads the same `MarianMTModel` through
transformers and maps it with CTranslate2's BART loader (the same encoder-decoder mapping, post-LN,
no embedding LayerNorm, decoder start = config.decoder_start_token_id), keeping every row.

    python -m benchmarks.ct2_convert EXPORTED_DIR OUT_DIR [--quantization int8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ctranslate2.converters.transformers import BartLoader, TransformersConverter

from model.importers.marian import VOCAB_FILE


class _Vocabulary:
    """What CTranslate2's loaders read from a tokenizer, built from the exported vocab.json."""

    def __init__(self, directory: str | Path, config: dict):
        self._vocab: dict[str, int] = json.loads(Path(directory, VOCAB_FILE).read_text())
        self._tokens = sorted(self._vocab, key=self._vocab.get)
        self.bos_token = self._tokens[config["bos_token_id"]]
        self.eos_token = self._tokens[config["eos_token_id"]]
        self.unk_token = "<unk>" if "<unk>" in self._vocab else self.eos_token

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def convert_ids_to_tokens(self, i: int) -> str:
        return self._tokens[i]


class _ExactMarianLoader(BartLoader):
    @property
    def architecture_name(self):
        return "MarianMTModel"

    def get_model_spec(self, model):
        model.config.normalize_before = False
        model.config.normalize_embedding = False
        return super().get_model_spec(model)


class ExactMarianConverter(TransformersConverter):
    """TransformersConverter for our exported Marian folders (see the module docstring)."""

    def _load(self):
        import torch
        import transformers

        d = Path(self._model_name_or_path)
        config = json.loads((d / "config.json").read_text())
        with torch.no_grad():
            model = self.load_model(transformers.MarianMTModel, str(d),
                                    dtype=torch.float16 if self._load_as_float16 else torch.float32)
            return _ExactMarianLoader()(model, _Vocabulary(d, config))


def convert(exported_dir: str | Path, out_dir: str | Path, *, quantization: str | None = None,
            force: bool = True) -> Path:
    return Path(ExactMarianConverter(str(exported_dir)).convert(str(out_dir), quantization=quantization,
                                                                 force=force))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exported_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--quantization", default=None, help="e.g. int8, int8_float32, float32")
    args = ap.parse_args(argv)
    print(convert(args.exported_dir, args.out_dir, quantization=args.quantization))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
