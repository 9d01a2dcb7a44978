"""Our EncoderDecoder exported to the Hugging Face Marian layout computes the same thing in
`transformers` (MarianMTModel) and in CTranslate2: logits, greedy generation, token scores."""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import transformers

from model.config import TINY_SEQ2SEQ
from model.generate import greedy, pad_batch
from model.importers import marian
from model.importers.marian import MarianExportError, export_marian
from model.layers import sinusoidal_table
from model.seq2seq import EncoderDecoder

torch.set_num_threads(1)

CFG = TINY_SEQ2SEQ
MAX_NEW = 16


def _reverse_batch(g: torch.Generator, n: int):
    """A task that needs positions: output = the source reversed, then eos."""
    seqs = [torch.randint(4, CFG.vocab_size, (int(k),), generator=g).tolist()
            for k in torch.randint(2, 10, (n,), generator=g)]
    src, _ = pad_batch([s + [CFG.eos_id] for s in seqs], CFG.pad_id)
    tgt, _ = pad_batch([[CFG.bos_id, *s[::-1], CFG.eos_id] for s in seqs], CFG.pad_id)
    return src, tgt


@pytest.fixture(scope="module")
def trained():
    """A tiny model trained for a few seconds, so greedy outputs vary and end with eos (a random
    model with tied embeddings just repeats one token)."""
    torch.manual_seed(0)
    model = EncoderDecoder(CFG)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(150):
        src, tgt = _reverse_batch(g, 32)
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), tgt[:, 1:].reshape(-1), ignore_index=CFG.pad_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def sources():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(4, CFG.vocab_size, (int(n),), generator=g).tolist() + [CFG.eos_id]
            for n in torch.randint(2, 12, (8,), generator=g)]


def _padded_batch():
    src = torch.tensor([[5, 6, 7, 8, 9, 10, 2], [11, 12, 2, 0, 0, 0, 0], [13, 14, 15, 16, 2, 0, 0]])
    tgt = torch.tensor([[1, 20, 21, 22, 23], [1, 24, 25, 0, 0], [1, 26, 27, 28, 29]])
    return src, tgt


def _logit_diff(model: EncoderDecoder, out_dir) -> float:
    export_marian(model, None, out_dir)
    hf = transformers.MarianMTModel.from_pretrained(out_dir).eval()
    src, tgt = _padded_batch()
    with torch.no_grad():
        ours = model(src, tgt)  # (B, T, V)
        theirs = hf(input_ids=src, attention_mask=(src != CFG.pad_id).long(), decoder_input_ids=tgt).logits
    assert theirs.shape == ours.shape
    return (ours - theirs).abs().max().item()


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformers_logits_equal_ours(activation, tmp_path):
    torch.manual_seed(0)
    model = EncoderDecoder(replace(CFG, activation=activation)).eval()
    assert _logit_diff(model, tmp_path) <= 1e-4


def test_trained_model_logits_equal_ours(trained, tmp_path):
    assert _logit_diff(trained, tmp_path) <= 1e-4


def test_marian_positions_are_our_table_permuted(tmp_path):
    model = EncoderDecoder(CFG).eval()
    export_marian(model, None, tmp_path)
    hf = transformers.MarianMTModel.from_pretrained(tmp_path)
    ours = sinusoidal_table(max(CFG.max_src_len, CFG.max_tgt_len), CFG.d_model)
    perm = marian.interleave_to_halves(CFG.d_model)
    for table in (hf.model.encoder.embed_positions.weight, hf.model.decoder.embed_positions.weight):
        assert torch.allclose(table, ours[:, perm], atol=1e-6)


def test_without_the_permutation_logits_differ(trained, tmp_path, monkeypatch):
    """The check above can fail: export the interleaved layout unpermuted and the logits diverge."""
    monkeypatch.setattr(marian, "interleave_to_halves", lambda d: torch.arange(d))
    assert _logit_diff(trained, tmp_path) > 1e-2


def test_transformers_generate_equals_our_greedy(trained, sources, tmp_path):
    ours = greedy(trained, sources, max_len_a=0, max_len_b=MAX_NEW, no_repeat_ngram=0,
                  min_length_ratio=0)  # the peers' plain argmax
    assert len({tuple(o) for o in ours}) == len(ours) and any(len(o) < MAX_NEW for o in ours)  # a real test
    export_marian(trained, None, tmp_path)
    hf = transformers.MarianMTModel.from_pretrained(tmp_path).eval()
    src, mask = pad_batch(sources, CFG.pad_id)
    out = hf.generate(input_ids=src, attention_mask=mask.long(), max_new_tokens=MAX_NEW, do_sample=False,
                      num_beams=1)
    assert (out[:, 0] == CFG.bos_id).all()
    theirs = []
    for row in out[:, 1:].tolist():
        theirs.append(row[: row.index(CFG.eos_id)] if CFG.eos_id in row else row)
    assert theirs == ours


