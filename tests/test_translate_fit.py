"""benchmarks/translate_fit.py: per-token loss of a translator on training pairs of one source."""

import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks.translate_fit import sample_train, token_nll
from model.checkpoint import build_model, load_checkpoint, load_tokenizer
from model.training import translate_data
from model.training.train_translate import train
from model.translation import encode_source


def test_train_sample_and_token_loss(tiny_run, tmp_path):
    path, _, data, run = tiny_run
    (data / "train.source").write_text("hk\n" * 200 + "ted\n" * 200, encoding="utf-8")
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    model, tok = load_checkpoint(tmp_path / "export").eval(), load_tokenizer(tmp_path / "export")

    pairs = translate_data.read_split("train", data)
    ted = sample_train("ted", 50, data)
    assert len(ted) == 50 and set(ted) <= set(pairs[200:])
    assert sample_train("ted", 50, data) == ted  # a fixed sample
    assert len(sample_train("hk", 1000, data)) == 200  # capped at what there is
    with pytest.raises(ValueError, match="'xi'"):
        sample_train("xi", 5, data)

    pairs = pairs[:7]
    total, count = 0.0, 0
    with torch.no_grad():
        for en, zh in pairs:  # one example at a time, no padding: the sum over every target token
            src = torch.tensor([encode_source(tok, zh, "en")])
            tgt = torch.tensor([[tok.bos_id, *tok.encode(en), tok.eos_id]])
            logits = model(src, tgt[:, :-1])
            total += F.cross_entropy(logits[0], tgt[0, 1:], reduction="sum").item()
            count += tgt.shape[1] - 1
    assert token_nll(model, tok, pairs, "en") == pytest.approx(total / count, rel=1e-4)

    fresh = build_model(model.cfg).eval()  # untrained: near the uniform distribution's loss
    assert token_nll(fresh, tok, pairs, "en") > token_nll(model, tok, pairs, "en") + 1.0
    assert token_nll(fresh, tok, pairs, "en") == pytest.approx(math.log(model.cfg.vocab_size), rel=0.2)
