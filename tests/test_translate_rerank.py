"""benchmarks/translate_rerank.py: n-best reranking by the reverse direction."""

import pytest
import torch

from benchmarks.translate_rerank import main, rerank, reverse_logprob
from model.checkpoint import load_checkpoint, load_tokenizer
from model.training.train_translate import train
from model.translation import encode_source


def test_reverse_scores_and_report(tiny_run, tmp_path, restore_torch, capsys):
    path, _, data, run = tiny_run
    train(path, run, data_dir=data, export_to=tmp_path / "export")
    model, tok = load_checkpoint(tmp_path / "export").eval(), load_tokenizer(tmp_path / "export")

    source = tok.encode("三七")
    hyps = [tok.encode("three seven"), tok.encode("three"), tok.encode("nine nine nine one")]  # unequal: padded
    got = reverse_logprob(model, tok, source, hyps, "zh")
    with torch.no_grad():  # one at a time, no padding: log P(source + EOS | hypothesis) in the zh direction
        for h, g in zip(hyps, got, strict=True):
            src = torch.tensor([encode_source(tok, tok.decode(h), "zh")])
            assert src[0, 1:-1].tolist() == h
            tgt = torch.tensor([[tok.bos_id, *source, tok.eos_id]])
            logp = torch.log_softmax(model(src, tgt[:, :-1]).float(), -1)
            assert g == pytest.approx(logp[0].gather(-1, tgt[0, 1:, None]).sum().item(), rel=1e-4, abs=1e-4)
    assert got[0] > got[2]  # the faithful hypothesis explains the source better

    records = [{"src_len": 3, "hyps": [{"text": "a", "fwd": -1.0, "rev": -30.0},
                                       {"text": "b", "fwd": -1.5, "rev": -3.0}]}]
    assert rerank(records, 0.0) == ["a"]  # forward score alone: the beam's order
    assert rerank(records, 1.0) == ["b"]  # -1.5 - 1 beats -1 - 10

    main(["--model", str(tmp_path / "export"), "--split", "dev", "--data", str(data), "--tune", "5",
          "--beam", "3", "--base-beam", "2", "--threads", "1", "--lambdas", "0.5,1"])
    table = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| beam")]
    names = [row[0] for row in table]
    assert names[:2] == ["| beam 2", "| beam 3, top"] and names[3] == "| beam 3, oracle"
    assert names[2].startswith("| beam 3, reranked (λ ") and len(table) == 4
    assert all(0.0 <= float(row[i].strip(" |")) <= 100.0 for row in table for i in (1, 2))
    with pytest.raises(SystemExit, match="--tune"):
        main(["--model", str(tmp_path / "export"), "--split", "dev", "--data", str(data), "--tune", "10"])