def _ct2_model(model, tmp_path):
    import ctranslate2

    from benchmarks.ct2_convert import convert

    export_marian(model, None, tmp_path / "hf")
    ct_dir = convert(tmp_path / "hf", tmp_path / "ct2")
    vocab = json.loads((tmp_path / "hf" / marian.VOCAB_FILE).read_text())
    tokens = sorted(vocab, key=vocab.get)
    return ctranslate2.Translator(str(ct_dir), device="cpu", intra_threads=1), tokens, vocab


def test_ctranslate2_greedy_equals_ours(trained, sources, tmp_path):
    translator, tokens, vocab = _ct2_model(trained, tmp_path)
    ours = greedy(trained, sources, max_len_a=0, max_len_b=MAX_NEW, no_repeat_ngram=0,
                  min_length_ratio=0)  # the peers' plain argmax
    res = translator.translate_batch([[tokens[i] for i in s] for s in sources], beam_size=1,
                                     max_decoding_length=MAX_NEW)
    assert [[vocab[t] for t in r.hypotheses[0]] for r in res] == ours


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_ctranslate2_token_scores_equal_ours(activation, tmp_path):
    torch.manual_seed(0)
    model = EncoderDecoder(replace(CFG, activation=activation)).eval()
    translator, tokens, _ = _ct2_model(model, tmp_path)
    src, tgt = _padded_batch()
    with torch.no_grad():
        logp = model(src, tgt).log_softmax(-1)  # (B, T, V); row t predicts tgt[t + 1] (eos after the end)
    for b in range(len(src)):
        s = [t for t in src[b].tolist() if t != CFG.pad_id]
        y = [t for t in tgt[b].tolist()[1:] if t != CFG.pad_id] + [CFG.eos_id]
        expected = [logp[b, i, t].item() for i, t in enumerate(y)]
        got = translator.score_batch([[tokens[i] for i in s]], [[tokens[i] for i in y[:-1]]])[0].log_probs
        assert got == pytest.approx(expected, abs=1e-3)


def test_pre_ln_and_other_eps_are_refused():
    with pytest.raises(MarianExportError, match="post-LN"):
        export_marian(EncoderDecoder(replace(CFG, norm_first=True)), None, "/nonexistent")
    with pytest.raises(MarianExportError, match="eps"):
        export_marian(EncoderDecoder(replace(CFG, norm_eps=1e-6)), None, "/nonexistent")


def test_sentencepiece_checkpoint_exports_with_auto_tokenizer(tmp_path):
    """With a SentencePiece tokenizer the folder also loads through AutoTokenizer (MarianTokenizer):
    same ids as ours plus eos; the export goes through the CLI from a saved checkpoint."""
    from model.checkpoint import save_checkpoint
    from model.tokenizer import SentencePieceTokenizer
    from model.translation import encode_source
    from service.cli import main

    texts = ["The Fund may also invest in money market instruments.", "本基金亦可投资于货币市场工具和持有现金。"]
    corpus = texts * 50 + [f"sentence number {i} 第{i}句" for i in range(300)]
    sp = SentencePieceTokenizer.train(corpus, tmp_path / "spm", 400, user_symbols=["<2en>", "<2zh>"], num_threads=1)
    model = EncoderDecoder(replace(CFG, vocab_size=sp.vocab_size)).eval()
    save_checkpoint(model, tmp_path / "ckpt", tokenizer=sp)
    assert main(["weights", "export-marian", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for t in texts:
        assert tok(t).input_ids == sp.encode(t) + [sp.eos_id]
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    src = torch.tensor([encode_source(sp, texts[1], "en")])
    with torch.no_grad():
        diff = (model(src, src[:, :6]) - hf(input_ids=src, decoder_input_ids=src[:, :6]).logits).abs().max()
    assert diff <= 1e-4


def test_cli_export_without_checkpoint_is_a_clear_error(tmp_path, capsys):
    from service.cli import main

    assert main(["weights", "export-marian", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 1
    out, err = capsys.readouterr()  # one line on stderr, as every command's errors
    assert "attnserve weights: export-marian: no checkpoint at" in err and not out


def test_cli_export_to_a_folder_it_cannot_write_is_a_clear_error(capsys):
    """A folder the checks before loading cannot foresee (not writable, a full disk) ended in a traceback."""
    from service.cli import main

    assert main(["weights", "export-marian", "--out", "/proc/attnserve-export"]) == 1  # not even root writes there
    out, err = capsys.readouterr()
    assert "attnserve weights: export-marian: cannot export" in err and "/proc/attnserve-export" in err and not out
